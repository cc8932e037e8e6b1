"""The job store and the scheduler's bookkeeping, in-process (no server, no MLflow): legal transitions
only, one winner per start, reconciliation of the processes an earlier server left behind."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select, text

from service import runner
from service.scheduler import VANISHED, Scheduler
from service.settings import Settings
from service.store import (IllegalTransition, Job, JobState, list_page, make_engine, make_sessionmaker,
                           require_transition, transition)


@pytest.fixture
def store(tmp_path):
    settings = Settings(workspace=tmp_path / "ws", capacity=2, poll_interval_s=0.05)
    settings.jobs_dir.mkdir(parents=True)
    sessions = make_sessionmaker(make_engine(settings.database_url))
    return settings, sessions


def add_job(sessions, settings, state: JobState, **fields) -> Job:
    with sessions() as session:
        job = Job(name="t", state=state.value, config={}, world_size=1, workdir="", **{"owner": "alice", **fields})
        session.add(job)
        session.flush()
        job.workdir = str(settings.jobs_dir / job.id)
        Path(job.workdir).mkdir()
        session.commit()
        return job


def state_of(sessions, job_id: str) -> Job:
    with sessions() as session:
        return session.get(Job, job_id)


def test_only_legal_transitions_happen(store):
    settings, sessions = store
    job = add_job(sessions, settings, JobState.QUEUED)
    with sessions() as session:
        assert transition(session, job.id, JobState.STARTING)
        assert not transition(session, job.id, JobState.STARTING)  # the second scheduler loses
        with pytest.raises(IllegalTransition):
            require_transition(session, job.id, JobState.SUCCEEDED)  # STARTING -> SUCCEEDED skips RUNNING
        assert transition(session, job.id, JobState.RUNNING)
        assert transition(session, job.id, JobState.CANCELLING)
        assert transition(session, job.id, JobState.CANCELLED)
        for target in JobState:
            if target is not JobState.QUEUED:
                assert not transition(session, job.id, target)  # terminal is terminal
    done = state_of(sessions, job.id)
    assert done.state == "CANCELLED" and done.finished_at is not None


def test_the_job_list_is_paged_by_indexes_without_reading_configs(store):
    settings, sessions = store
    for index in range(7):
        add_job(sessions, settings, JobState.QUEUED if index % 2 else JobState.CANCELLED, owner=("alice", "bob")[index % 3 == 0])
    with sessions() as session:
        rows, total = list_page(session, owner="alice", state=None, limit=2, offset=0)
        everyone = list(session.scalars(select(Job).order_by(Job.created_at.desc(), Job.id.desc())))
        alices = [job.id for job in everyone if job.owner == "alice"]
        assert total == len(alices) == 4 and [row.id for row in rows] == alices[:2]
        rows, _ = list_page(session, owner="alice", state=None, limit=2, offset=2)
        assert [row.id for row in rows] == alices[2:4] and not hasattr(rows[0], "config")
        queued, total = list_page(session, owner=None, state=JobState.QUEUED, limit=50, offset=0)
        assert total == 3 and all(row.state == "QUEUED" for row in queued)
        # SQLite walks an index for the filter and the order: no scan of the table, no sort of the matches.
        for where in ("owner = 'alice'", "state = 'QUEUED'", "owner = 'alice' AND state = 'QUEUED'", "1"):
            plan = " ".join(row[-1] for row in session.execute(text(
                f"EXPLAIN QUERY PLAN SELECT name, state, error FROM jobs WHERE {where} ORDER BY created_at DESC, id DESC LIMIT 50")))
            assert "USING INDEX ix_jobs_" in plan and "TEMP B-TREE" not in plan, (where, plan)


def test_reconcile_adopts_live_finishes_recorded_and_fails_vanished(store):
    settings, sessions = store
    live = add_job(sessions, settings, JobState.RUNNING)
    unrecorded = add_job(sessions, settings, JobState.STARTING)
    finished = add_job(sessions, settings, JobState.RUNNING, pid=2**22 + 7, pid_start_time=1)
    vanished = add_job(sessions, settings, JobState.RUNNING, pid=2**22 + 9, pid_start_time=1)
    (Path(finished.workdir) / runner.EXIT_CODE_NAME).write_text("0\n")
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    processes = [subprocess.Popen(sleeper, cwd=job.workdir, start_new_session=True) for job in (live, unrecorded)]
    try:
        with sessions() as session:
            session.get(Job, live.id).pid = processes[0].pid
            session.get(Job, live.id).pid_start_time = runner.process_start_time(processes[0].pid)
            session.commit()
        scheduler = Scheduler(settings, sessions, mlflow=None)
        scheduler.reconcile()
        assert state_of(sessions, live.id).state == "RUNNING"
        adopted = state_of(sessions, unrecorded.id)
        assert adopted.state == "RUNNING" and adopted.pid == processes[1].pid
        assert (state_of(sessions, finished.id).state, state_of(sessions, finished.id).exit_code) == ("SUCCEEDED", 0)
        lost = state_of(sessions, vanished.id)
        assert lost.state == "FAILED" and VANISHED in lost.error

        # The adopted processes are not our children: /proc tells when they end.
        for process in processes:
            process.send_signal(signal.SIGKILL)
            process.wait()
        scheduler.tick()
        assert {state_of(sessions, j.id).state for j in (live, unrecorded)} == {"FAILED"}
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()


def test_recycled_pid_is_not_mistaken_for_the_job():
    assert runner.is_same_process_alive(1, runner.process_start_time(1))
    assert not runner.is_same_process_alive(1, (runner.process_start_time(1) or 0) + 12345)
    assert runner.process_start_time(2**22 + 11) is None


def test_scheduler_starts_fifo_within_priority_and_respects_slots(store, monkeypatch):
    settings, sessions = store
    started: list[str] = []

    class FakeProcess:
        pid = 1

        def poll(self):
            return None

    def fake_start(workdir, config, extra_env=None):
        started.append(Path(workdir).name)
        return runner.Started(pid=1, start_time=runner.process_start_time(1), process=FakeProcess())

    monkeypatch.setattr(runner, "start_job_process", fake_start)
    low = add_job(sessions, settings, JobState.QUEUED, priority=0)
    time.sleep(0.01)
    high = add_job(sessions, settings, JobState.QUEUED, priority=5)
    time.sleep(0.01)
    wide = add_job(sessions, settings, JobState.QUEUED, priority=0)
    with sessions() as session:
        session.get(Job, wide.id).world_size = 2
        session.commit()
    scheduler = Scheduler(settings, sessions, mlflow=None)
    scheduler.tick()
    assert started == [high.id, low.id]  # priority first, then FIFO; the 2-slot job waits
    assert state_of(sessions, wide.id).state == "QUEUED" and scheduler.max_slots_in_use == 2
