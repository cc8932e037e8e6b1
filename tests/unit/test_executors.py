"""Executors without a cluster: the factory and its errors, the job store's added columns, what the
Ray executor makes of a Ray job's status and log, the service's multi-node rule, train()'s errors."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from sqlalchemy import Column, MetaData, Table, create_engine, insert, inspect

from service import executors
from service.executors import ExecutorUnavailable, JobLaunch, executor_class, make_executor
from service.executors.local import LocalExecutor, make_ref, parse_ref
from service.executors.ray import RayExecutor
from service.executors.ray_driver import REASON_PREFIX, decode_config, encode_config
from service.scheduler import Scheduler
from service.settings import Settings
from service.store import Job, make_engine, make_sessionmaker, utcnow
from service.submit import confine
from timing import Deadline, scaled


def test_factory_picks_the_setting_and_explains_what_is_missing(tmp_path, monkeypatch):
    settings = Settings(workspace=tmp_path)
    assert settings.executor == "local" and isinstance(make_executor(settings), LocalExecutor)
    ray = make_executor(Settings(workspace=tmp_path, executor="ray", ray_address="http://10.1.2.3:8265",
                                 cancel_grace_s=7))
    assert isinstance(ray, RayExecutor) and (ray.address, ray.stop_grace_s) == ("http://10.1.2.3:8265", 7)
    with pytest.raises(ValueError, match="executor"):
        Settings(workspace=tmp_path, executor="slurm")
    with pytest.raises(ExecutorUnavailable, match="no such executor; use one of local, ray, kubernetes"):
        executor_class("slurm")
    monkeypatch.setitem(executors.EXECUTORS, "kubernetes", "service.executors.not_built:KubernetesExecutor")
    with pytest.raises(ExecutorUnavailable, match="no service.executors.not_built module; use MESHFLOW_EXECUTOR=local"):
        make_executor(settings, "kubernetes")
    assert parse_ref(make_ref(4242, 99)) == (4242, 99) and parse_ref(make_ref(4242, None)) == (4242, None)


def test_an_older_job_store_gets_the_new_columns_and_its_rows_stay_local(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    old = MetaData()
    # The jobs table as it was before executors: no executor / executor_ref columns.
    columns = [Column(c.name, c.type, primary_key=c.primary_key, nullable=c.nullable)
               for c in Job.__table__.columns if c.name not in ("executor", "executor_ref")]
    table = Table("jobs", old, *columns)
    engine = create_engine(url)
    old.create_all(engine)
    with engine.begin() as connection:
        connection.execute(insert(table).values(id="j1", name="n", owner="alice", state="RUNNING", priority=0,
                                                config={}, world_size=1, workdir=str(tmp_path), pid=4242,
                                                pid_start_time=99, created_at=utcnow()))
    engine.dispose()

    upgraded = make_engine(url)
    assert {"executor", "executor_ref"} <= {c["name"] for c in inspect(upgraded).get_columns("jobs")}
    with make_sessionmaker(upgraded)() as session:
        job = session.get(Job, "j1")
        assert (job.executor, job.executor_ref) == (None, None)
        scheduler = Scheduler(Settings(workspace=tmp_path), make_sessionmaker(upgraded), mlflow=None)
        assert Scheduler.ref_of(job) == "4242:99" and scheduler.executor_of(job).name == "local"
    make_engine(url).dispose()  # a second start adds nothing and fails on nothing


@dataclass
class RayJobs:
    """Stands in for Ray's JobSubmissionClient: the answers a cluster gives about one job."""

    status: str = "RUNNING"
    exit_code: int | None = None
    message: str = ""
    logs: str = ""
    stopped: list[str] = field(default_factory=list)

    def get_job_info(self, ref):
        if ref != "meshflow-j1":
            raise RuntimeError("Request failed with status code 404: Job meshflow-x does not exist.")
        return type("Info", (), {"status": self.status, "driver_exit_code": self.exit_code, "message": self.message})

    def get_job_logs(self, ref):
        return self.logs

    def stop_job(self, ref):
        self.stopped.append(ref)

    def submit_job(self, *, entrypoint, submission_id, runtime_env, metadata):
        folder = runtime_env.get("working_dir")  # read now: Ray uploads it during the call
        self.submitted = {"entrypoint": entrypoint, "env": runtime_env["env_vars"],
                          "files": {p.name: p.read_text() for p in Path(folder).iterdir()} if folder else None}


def test_ray_executor_copies_the_log_once_and_names_the_failed_node(tmp_path):
    executor = RayExecutor("http://127.0.0.1:1", log_interval_s=0.0)
    executor._client = jobs = RayJobs(logs="runtime env set up\nRunning entrypoint for job meshflow-j1: python -m x\n")
    launch = JobLaunch(job_id="j1", workdir=tmp_path, config={"launch": {"nnodes": 2}}, world_size=4)
    assert launch.nnodes == 2
    (tmp_path / "job.log").write_text("")
    assert executor.poll("meshflow-j1", launch).alive and (tmp_path / "job.log").read_text() == ""
    jobs.logs += "step 1/3 | loss 5.5 \u2192 ok\n"
    assert executor.poll("meshflow-j1", launch).alive
    jobs.logs += "[node 1] lost\n" + REASON_PREFIX + "node 1 of 2 (Ray node abc at 10.0.0.2) died (ActorDiedError: x)\n"
    jobs.status, jobs.exit_code = "FAILED", 1
    fresh = RayExecutor("http://127.0.0.1:1")  # a restarted control plane: the file is the offset
    fresh._client = jobs
    status = fresh.poll("meshflow-j1", launch)
    assert (status.alive, status.exit_code) == (False, 1)
    assert status.reason == "node 1 of 2 (Ray node abc at 10.0.0.2) died (ActorDiedError: x)"
    assert (tmp_path / "job.log").read_text() == jobs.logs.split("python -m x\n", 1)[1]  # every line once
    jobs.status, jobs.exit_code = "STOPPED", None
    assert fresh.poll("meshflow-j1", launch).exit_code == 143
    gone = fresh.poll("meshflow-zz", launch)
    assert not gone.alive and "has no job meshflow-zz" in gone.reason
    assert fresh.adopt(launch) == "meshflow-j1" and fresh.adopt(JobLaunch("zz", tmp_path, {}, 1)) is None
    fresh.stop("meshflow-j1")
    assert jobs.stopped == ["meshflow-j1"]
    config = {"launch": {"nnodes": 2}, "name": "x" * 500}
    assert decode_config(encode_config(config)) == config


def test_several_nodes_only_where_an_executor_places_them(tmp_path):
    raw = {"launch": {"nnodes": 2}}
    kwargs = {"workspace": tmp_path, "workdir": tmp_path / "jobs" / "j", "tracking_uri": "sqlite:///x.db",
              "run_id": None}
    _, issues = confine(raw, **kwargs)
    assert [(i.path, i.fix) for i in issues if i.path == "launch.nnodes"] == [
        ("launch.nnodes", "set launch.nnodes=1, or ask the operator for MESHFLOW_EXECUTOR=ray or kubernetes")]
    confined, issues = confine(raw, **kwargs, multi_node=True)
    assert not [i for i in issues if i.path.startswith("launch.")]
    assert confined["launch"]["rdzv_endpoint"] == "127.0.0.1:29400"  # a stand-in: the executor picks the real one
    _, issues = confine({"launch": {"nnodes": 2, "node_rank": 1}}, **kwargs, multi_node=True)
    assert [i.path for i in issues if i.path.startswith("launch.")] == ["launch.node_rank"]


def test_train_entry_point_refuses_what_it_cannot_run(tmp_path):
    from trainer import TrainingFailed, train
    with pytest.raises(TypeError, match="expected a RunConfig, a dict or the path"):
        train(42)
    with pytest.raises(FileNotFoundError, match="cannot read the config"):
        train(tmp_path / "missing.json")
    assert str(TrainingFailed(143)) == "training failed with exit code 143: terminated (SIGTERM)"


def test_the_supervisor_lowers_the_job_priority_and_records_its_exit_code(tmp_path):
    import os
    import subprocess
    import sys

    from service.runner import read_exit_code

    report = ("import os, pathlib, sys; group = pathlib.Path('/proc/self/autogroup'); "
              "print(os.nice(0), group.read_text().split()[-1] if group.exists() else 'none'); sys.exit(5)")
    (tmp_path / "job").mkdir()
    done = subprocess.run([sys.executable, "-m", "service.supervise", "--nice", "3",
                           str(tmp_path / "job" / "exit_code"),
                           "--", sys.executable, "-c", report], capture_output=True, text=True, start_new_session=True,
                          timeout=scaled(60))
    nice, autogroup = done.stdout.split()
    assert done.returncode == 5 and read_exit_code(tmp_path / "job") == 5
    assert int(nice) == min(19, os.nice(0) + 3)  # relative to the server's, inherited by the job's processes
    assert autogroup in ("3", "none")  # the job's session weighs 3 steps less against the server's session
    bad = subprocess.run([sys.executable, "-m", "service.supervise", "--nice", "x", "f", "--", "true"],
                         capture_output=True, text=True, timeout=scaled(60))
    assert bad.returncode == 2 and "usage: python -m service.supervise [--nice N]" in bad.stderr


def test_the_plan_resolved_at_submission_travels_to_every_ray_node(tmp_path, monkeypatch):
    """The plan goes with the Ray job as its working_dir (one file, removed here after the upload); the driver,
    started in it, hands it to each node's agent, which writes it beside that node's job.json."""
    import sys

    from service.executors import ray_driver

    plan = {"version": 1, "plan": {"mesh": {"shape": [4]}}, "fingerprint": "abc"}
    executor = RayExecutor("http://127.0.0.1:1")
    executor._client = jobs = RayJobs()
    launch = JobLaunch(job_id="j1", workdir=tmp_path / "job", config={"launch": {"nnodes": 2}}, world_size=4,
                       resolved_plan=plan)
    assert executor.start(launch) == "meshflow-j1"
    assert jobs.submitted["files"] == {"resolved_plan.json": json.dumps(plan)}
    assert json.loads((tmp_path / "job" / "resolved_plan.json").read_text()) == plan  # the record, as locally
    assert "resolved_plan" not in jobs.submitted["entrypoint"]
    executor.start(JobLaunch(job_id="j1", workdir=tmp_path / "bare", config={}, world_size=1))
    assert jobs.submitted["files"] is None  # no plan (a custom model the meta device cannot plan): no package

    package = tmp_path / "package"  # the driver's working directory on the cluster
    package.mkdir()
    (package / "resolved_plan.json").write_text(json.dumps(plan))
    monkeypatch.chdir(package)
    assert ray_driver.carried_plan() == plan
    # A node's agent: the "launcher" here prints what lies beside the config it was given.
    launcher = tmp_path / "launcher"
    launcher.write_text('#!/bin/sh\ncat "$(dirname "$3")/resolved_plan.json"\n')
    launcher.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(launcher))
    agent = ray_driver.NodeAgent(1)
    agent.start({"launch": {}}, ["--node-rank", "1"], str(tmp_path / "job"), plan)
    deadline, lines, code = Deadline(60), [], None
    while code is None and not deadline.expired():
        more, code = agent.drain()
        lines += more
        time.sleep(0.05)
    lines += agent.drain()[0]
    assert code == 0 and json.loads("".join(lines)) == plan
