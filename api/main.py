"""The FastAPI app: routers, error handlers, the body-size limit, and the control plane in ``lifespan``.

    python -m api                      # uvicorn on 127.0.0.1:8000
    uvicorn api.main:app               # the same app, settings from MESHFLOW_* variables
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from api.errors import install_error_handlers
from api.middleware import BodySizeLimit, JsonDepthLimit
from api.routes import docs, health, jobs, logs, plans
from service.plane import ControlPlane
from service.settings import Settings


def create_app(settings: Settings | None = None) -> FastAPI:
    """An app for ``settings`` (default: read from the environment); the control plane starts with it."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        plane = ControlPlane(settings)
        plane.start()
        app.state.plane = plane
        try:
            yield
        finally:
            plane.stop()

    # docs_url/redoc_url None: FastAPI's pages load their scripts from a CDN; api/routes/docs.py serves its own.
    app = FastAPI(title="Meshflow control plane", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Submit, queue, run, watch and cancel config-driven PyTorch training jobs.")
    app.add_middleware(JsonDepthLimit, max_depth=settings.max_json_depth)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)  # added last: runs first
    install_error_handlers(app)
    app.include_router(jobs.router)
    app.include_router(logs.router)
    app.include_router(plans.router)
    app.include_router(health.router)
    app.include_router(docs.router)
    return app


app = create_app()
