"""/docs and /redoc are served whole by the service: every script, style sheet and icon they load is
one of its own URLs, and answers. (tests/e2e/test_docs_offline.py opens them in a browser with the
network blocked.)"""

from __future__ import annotations

import re

import httpx
from timing import scaled

ASSET_TYPES = {".js": "javascript", ".css": "text/css", ".png": "image/png"}


def _loaded_urls(html: str) -> list[str]:
    """Every ``src=`` and ``href=`` of a page (scripts, style sheets, icons; the OpenAPI URL is a
    string inside the page's script, checked separately)."""
    return re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", html)


def test_docs_pages_load_only_the_service_own_assets(queue_server):
    with httpx.Client(base_url=queue_server.url, timeout=scaled(60)) as client:
        for page, expected in (("/docs", {"swagger-ui-bundle.js", "swagger-ui.css", "favicon.png"}),
                               ("/redoc", {"redoc.standalone.js", "favicon.png"})):
            response = client.get(page)
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
            urls = _loaded_urls(response.text)
            assert {url.rsplit("/", 1)[-1] for url in urls} == expected, urls
            assert all(url.startswith("/docs-assets/") for url in urls), urls  # same origin, no CDN
            assert "cdn." not in response.text and "fonts.googleapis" not in response.text
            assert "'/openapi.json'" in response.text or '"/openapi.json"' in response.text
            for url in urls:
                asset = client.get(url)
                kind = ASSET_TYPES[url[url.rindex("."):]]
                assert asset.status_code == 200 and kind in asset.headers["content-type"], (url, asset.headers)
                assert len(asset.content) > 1000, url  # the real file, not an error page
                assert asset.headers["cache-control"] == "public, max-age=86400"
        assert client.get("/openapi.json").json()["info"]["title"] == "Meshflow control plane"
        assert client.get("/docs-assets/index.html").status_code == 404  # only the pages' own files
        assert "/docs" not in client.get("/openapi.json").json()["paths"]  # the pages are not API operations


def test_a_422_points_to_docs_that_answer(queue_server):
    """A malformed request's fix names /docs: that page is there (and needs no token)."""
    with queue_server.client("alice") as alice:
        response = alice.post("/v1/jobs", json={"overrides": "train.steps=3"})  # a string, not a list
    assert response.status_code == 422, response.text
    (problem,) = response.json()["detail"]
    assert problem["path"] == "overrides" and problem["fix"] == "see the request schema at /docs"
    assert httpx.get(f"{queue_server.url}/docs", timeout=scaled(60)).status_code == 200
