"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, status
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field
from sqlalchemy import text

from api.deps import PlaneDep, SessionDep, require_metrics_reader
from api.errors import STORE_RETRY_AFTER_S
from api.models import Message

router = APIRouter(tags=["health"])


class HealthPublic(BaseModel):
    """A liveness or readiness verdict."""

    status: str = Field(description="`ok` when healthy (ready).")


@router.get("/healthz", response_model=HealthPublic)
def read_health() -> HealthPublic:
    """Liveness: the process answers."""
    return HealthPublic(status="ok")


@router.get("/readyz", response_model=HealthPublic,
            responses={503: {"model": Message, "description": "Still warming up, or the job store is unreachable."}})
def read_readiness(plane: PlaneDep, session: SessionDep) -> HealthPublic:
    """Readiness: warmed up (a first validation ran here and in each validation worker) and the job store answers a
    query."""
    if not plane.warm.is_set():  # traffic now would wait seconds for the first validations
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "warming up: the first validations are running",
                            headers={"Retry-After": "1"})
    try:
        session.execute(text("SELECT 1"))
    except Exception as err:
        cause = type(getattr(err, "orig", None) or err).__name__  # the driver's message may name hosts: logs only
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"job store unreachable ({cause})",
                            headers={"Retry-After": str(STORE_RETRY_AFTER_S)}) from None
    return HealthPublic(status="ok")


@router.get("/metrics", response_class=PlainTextResponse, dependencies=[Depends(require_metrics_reader)],
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                             "description": "Prometheus text exposition format."},
                       # a JSON body, as every 401: given as content, since the route's own media type is text
                       401: {"content": {"application/json": {"schema": Message.model_json_schema()}},
                             "description": "No or an unknown bearer token (and MESHFLOW_METRICS_PUBLIC is false)."}})
def read_metrics(plane: PlaneDep, session: SessionDep) -> PlainTextResponse:
    """Prometheus metrics (with a bearer token, unless MESHFLOW_METRICS_PUBLIC): jobs by state, queue depth, slots,
    submissions, failures."""
    return PlainTextResponse(plane.prometheus_text(session), media_type="text/plain; version=0.0.4")
