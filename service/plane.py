"""The control plane without HTTP: submit, list, get, cancel and delete jobs; plans; counters.

    plane = ControlPlane(Settings())
    plane.start()                       # store, MLflow, reconciliation, scheduler thread
    with plane.sessions() as session:
        job, created = plane.submit_job(session, owner="alice", name="demo", overrides=["train.steps=5"])
    plane.stop()                        # running jobs keep running; a later start() adopts them

Every operation that reads a job takes the caller's identity: a user reaches only their own
jobs (others' look missing), an admin reaches all.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from parallel.errors import ConfigError
from parallel.plan.spec import ParallelPlan
from service import runner
from service.leftovers import end_leftovers
from service.limits import check_ceilings, check_queue_quota, plan_slots, stream_slots
from service.mlflow_runs import MlflowRuns
from service.plans import AutoPlanPage, PlanAnswer, plan_in_pool, warm_plan_worker
from service.scheduler import Scheduler
from service.settings import Settings
from service.store import (
    ACTIVE_STATES,
    Job,
    JobState,
    list_page,
    lock_owner_queue,
    make_engine,
    make_sessionmaker,
    require_transition,
    transition,
    utcnow,
)
from service.validation import Validator, resolve_as_service
from trainer.config.schema import RunConfig


class JobNotFound(LookupError):
    """No such job, or not one the caller may see."""


class JobConflict(RuntimeError):
    """The job's state (or an earlier use of the idempotency key) forbids the request."""


class Forbidden(PermissionError):
    """The caller may not ask for this (e.g. another owner's job list)."""


def _make_private_store(url: str) -> None:
    """A SQLite job store (and its -wal / -shm files) readable by its owner only."""
    if not url.startswith("sqlite:///"):
        return
    path = Path(url.removeprefix("sqlite:///"))
    for store_file in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        if store_file.is_file():
            store_file.chmod(runner.FILE_MODE)


class ControlPlane:
    """Store + MLflow + scheduler, wired from one :class:`Settings`."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        assert settings.database_url is not None and settings.mlflow_tracking_uri is not None, "Settings fills them in"
        for directory in (settings.workspace, settings.jobs_dir):  # private: jobs' files, tokens' users, the store
            directory.mkdir(mode=runner.DIR_MODE, parents=True, exist_ok=True)
            directory.chmod(runner.DIR_MODE)
        self.engine = make_engine(settings.database_url, pool_size=settings.db_pool_size,
                                  max_overflow=settings.db_max_overflow, pool_timeout=settings.db_pool_timeout_s)
        _make_private_store(settings.database_url)
        self.log_streams = stream_slots(settings.max_log_streams_per_user)
        self.plan_slots = plan_slots(settings.max_plans_per_user)
        self.sessions = make_sessionmaker(self.engine)
        # WAL on a SQLite MLflow store when every process that writes it (the jobs) is on this host.
        self.mlflow = MlflowRuns(settings.mlflow_tracking_uri, settings.mlflow_ui_url,
                                 sqlite_wal=settings.executor == "local", artifact_root=settings.mlflow_artifact_root)
        self.scheduler = Scheduler(settings, self.sessions, self.mlflow)
        self.validator = Validator(settings, warm_up=warm_plan_worker)
        self.submissions_total = 0
        self._counter_lock = threading.Lock()
        self.warm = threading.Event()  # set once the first validations (here and in the pool) have run

    def start(self) -> None:
        end_leftovers(self.settings.workspace)  # validation workers a killed server left running
        self.mlflow.warm_up()
        self.scheduler.start()
        self.validator.start()
        # The first validation imports torch.distributed and Hydra and builds a first model (seconds,
        # wherever validations run): pay it now, not in the first requests. /readyz waits for it.
        threading.Thread(target=self._warm_up, name="meshflow-warm-up", daemon=True).start()

    def _warm_up(self) -> None:
        """Warm where validations run: the pool's workers (each warms itself as it starts), or this
        process when the validator has none. A validation here beside the workers' only took CPU from
        them: on the 2-core host at load 11-14 the first submission's validation came 31-33 s after
        start without it, 37.5-38.6 s with it."""
        if self.validator.workers == 0:
            try:
                self.resolve(overrides=[], document=None)
            except Exception:  # only a warm-up: a real request reports any problem properly
                pass
        self.validator.wait_warm()
        self.warm.set()

    def stop(self) -> None:
        self.scheduler.stop()
        self.validator.stop()
        self.engine.dispose()

    # ------------------------------------------------------------------ submit

    def resolve(self, *, overrides: list[str] | None, document: dict[str, Any] | None,
                workdir: Path | None = None) -> tuple[RunConfig, ParallelPlan]:
        """The validated, confined config of a submission and its plan (the same checks as a job gets)."""
        return resolve_as_service(self.settings, overrides=overrides, document=document,
                                  workdir=workdir or self.settings.jobs_dir / "plan")

    def plan(self, *, owner: str, overrides: list[str] | None, document: dict[str, Any] | None,
             page: AutoPlanPage = AutoPlanPage()) -> PlanAnswer:
        """The validated config and its plan (:mod:`service.plans`), computed in the validation pool
        within the service's limits; at most ``max_plans_per_user`` at once per owner (429 past it)."""
        with self.plan_slots.slot(owner):
            return plan_in_pool(self.validator, owner=owner, overrides=overrides, document=document, page=page)

    def submit_job(self, session: Session, *, owner: str, name: str, overrides: list[str] | None = None,
                   document: dict[str, Any] | None = None, priority: int = 0,
                   idempotency_key: str | None = None) -> tuple[Job, bool]:
        """Validate and queue a job: ``(job, created)``; ``created`` is False for an idempotent replay."""
        idempotency_key = idempotency_key or None  # an empty header is no key
        request_hash = hashlib.sha256(json.dumps([name, overrides, document, priority], sort_keys=True,
                                                 default=str).encode()).hexdigest()
        if idempotency_key and (existing := self._by_key(session, owner, idempotency_key)):
            return self._replay(existing, request_hash), False
        check_queue_quota(session, owner=owner, settings=self.settings)
        # End the read transaction: its pooled connection goes back while the config is validated
        # (~0.1-0.2 s of CPU), so concurrent submits never queue for connections.
        session.commit()
        job_id = str(uuid.uuid4())
        workdir = self.settings.jobs_dir / job_id
        cfg, resolved_plan = self.validator.validate_job(overrides=overrides, document=document, workdir=workdir)
        # (the world size against capacity was checked before validating: service.limits.check_size_ceilings)
        issues = check_ceilings(cfg, self.settings, priority=priority, is_admin=self.settings.is_admin(owner))
        if issues:
            raise ConfigError(issues)
        config = cfg.model_dump(mode="json")
        experiment_id = run_id = None
        if cfg.tracking.backend == "mlflow":
            experiment_id, run_id = self.mlflow.create_run(
                cfg.tracking.experiment, cfg.tracking.run_name or name,
                tags={"meshflow.job_id": job_id, "meshflow.owner": owner, "mlflow.user": owner})
            config["tracking"]["run_id"] = run_id
        job = Job(id=job_id, name=name, owner=owner, state=JobState.QUEUED.value, priority=priority,
                  overrides=list(overrides) if overrides is not None else None, config=config,
                  resolved_plan=resolved_plan, world_size=cfg.world_size, created_at=utcnow(), mlflow_run_id=run_id,
                  mlflow_experiment_id=experiment_id, idempotency_key=idempotency_key,
                  request_hash=request_hash, workdir=str(workdir))
        try:
            # The quota again, now counted and filled in one step: concurrent submissions of one
            # owner passed the early check above together (it only spares them the validation).
            lock_owner_queue(session, owner)
            check_queue_quota(session, owner=owner, settings=self.settings)
            session.add(job)
            session.commit()
        except IntegrityError:  # the same key, submitted concurrently: the first one wins
            session.rollback()
            if run_id:
                self.mlflow.delete_run(run_id)
            existing = self._by_key(session, owner, idempotency_key) if idempotency_key else None
            if existing is None:
                raise
            return self._replay(existing, request_hash), False
        except Exception:  # the store failed or the queue filled meanwhile: leave no orphan RUNNING run behind
            session.rollback()
            if run_id:
                self.mlflow.delete_run(run_id)
            raise
        with self._counter_lock:
            self.submissions_total += 1
        self.scheduler.wake.set()
        return job, True

    @staticmethod
    def _by_key(session: Session, owner: str, key: str) -> Job | None:
        return session.scalar(select(Job).where(Job.owner == owner, Job.idempotency_key == key))

    @staticmethod
    def _replay(job: Job, request_hash: str) -> Job:
        if job.request_hash != request_hash:
            raise JobConflict(f"Idempotency-Key already used for job {job.id} with a different request; "
                              "use a new key for a new job")
        return job

    # -------------------------------------------------------------------- read

    def get_job(self, session: Session, job_id: str, *, user: str) -> Job:
        job = session.get(Job, job_id)
        if job is None or not (self.settings.is_admin(user) or job.owner == user):
            raise JobNotFound(f"no job {job_id}")
        session.refresh(job)
        return job

    def list_jobs(self, *, user: str, state: JobState | None = None, owner: str | None = None,
                  limit: int = 50, offset: int = 0) -> tuple[list[Any], int]:
        """A page of jobs, newest first (rows of :data:`service.store.SUMMARY_COLUMNS`: no config), and
        the total that match; read on a plain connection (a read needs no ORM session)."""
        if not self.settings.is_admin(user):
            if owner is not None and owner != user:
                raise Forbidden(f"user {user!r} may list only their own jobs")
            owner = user
        with self.engine.connect() as connection:
            return list_page(connection, owner=owner, state=state, limit=limit, offset=offset)

    def log_path(self, job: Job) -> Path:
        return Path(job.workdir) / runner.LOG_NAME

    def metrics_of(self, job: Job) -> tuple[str | None, dict[str, list[dict[str, Any]]]]:
        if not job.mlflow_run_id:
            return None, {}
        return self.mlflow.metric_histories(job.mlflow_run_id)

    # ------------------------------------------------------------------ change

    def cancel_job(self, session: Session, job_id: str, *, user: str) -> Job:
        """Stop a job: a queued one is CANCELLED at once, a running one gets SIGTERM (SIGKILL later) from the
        scheduler."""
        job = self.get_job(session, job_id, user=user)
        state = job.job_state
        if state is JobState.QUEUED:
            if not transition(session, job.id, JobState.CANCELLED):
                return self.cancel_job(session, job_id, user=user)  # it started meanwhile: stop it
            if job.mlflow_run_id:
                self.mlflow.end_run_if_open(job.mlflow_run_id, "KILLED")
        elif state in (JobState.STARTING, JobState.RUNNING):
            # The scheduler's thread asks the job's executor to stop it (SIGTERM on every node) at once.
            require_transition(session, job.id, JobState.CANCELLING, cancel_requested_at=utcnow())
        elif state.is_terminal:
            raise JobConflict(f"job {job.id} already ended {state.value}")
        self.scheduler.wake.set()
        session.refresh(job)
        return job

    def delete_job(self, session: Session, job_id: str, *, user: str) -> None:
        """Forget a finished job and its files (its MLflow run stays)."""
        job = self.get_job(session, job_id, user=user)
        if not job.job_state.is_terminal:
            raise JobConflict(f"job {job.id} is {job.state}; cancel it first and delete it when it has ended")
        workdir = Path(job.workdir)
        session.delete(job)
        session.commit()
        if workdir.parent == self.settings.jobs_dir:
            shutil.rmtree(workdir, ignore_errors=True)

    # ----------------------------------------------------------------- metrics

    def prometheus_text(self, session: Session) -> str:
        counts = dict(session.execute(select(Job.state, func.count()).group_by(Job.state)).all())
        active = session.scalars(select(Job).where(Job.state.in_([s.value for s in ACTIVE_STATES])))
        slots = sum(job.world_size for job in active)
        lines = ["# HELP meshflow_jobs Jobs in the store by state.", "# TYPE meshflow_jobs gauge"]
        lines += [f'meshflow_jobs{{state="{s.value}"}} {counts.get(s.value, 0)}' for s in JobState]
        metrics = [
            ("meshflow_queue_depth", "gauge", "Jobs waiting for worker slots.", counts.get("QUEUED", 0)),
            ("meshflow_slots_in_use", "gauge", "Worker slots held by active jobs.", slots),
            ("meshflow_slots_capacity", "gauge", "Worker slots this service schedules onto.", self.settings.capacity),
            ("meshflow_max_slots_in_use", "gauge", "Most slots held at once since start.",
             self.scheduler.max_slots_in_use),
            ("meshflow_submissions_total", "counter", "Jobs accepted since start.", self.submissions_total),
            ("meshflow_job_failures_total", "counter", "Jobs that ended FAILED since start.",
             self.scheduler.failures_total),
            ("meshflow_plans_computing", "gauge", "Plans computing in the plans' validation workers.",
             sum(self.validator.plans.running().values())),
            ("meshflow_plans_waiting", "gauge", "Plans waiting for one of the plans' validation workers.",
             sum(self.validator.plans.waiting().values())),
        ]
        for name, kind, help_text, value in metrics:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return "\n".join(lines) + "\n"
