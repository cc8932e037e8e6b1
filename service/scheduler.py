"""The scheduler thread: start queued jobs when slots are free, watch running ones, finish them.

One thread, woken every ``poll_interval_s`` or when a job is submitted or cancelled:

1. every STARTING / RUNNING / CANCELLING job is polled through its executor (local processes,
   a Ray cluster, Kubernetes: :mod:`service.executors`); a job that has ended becomes SUCCEEDED
   (exit code 0), CANCELLED (after a cancel) or FAILED (with the executor's reason and the log's
   tail as the summary); a cancelled job is asked to stop once, and killed when it has not
   obeyed within ``cancel_grace_s``;
2. QUEUED jobs start in priority order, FIFO within a priority, while their ``world_size``
   fits into the free slots (the head of the queue is never overtaken, so it cannot starve);
   a job whose owner already runs ``max_running_per_user`` jobs is passed over and blocks nobody.

:meth:`Scheduler.reconcile` runs once before the thread: jobs that still run are tracked again,
jobs started just before a crash (no ref recorded) are adopted, the others are finished.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from datetime import timedelta, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from service import runner
from service.executors import Executor, JobLaunch, make_executor
from service.executors.local import VANISHED, LocalExecutor, make_ref, parse_ref
from service.mlflow_runs import MlflowRuns
from service.settings import Settings
from service.store import ACTIVE_STATES, Job, JobState, jobs_in, queued_in_order, transition, utcnow

log = logging.getLogger(__name__)

__all__ = ["Scheduler", "VANISHED"]

IDLE_WAIT_S = 5.0  # the longest an idle scheduler sleeps between looks (a replica's submit does not wake it)


class Scheduler:
    """Decides when jobs run; its executor runs them. All its methods run on its own thread (or before it starts)."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session], mlflow: MlflowRuns | None,
                 executor: Executor | None = None) -> None:
        self.settings = settings
        self.sessions = sessions
        self.mlflow = mlflow
        self.executor = executor or make_executor(settings)
        self._executors: dict[str, Executor] = {self.executor.name: self.executor}
        self.wake = threading.Event()
        self.max_slots_in_use = 0
        self.failures_total = 0
        self._stop_sent: set[str] = set()
        self._killed: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.reconcile()
        self._thread = threading.Thread(target=self._run, name="meshflow-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop scheduling; running jobs are left running (they are detached) and found again later."""
        self._stop.set()
        self.wake.set()
        if self._thread:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            busy = True
            try:
                busy = self.tick()
            except Exception:  # a bad tick must not kill the scheduler; the next one retries
                log.exception("scheduler tick failed")
            # With no job active nothing changes but by a submit or a cancel, and both wake the thread:
            # an idle plane looks at its store every IDLE_WAIT_S, not 4 times a second.
            self.wake.wait(self.settings.poll_interval_s if busy else max(IDLE_WAIT_S, self.settings.poll_interval_s))
            self.wake.clear()

    def tick(self) -> bool:
        """One look at the store; whether a job was active (starting, running, cancelling) after it."""
        with self.sessions() as session:
            active = jobs_in(session, ACTIVE_STATES)
            for job in active:
                try:
                    self._poll(session, job)
                except Exception:  # e.g. a cluster that does not answer: this job waits, the others go on
                    session.rollback()
                    log.exception("job %s: could not poll it; trying again next tick", job.id)
            started = self._start_queued(session)
        return bool(active) or started > 0

    # ---------------------------------------------------------------- executors

    def launch_of(self, job: Job) -> JobLaunch:
        return JobLaunch(job_id=job.id, workdir=Path(job.workdir), config=job.config, world_size=job.world_size,
                         resolved_plan=job.resolved_plan, env=runner.job_environment(self.settings.job_env,
                                                    tracking_uri=self.settings.mlflow_tracking_uri))

    def executor_of(self, job: Job) -> Executor:
        """The executor that started ``job``: rows from before executors existed ran locally, and a job
        whose start was never recorded is looked for by this server's executor."""
        name = job.executor or (LocalExecutor.name if job.pid is not None else self.executor.name)
        if name not in self._executors:
            self._executors[name] = make_executor(self.settings, name)
        return self._executors[name]

    @staticmethod
    def ref_of(job: Job) -> str | None:
        if job.executor_ref:
            return job.executor_ref
        return make_ref(job.pid, job.pid_start_time) if job.pid is not None else None  # an older row

    def _record_ref(self, session: Session, job: Job, executor: Executor, ref: str, **fields: Any) -> None:
        values: dict[str, Any] = {"executor": executor.name, "executor_ref": ref, **fields}
        if isinstance(executor, LocalExecutor):  # the pid columns stay filled for local jobs (the API shows it)
            values["pid"], values["pid_start_time"] = parse_ref(ref)
        session.execute(update(Job).where(Job.id == job.id).values(**values))
        session.commit()

    # --------------------------------------------------------------- reconcile

    def reconcile(self) -> None:
        """Adopt what an earlier server left: live jobs are tracked, vanished ones finished."""
        with self.sessions() as session:
            for job in jobs_in(session, ACTIVE_STATES):
                try:
                    self._reconcile_one(session, job)
                except Exception:  # the thread's ticks poll it again; the server starts regardless
                    session.rollback()
                    log.exception("job %s: could not reconcile it now; the scheduler retries", job.id)

    def _reconcile_one(self, session: Session, job: Job) -> None:
        executor, launch, ref = self.executor_of(job), self.launch_of(job), self.ref_of(job)
        if ref is None and (ref := executor.adopt(launch)) is not None:
            # Started, but the server died before recording the ref: adopt the job.
            self._record_ref(session, job, executor, ref, started_at=utcnow())
            transition(session, job.id, JobState.RUNNING)
        elif ref is None:
            self._finish(session, job, None, "control plane stopped while starting the job")
        elif (status := executor.poll(ref, launch)).alive:
            log.info("job %s: still running (%s %s); tracking it again", job.id, executor.name, ref)
        else:
            self._finish(session, job, status.exit_code, status.reason)

    # -------------------------------------------------------------------- poll

    def _poll(self, session: Session, job: Job) -> None:
        ref = self.ref_of(job)
        if ref is None:
            return
        executor = self.executor_of(job)
        status = executor.poll(ref, self.launch_of(job))
        if status.alive:
            self._stop_if_cancelled(job, executor, ref)
            return
        self._finish(session, job, status.exit_code, status.reason)

    def _stop_if_cancelled(self, job: Job, executor: Executor, ref: str) -> None:
        """A cancelled job is asked to stop once (SIGTERM), and killed when it ignored that for
        ``cancel_grace_s``."""
        if job.state != JobState.CANCELLING.value or job.id in self._killed:
            return
        if job.id not in self._stop_sent:
            executor.stop(ref)
            self._stop_sent.add(job.id)
            return
        requested = job.cancel_requested_at or utcnow()
        if requested.tzinfo is None:  # SQLite returns naive datetimes
            requested = requested.replace(tzinfo=timezone.utc)
        if utcnow() - requested >= timedelta(seconds=self.settings.cancel_grace_s):
            log.warning("job %s ignored its stop for %.0f s; killing it", job.id, self.settings.cancel_grace_s)
            executor.stop(ref, force=True)
            self._killed.add(job.id)

    def _finish(self, session: Session, job: Job, code: int | None, reason: str | None) -> None:
        session.refresh(job)  # a cancel may have arrived since the job was read
        cancelled = job.state == JobState.CANCELLING.value
        if code == 0:
            state, run_status, error = JobState.SUCCEEDED, "FINISHED", None
        elif cancelled:
            state, run_status, error = JobState.CANCELLED, "KILLED", None
        else:
            state, run_status = JobState.FAILED, "FAILED"
            tail = runner.log_tail(Path(job.workdir), self.settings.log_tail_lines)
            error = "\n".join(part for part in (reason, f"exit code {code}" if code is not None else None, tail)
                              if part)
        if transition(session, job.id, state, exit_code=code, error=error):
            log.info("job %s: %s (exit code %s)", job.id, state.value, code)
            if state is JobState.FAILED:
                self.failures_total += 1
            if job.mlflow_run_id and self.mlflow:
                self.mlflow.end_run_if_open(job.mlflow_run_id, run_status)
        self._stop_sent.discard(job.id)
        self._killed.discard(job.id)

    # ------------------------------------------------------------------- start

    def _start_queued(self, session: Session) -> int:
        """Start the queued jobs that fit; how many started."""
        started = 0
        active = jobs_in(session, ACTIVE_STATES)
        used = sum(job.world_size for job in active)
        running = Counter(job.owner for job in active)
        for job in queued_in_order(session):
            if job.world_size > self.settings.capacity:
                continue  # can never fit (capacity was lowered since): it waits, but blocks nobody
            if running[job.owner] >= self.settings.max_running_per_user:
                continue  # its owner runs their quota: it waits for them, not for the others
            if job.world_size > self.settings.capacity - used:
                break  # strict order: the head waits for its slots, nobody overtakes it
            if not transition(session, job.id, JobState.STARTING):
                continue  # cancelled (or started elsewhere) meanwhile
            used += job.world_size
            running[job.owner] += 1
            self.max_slots_in_use = max(self.max_slots_in_use, used)
            self._launch(session, job)
            started += 1
        return started

    def _launch(self, session: Session, job: Job) -> None:
        try:
            ref = self.executor.start(self.launch_of(job))
        except Exception as err:  # OSError locally; a cluster that refuses the job elsewhere
            log.warning("job %s: could not start: %s", job.id, err)
            transition(session, job.id, JobState.FAILED, error=f"could not start the job ({self.executor.name}): {err}")
            self.failures_total += 1
            if job.mlflow_run_id and self.mlflow:
                self.mlflow.end_run_if_open(job.mlflow_run_id, "FAILED")
            return
        # Recorded whatever the state now is: a cancel that came in meanwhile needs the ref.
        self._record_ref(session, job, self.executor, ref, started_at=utcnow())
        if not transition(session, job.id, JobState.RUNNING):
            self.executor.stop(ref)  # cancelled while starting
            self._stop_sent.add(job.id)
        log.info("job %s: started on %s as %s (%d slots)", job.id, self.executor.name, ref, job.world_size)
