"""The job store and the scheduler's bookkeeping, in-process (no server, no MLflow): legal transitions
only, one winner per start, reconciliation of the processes an earlier server left behind.

Every test that uses the store runs twice: on SQLite (the default) and on a real PostgreSQL
server the session starts (``postgres_url`` in tests/conftest.py; skipped without the binaries,
failed under CI=true).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import func, select, text

from api.models import JobList, JobSummary
from service import runner
from service.scheduler import VANISHED, Scheduler
from service.settings import Settings
from service.store import (
    SUMMARY_KEYS,
    IllegalTransition,
    Job,
    JobState,
    list_page,
    make_engine,
    make_sessionmaker,
    require_transition,
    transition,
)


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(tmp_path, request) -> str:
    """An empty job store: a SQLite file in tmp_path, or a new database on the session's PostgreSQL."""
    if request.param == "postgresql":
        return request.getfixturevalue("postgres_url")
    return f"sqlite:///{tmp_path / 'jobs.db'}"


@pytest.fixture
def store(tmp_path, database_url):
    settings = Settings(workspace=tmp_path / "ws", capacity=2, poll_interval_s=0.05, database_url=database_url)
    settings.jobs_dir.mkdir(parents=True)
    engine = make_engine(settings.database_url)
    assert engine.dialect.name == database_url.split(":")[0].split("+")[0]  # the store is the one asked for
    yield settings, make_sessionmaker(engine)
    engine.dispose()


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
        add_job(sessions, settings, JobState.QUEUED if index % 2 else JobState.CANCELLED,
                owner=("alice", "bob")[index % 3 == 0])
    with sessions() as session:
        rows, total = list_page(session, owner="alice", state=None, limit=2, offset=0)
        everyone = list(session.scalars(select(Job).order_by(Job.created_at.desc(), Job.id.desc())))
        alices = [job.id for job in everyone if job.owner == "alice"]
        assert total == len(alices) == 4 and [row.id for row in rows] == alices[:2]
        rows, _ = list_page(session, owner="alice", state=None, limit=2, offset=2)
        assert [row.id for row in rows] == alices[2:4] and not hasattr(rows[0], "config")
        queued, total = list_page(session, owner=None, state=JobState.QUEUED, limit=50, offset=0)
        assert total == 3 and all(row.state == "QUEUED" for row in queued)
        with session.get_bind().connect() as connection:  # the list endpoint's way: a plain connection
            alices_queued, total = list_page(connection, owner="alice", state=JobState.QUEUED, limit=50, offset=0)
        assert total == 2 and [row.id for row in alices_queued] == [row.id for row in queued if row.owner == "alice"]
        # The endpoint's one-pass page is exactly the page of JobSummary models built one by one.
        link = lambda experiment_id, run_id: f"http://mlflow.example/{experiment_id}/{run_id}"  # noqa: E731
        by_model = JobList(items=[JobSummary(**JobSummary.fields_of(row,
                                                                    link(row.mlflow_experiment_id, row.mlflow_run_id)))
                                  for row in queued], total=3, limit=50, offset=0).model_dump_json()
        assert JobList.page_json(queued, keys=SUMMARY_KEYS, total=3, limit=50, offset=0, ui_link=link) == by_model
        assert '"state":"QUEUED"' in by_model and 'Z","started_at":null' in by_model  # UTC times, as documented
        # An index serves the filter and the order: no scan of the table, no sort of the matches.
        # PostgreSQL's planner prefers a scan of 7 rows, so it is told scans and sorts cost the earth:
        # a Sort left in the plan is one no index could avoid.
        postgres = session.get_bind().dialect.name == "postgresql"
        if postgres:
            for setting in ("enable_seqscan", "enable_bitmapscan", "enable_sort"):
                session.execute(text(f"SET LOCAL {setting} = off"))
        explain = "EXPLAIN" if postgres else "EXPLAIN QUERY PLAN"
        for where in ("owner = 'alice'", "state = 'QUEUED'", "owner = 'alice' AND state = 'QUEUED'", "TRUE"):
            plan = " ".join(str(row[-1]) for row in session.execute(text(
                f"{explain} SELECT name, state, error FROM jobs WHERE {where} ORDER BY created_at DESC, id "
                "DESC LIMIT 50")))
            if postgres:
                assert "Index Scan Backward using ix_jobs_" in plan and "Sort" not in plan, (where, plan)
            else:
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

    priorities: list[int] = []

    def fake_start(workdir, config, extra_env=None, *, niceness=0, resolved_plan=None):
        started.append(Path(workdir).name)
        priorities.append(niceness)
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
    assert priorities == [settings.job_nice] * 2 == [10, 10]  # below the server's CPU priority (MESHFLOW_JOB_NICE)
    assert state_of(sessions, wide.id).state == "QUEUED" and scheduler.max_slots_in_use == 2


def _at_once(count: int, work) -> list:
    """``work(i)`` on ``count`` threads released together by a barrier; the results (or exceptions) in order."""
    barrier = threading.Barrier(count)

    def run(i: int):
        barrier.wait()
        try:
            return work(i)
        except Exception as err:  # returned, so the test shows every thread's failure
            return err

    with ThreadPoolExecutor(max_workers=count) as pool:
        return list(pool.map(run, range(count)))


def test_racing_schedulers_start_a_job_once(store):
    settings, sessions = store
    jobs = [add_job(sessions, settings, JobState.QUEUED) for _ in range(3)]

    def start_all(_):
        with sessions() as session:
            return [transition(session, job.id, JobState.STARTING) for job in jobs]

    outcomes = _at_once(8, start_all)
    assert not [o for o in outcomes if isinstance(o, Exception)], outcomes
    assert [sum(o[i] for o in outcomes) for i in range(len(jobs))] == [1, 1, 1]  # one winner per job
    assert {state_of(sessions, job.id).state for job in jobs} == {"STARTING"}


def test_servers_starting_together_on_a_new_store_create_it_once(database_url):
    """Replicas of the control plane (or a restart racing a migration) create the tables at once."""
    engines = _at_once(4, lambda _: make_engine(database_url))
    try:
        assert not [e for e in engines if isinstance(e, Exception)], engines
        with make_sessionmaker(engines[0])() as session:
            session.add(Job(name="t", owner="alice", config={"a": [1, 2]}, world_size=1, workdir="w"))
            session.commit()
        with make_sessionmaker(engines[-1])() as session:
            assert [(j.owner, j.config) for j in session.scalars(select(Job))] == [("alice", {"a": [1, 2]})]
    finally:
        for engine in engines:
            if not isinstance(engine, Exception):
                engine.dispose()


def test_times_read_back_as_the_same_instant_and_are_served_in_utc(store):
    """PostgreSQL returns timestamptz in the server's zone (the tests' server is not on UTC), SQLite
    naive values: the same instant either way, and the API shows it in UTC."""
    from api.models import JobPublic

    settings, sessions = store
    moment = datetime(2026, 3, 8, 6, 59, 58, 123456, tzinfo=timezone.utc)  # around a DST change in New York
    job = add_job(sessions, settings, JobState.QUEUED, created_at=moment)
    read = state_of(sessions, job.id).created_at
    assert (read if read.tzinfo else read.replace(tzinfo=timezone.utc)) == moment
    shown = JobPublic.from_job(state_of(sessions, job.id), None)
    assert shown.created_at == moment and shown.created_at.utcoffset() == timedelta(0)
    assert shown.model_dump(mode="json")["created_at"] in ("2026-03-08T06:59:58.123456Z",
                                                           "2026-03-08T06:59:58.123456+00:00")


def test_concurrent_submissions_keep_one_job_per_key_and_the_queue_quota(database_url, tmp_path):
    """Six submissions at once with one Idempotency-Key make one job; six with their own keys fill the
    owner's queue (max_queued_per_user=3) and no further: the count and the insert are one step."""
    from service.limits import QuotaExceeded
    from service.plane import ControlPlane

    settings = Settings(workspace=tmp_path / "ws", database_url=database_url, capacity=0, max_queued_per_user=3,
                        mlflow_tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    plane = ControlPlane(settings)  # not started: no scheduler, jobs stay QUEUED
    overrides = ["tracking=none", "train.steps=1"]

    def submit(key: str):
        with plane.sessions() as session:
            job, created = plane.submit_job(session, owner="alice", name="race", overrides=overrides,
                                            idempotency_key=key)
            return job.id, created

    try:
        same = _at_once(6, lambda _: submit("same-key"))
        assert not [o for o in same if isinstance(o, Exception)], same
        assert len({job_id for job_id, _ in same}) == 1 and sorted(c for _, c in same) == [False] * 5 + [True]
        own = _at_once(6, lambda i: submit(f"key-{i}"))
        accepted = [o for o in own if not isinstance(o, Exception)]
        refused = [o for o in own if isinstance(o, Exception)]
        assert len(accepted) == 2 and all(created for _, created in accepted), own
        assert len(refused) == 4 and all(isinstance(e, QuotaExceeded) and "the limit is 3" in str(e) for e in refused)
        with plane.sessions() as session:
            assert session.scalar(select(func.count()).select_from(Job).where(Job.owner == "alice")) == 3
    finally:
        plane.stop()
