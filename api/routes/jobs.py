"""/v1/jobs: submit, list, read, cancel, delete jobs; their metrics (logs: :mod:`api.routes.logs`)."""

from __future__ import annotations

import math
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Response, status

from api.deps import CurrentUser, PlaneDep, SessionDep
from api.errors import BODY_RESPONSES, ERROR_RESPONSES, JOB_RESPONSES, QUOTA_RESPONSES
from api.models import JobCreate, JobList, JobPublic, Message, MetricPoint, MetricsPublic
from service.plane import ControlPlane
from service.store import SUMMARY_KEYS, JobState

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=ERROR_RESPONSES)

CONFLICT: dict[int | str, dict[str, Any]] = {409: {"model": Message, "description": "The job's state forbids this."}}


def _public(plane: ControlPlane, job) -> JobPublic:
    return JobPublic.from_job(job, plane.mlflow.ui_link(job.mlflow_experiment_id, job.mlflow_run_id))


@router.post("", status_code=status.HTTP_201_CREATED, response_model=JobPublic,
             responses={200: {"model": JobPublic, "description": "Replay: this Idempotency-Key already made this job."},
                        503: {"model": Message, "description": "The MLflow store is unreachable."},
                        **CONFLICT, **BODY_RESPONSES, **QUOTA_RESPONSES})
def create_job(body: JobCreate, plane: PlaneDep, session: SessionDep, user: CurrentUser, response: Response,
               idempotency_key: Annotated[str | None, Header(max_length=200, description="Same key, same "
                                                                                         "owner: same job.")] = None,
               ) -> JobPublic:
    """Validate a config (overrides or a whole document) and queue it as a job."""
    job, created = plane.submit_job(session, owner=user, name=body.name, overrides=body.overrides,
                                    document=body.config, priority=body.priority, idempotency_key=idempotency_key)
    if not created:
        response.status_code = status.HTTP_200_OK
    return _public(plane, job)


@router.get("", response_model=JobList, responses={403: {"model": Message, "description": "Another user's jobs."}})
def list_jobs(plane: PlaneDep, user: CurrentUser,
              state: Annotated[JobState | None, Query(description="Only jobs in this state.")] = None,
              owner: Annotated[str | None, Query(max_length=200, description="Only this user's jobs (admins).")] = None,
              limit: Annotated[int, Query(ge=1, le=500, description="Page size: at most 500.")] = 50,
              offset: Annotated[int, Query(ge=0, le=10**9, description="Jobs to skip: the next page is at "
                                           "`offset + limit`, the last one below `total`.")] = 0) -> Response:
    """List jobs, newest first, a page at a time: your own, or everyone's for an admin."""
    rows, total = plane.list_jobs(user=user, state=state, owner=owner, limit=limit, offset=offset)
    # Serialized here, once: a returned model would be validated against response_model again.
    return Response(JobList.page_json(rows, keys=SUMMARY_KEYS, total=total, limit=limit, offset=offset,
                                      ui_link=plane.mlflow.ui_link), media_type="application/json")


@router.get("/{job_id}", response_model=JobPublic, responses=JOB_RESPONSES)
def read_job(job_id: str, plane: PlaneDep, session: SessionDep, user: CurrentUser) -> JobPublic:
    """Read one job."""
    return _public(plane, plane.get_job(session, job_id, user=user))


@router.post("/{job_id}/cancel", response_model=JobPublic, responses={**JOB_RESPONSES, **CONFLICT})
def cancel_job(job_id: str, plane: PlaneDep, session: SessionDep, user: CurrentUser) -> JobPublic:
    """Cancel a job: a queued one at once, a running one by SIGTERM to its process group."""
    return _public(plane, plane.cancel_job(session, job_id, user=user))


@router.delete("/{job_id}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response,
               responses={**JOB_RESPONSES, **CONFLICT})
def delete_job(job_id: str, plane: PlaneDep, session: SessionDep, user: CurrentUser) -> Response:
    """Delete an ended job and its files (its MLflow run stays)."""
    plane.delete_job(session, job_id, user=user)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/{job_id}/metrics", response_model=MetricsPublic, responses=JOB_RESPONSES)
def read_job_metrics(job_id: str, plane: PlaneDep, session: SessionDep, user: CurrentUser) -> MetricsPublic:
    """The job's metric histories (loss, lr, grad_norm, ...) from its MLflow run."""
    job = plane.get_job(session, job_id, user=user)
    run_status, histories = plane.metrics_of(job)
    metrics = {key: [MetricPoint(step=p["step"], timestamp=p["timestamp"],
                                 value=p["value"] if math.isfinite(p["value"]) else None) for p in points]
               for key, points in histories.items()}
    return MetricsPublic(job_id=job.id, mlflow_run_id=job.mlflow_run_id, run_status=run_status, metrics=metrics)
