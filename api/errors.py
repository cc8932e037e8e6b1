"""Exception handlers: service errors become HTTP statuses; every 422 is a list of {path, reason, fix}."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from sqlalchemy import exc as db_errors
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from api.models import Message, ProblemList
from parallel.errors import ConfigError
from service.limits import QuotaExceeded
from service.mlflow_runs import TrackingUnavailable
from service.plane import Forbidden, JobConflict, JobNotFound
from service.store import IllegalTransition

STORE_RETRY_AFTER_S = 5  # what a 503 tells clients to wait while the job store is unreachable

# Documented on every route, so clients (and schemathesis) know each status's body.
ERROR_RESPONSES: dict[int | str, dict] = {
    401: {"model": Message, "description": "Missing or unknown bearer token."},
    422: {"model": ProblemList, "description": "The request or the config is invalid: every problem's path, "
                                               "reason and fix."},
    503: {"model": Message, "description": "The job store (or the MLflow store) is unreachable for now: try again "
          "after `Retry-After` seconds.", "headers": {"Retry-After": {"description": "Seconds to wait.",
                                                                      "schema": {"type": "integer"}}}},
}
JOB_RESPONSES: dict[int | str, dict] = {404: {"model": Message, "description": "No such job, or not yours."}}
QUOTA_RESPONSES: dict[int | str, dict] = {
    429: {"model": ProblemList, "description": "A per-user quota is full: which one, its limit and what to do."}}
BODY_RESPONSES: dict[int | str, dict] = {
    400: {"model": Message, "description": "The body could not be parsed."},
    413: {"model": Message, "description": "Request body too large."},
}


def _problem(path: str, reason: str, fix: str) -> dict[str, str]:
    return {"path": path, "reason": reason, "fix": fix}


def _request_path(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) if parts else "<body>"


async def config_error_handler(_: Request, err: ConfigError) -> JSONResponse:
    return JSONResponse({"detail": [issue.as_dict() for issue in err.issues]}, status_code=422)


async def request_validation_handler(_: Request, err: RequestValidationError) -> JSONResponse:
    problems = [_problem(_request_path(tuple(e.get("loc", ()))), str(e.get("msg", "invalid")),
                         "see the request schema at /docs") for e in err.errors()]
    return JSONResponse({"detail": problems}, status_code=422)


async def quota_handler(_: Request, err: QuotaExceeded) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s is not None else None
    return JSONResponse({"detail": [issue.as_dict() for issue in err.issues]}, status_code=429, headers=headers)


async def not_found_handler(_: Request, err: JobNotFound) -> JSONResponse:
    return JSONResponse({"detail": str(err)}, status_code=404)


async def conflict_handler(_: Request, err: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(err)}, status_code=409)


async def forbidden_handler(_: Request, err: Forbidden) -> JSONResponse:
    return JSONResponse({"detail": str(err)}, status_code=403)


def _api_routes(routes) -> Iterator[APIRoute]:
    """Every APIRoute, also those of included routers (FastAPI keeps an included router whole, as
    one entry holding ``original_router``, rather than copying its routes into the app's list)."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        elif (inner := getattr(route, "original_router", None)) is not None:
            yield from _api_routes(inner.routes)


async def http_error_handler(request: Request, err: StarletteHTTPException) -> Response:
    """FastAPI's own handler, except that a 405 lists every method of the path in ``Allow``.

    Starlette answers with the methods of the first route matching the path only, while FastAPI
    registers one route per method (GET /v1/jobs and POST /v1/jobs are two routes).
    """
    if err.status_code == 405:
        methods: set[str] = set()
        for route in _api_routes(request.app.router.routes):
            match, _ = route.matches(request.scope)
            if match != Match.NONE:
                methods |= route.methods or set()
        err = StarletteHTTPException(405, err.detail, headers={"Allow": ", ".join(sorted(methods))})
    return await http_exception_handler(request, err)


async def unavailable_handler(_: Request, err: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(err)}, status_code=503, headers={"Retry-After": str(STORE_RETRY_AFTER_S)})


async def store_unavailable_handler(_: Request, err: Exception) -> JSONResponse:
    """The job store did not answer (a database restart, a network cut, a pool with no free
    connection): a 503 the client may retry, not a 500. The driver's message stays in the
    server's log: it may name hosts and statements."""
    cause = type(getattr(err, "orig", None) or err).__name__
    return JSONResponse({"detail": f"the job store is unavailable ({cause}); try again in {STORE_RETRY_AFTER_S} s"},
                        status_code=503, headers={"Retry-After": str(STORE_RETRY_AFTER_S)})


def install_error_handlers(app: FastAPI) -> None:
    # Registered through FastAPI's decorator, which takes a handler of the error class it is for
    # (Starlette's add_exception_handler is typed for handlers of any Exception).
    app.exception_handler(TrackingUnavailable)(unavailable_handler)
    # Lost or refused connections and an exhausted pool; other database errors (a constraint, a bad
    # statement) are bugs and stay 500s.
    for unreachable in (db_errors.OperationalError, db_errors.InterfaceError, db_errors.TimeoutError):
        app.exception_handler(unreachable)(store_unavailable_handler)
    app.exception_handler(StarletteHTTPException)(http_error_handler)
    app.exception_handler(ConfigError)(config_error_handler)
    app.exception_handler(QuotaExceeded)(quota_handler)
    app.exception_handler(RequestValidationError)(request_validation_handler)
    app.exception_handler(JobNotFound)(not_found_handler)
    app.exception_handler(JobConflict)(conflict_handler)
    app.exception_handler(IllegalTransition)(conflict_handler)
    app.exception_handler(Forbidden)(forbidden_handler)
