"""The scheduler thread: start queued jobs when slots are free, watch running ones, finish them.

One thread, woken every ``poll_interval_s`` or when a job is submitted or cancelled:

1. every STARTING / RUNNING / CANCELLING job is polled: ``Popen.poll`` for our own children,
   ``/proc`` liveness + start time for jobs started by an earlier server; a dead job's exit code
   comes from its ``exit_code`` file (written by :mod:`service.supervise`) and decides
   SUCCEEDED (0), CANCELLED (after a cancel) or FAILED (with the log's tail as the summary);
   a cancel not obeyed within ``cancel_grace_s`` escalates to SIGKILL of the process group;
2. QUEUED jobs start in priority order, FIFO within a priority, while their ``world_size``
   fits into the free slots (the head of the queue is never overtaken, so it cannot starve);
   a job whose owner already runs ``max_running_per_user`` jobs is passed over and blocks nobody.

:meth:`Scheduler.reconcile` runs once before the thread: jobs whose process is still alive
are tracked again, jobs whose process vanished are finished from their exit-code file or FAILED.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
from collections import Counter
from datetime import timedelta, timezone
from pathlib import Path

from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from service import runner
from service.mlflow_runs import MlflowRuns
from service.settings import Settings
from service.store import ACTIVE_STATES, Job, JobState, jobs_in, queued_in_order, transition, utcnow

log = logging.getLogger(__name__)

VANISHED = "process vanished while the control plane was down"


class Scheduler:
    """Owns the job processes of this server; all its methods run on its own thread (or before it starts)."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session], mlflow: MlflowRuns | None) -> None:
        self.settings = settings
        self.sessions = sessions
        self.mlflow = mlflow
        self.wake = threading.Event()
        self.max_slots_in_use = 0
        self.failures_total = 0
        self._children: dict[str, subprocess.Popen] = {}
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
            try:
                self.tick()
            except Exception:  # a bad tick must not kill the scheduler; the next one retries
                log.exception("scheduler tick failed")
            self.wake.wait(self.settings.poll_interval_s)
            self.wake.clear()

    def tick(self) -> None:
        with self.sessions() as session:
            for job in jobs_in(session, ACTIVE_STATES):
                self._poll(session, job)
            self._start_queued(session)

    # --------------------------------------------------------------- reconcile

    def reconcile(self) -> None:
        """Adopt what an earlier server left: live jobs are tracked, vanished ones finished."""
        with self.sessions() as session:
            for job in jobs_in(session, ACTIVE_STATES):
                if job.pid is None and (pid := runner.find_job_process(Path(job.workdir))) is not None:
                    # Started, but the server died before recording the pid: adopt the process.
                    session.execute(update(Job).where(Job.id == job.id).values(
                        pid=pid, pid_start_time=runner.process_start_time(pid), started_at=utcnow()))
                    session.commit()
                    transition(session, job.id, JobState.RUNNING)
                elif job.pid is None:
                    self._finish(session, job, None, "control plane stopped while starting the job")
                elif runner.is_same_process_alive(job.pid, job.pid_start_time):
                    log.info("job %s: process %d still running; tracking it again", job.id, job.pid)
                else:
                    code = runner.read_exit_code(Path(job.workdir))
                    self._finish(session, job, code, None if code is not None else VANISHED)

    # -------------------------------------------------------------------- poll

    def _poll(self, session: Session, job: Job) -> None:
        if job.pid is None:
            return
        child = self._children.get(job.id)
        if child is not None:
            code = child.poll()
            alive = code is None
            if code is not None and code < 0:
                code = 128 - code
        else:
            alive, code = runner.is_same_process_alive(job.pid, job.pid_start_time), None
        if alive:
            self._escalate_cancel(job)
            return
        recorded = runner.read_exit_code(Path(job.workdir))
        code = recorded if recorded is not None else code
        # Workers the supervisor left behind (it was SIGKILLed) go with their group.
        runner.signal_group(job.pid, signal.SIGKILL)
        self._finish(session, job, code, None if code is not None else VANISHED)

    def _escalate_cancel(self, job: Job) -> None:
        if job.state != JobState.CANCELLING.value or job.id in self._killed or job.cancel_requested_at is None:
            return
        requested = job.cancel_requested_at
        if requested.tzinfo is None:  # SQLite returns naive datetimes
            requested = requested.replace(tzinfo=timezone.utc)
        if utcnow() - requested >= timedelta(seconds=self.settings.cancel_grace_s):
            log.warning("job %s ignored SIGTERM for %.0f s; sending SIGKILL", job.id, self.settings.cancel_grace_s)
            runner.signal_group(job.pid, signal.SIGKILL)
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
            error = "\n".join(part for part in (reason, f"exit code {code}" if code is not None else None, tail) if part)
        if transition(session, job.id, state, exit_code=code, error=error):
            log.info("job %s: %s (exit code %s)", job.id, state.value, code)
            if state is JobState.FAILED:
                self.failures_total += 1
            if job.mlflow_run_id and self.mlflow:
                self.mlflow.end_run_if_open(job.mlflow_run_id, run_status)
        self._children.pop(job.id, None)
        self._killed.discard(job.id)

    # ------------------------------------------------------------------- start

    def _start_queued(self, session: Session) -> None:
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

    def _launch(self, session: Session, job: Job) -> None:
        try:
            started = runner.start_job_process(Path(job.workdir), job.config, self.settings.job_env)
        except OSError as err:
            transition(session, job.id, JobState.FAILED, error=f"could not start the job: {err}")
            self.failures_total += 1
            if job.mlflow_run_id and self.mlflow:
                self.mlflow.end_run_if_open(job.mlflow_run_id, "FAILED")
            return
        self._children[job.id] = started.process
        now = utcnow()
        # Recorded whatever the state now is: a cancel that came in meanwhile needs the pid.
        session.execute(update(Job).where(Job.id == job.id)
                        .values(pid=started.pid, pid_start_time=started.start_time, started_at=now))
        session.commit()
        if not transition(session, job.id, JobState.RUNNING):
            runner.signal_group(started.pid, signal.SIGTERM)  # cancelled while starting
        log.info("job %s: started pid %d (%d slots)", job.id, started.pid, job.world_size)

