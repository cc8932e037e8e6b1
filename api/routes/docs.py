"""The API's documentation pages, /docs (Swagger UI) and /redoc (ReDoc), with their scripts and styles
served by this service: they work on a machine without internet, where FastAPI's default pages
(which load them from a CDN) stay blank.

The assets come from the ``fastapi-offline`` package, which ships Swagger UI 5 and ReDoc 2 as files
(its ``static/`` folder); the pages are FastAPI's own (``get_swagger_ui_html``, ``get_redoc_html``)
pointed at them. ``create_app`` turns FastAPI's default pages off (``docs_url=None, redoc_url=None``).
"""

from __future__ import annotations

from enum import Enum
from importlib.resources import files
from pathlib import Path

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse

ASSETS_DIR = Path(str(files("fastapi_offline") / "static"))
ASSETS_URL = "/docs-assets"

router = APIRouter(include_in_schema=False)


class Asset(str, Enum):
    """The files the pages load; nothing else under ASSETS_DIR is served."""

    swagger_js = "swagger-ui-bundle.js"
    swagger_css = "swagger-ui.css"
    redoc_js = "redoc.standalone.js"
    favicon = "favicon.png"


def _url(request: Request, path: str) -> str:
    """``path`` under the app's root path (a proxy serving the API under a prefix sets it)."""
    return f"{request.scope.get('root_path', '').rstrip('/')}{path}"


@router.get("/docs")
def read_swagger_ui(request: Request) -> HTMLResponse:
    """Swagger UI: every operation, its schemas, and a form to try it."""
    return get_swagger_ui_html(openapi_url=_url(request, request.app.openapi_url),
                               title=f"{request.app.title} - Swagger UI", oauth2_redirect_url=None,
                               swagger_js_url=_url(request, f"{ASSETS_URL}/{Asset.swagger_js.value}"),
                               swagger_css_url=_url(request, f"{ASSETS_URL}/{Asset.swagger_css.value}"),
                               swagger_favicon_url=_url(request, f"{ASSETS_URL}/{Asset.favicon.value}"),
                               swagger_ui_parameters=request.app.swagger_ui_parameters)


@router.get("/redoc")
def read_redoc(request: Request) -> HTMLResponse:
    """ReDoc: the same OpenAPI document as one long reference page."""
    return get_redoc_html(openapi_url=_url(request, request.app.openapi_url), title=f"{request.app.title} - ReDoc",
                          redoc_js_url=_url(request, f"{ASSETS_URL}/{Asset.redoc_js.value}"),
                          redoc_favicon_url=_url(request, f"{ASSETS_URL}/{Asset.favicon.value}"),
                          with_google_fonts=False)  # fonts from Google would be one more request to the internet


@router.get(ASSETS_URL + "/{name}")
def read_docs_asset(name: str) -> FileResponse:
    """One script, style sheet or icon of the pages; cached by the browser for a day (they change with
    the package's version only)."""
    if name not in {asset.value for asset in Asset}:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no documentation asset {name!r}")
    return FileResponse(ASSETS_DIR / name, headers={"Cache-Control": "public, max-age=86400"})
