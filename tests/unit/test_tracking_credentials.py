"""The tracking store's credentials travel apart from the config (issue 36, item 5): stored configs and
API replies name the store without them, the job gets them by name in its environment, and the trainer
uses them only for the store its config names. The job environment's allow-list is by exact names.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

from api.models import JobPublic
from service.runner import job_environment
from service.submit import confine
from trainer.tracking.credentials import connect_uri, has_credentials, strip_credentials


def test_strip_credentials_keeps_everything_but_user_and_password():
    assert strip_credentials("postgresql+psycopg://me:p@ss@db:5432/mlflow?sslmode=require") == \
        "postgresql+psycopg://db:5432/mlflow?sslmode=require"
    assert strip_credentials("https://token@mlflow.example.com/") == "https://mlflow.example.com/"
    for plain in ("sqlite:////srv/ws/mlflow.db", "http://mlflow:5000", "databricks", "a@b", "http://[bad"):
        assert strip_credentials(plain) == plain and not has_credentials(plain)
    assert has_credentials("http://u:p@h")


def test_the_trainer_takes_the_environments_uri_only_for_the_store_its_config_names():
    env = {"MLFLOW_TRACKING_URI": "http://alice:pw@mlflow:5000"}
    assert connect_uri("http://mlflow:5000", env) == "http://alice:pw@mlflow:5000"
    assert connect_uri("http://other:5000", env) == "http://other:5000"   # never moved to another store
    assert connect_uri("http://mlflow:5000", {}) == "http://mlflow:5000"


def test_a_confined_config_names_the_store_without_credentials(tmp_path: Path):
    out, issues = confine({}, workspace=tmp_path, workdir=tmp_path / "jobs" / "j", run_id=None,
                          tracking_uri="postgresql://svc:pw@db/mlflow")
    assert not issues and out["tracking"]["tracking_uri"] == "postgresql://db/mlflow"


def test_the_job_environment_is_allow_listed_by_exact_names():
    source = {"OMP_NUM_THREADS": "2", "LC_ALL": "C.UTF-8", "NCCL_DEBUG": "INFO", "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
              "PATH": "/usr/bin",
              # what a prefix used to let in
              "TORCH_EVIL": "x", "TORCHINDUCTOR_CACHE_DIR": "/shared", "LC_SECRET": "s", "CUDA_SECRET": "s",
              "NCCL_TOKEN": "t", "MESHFLOW_TOKENS": '{"a": "b"}', "AWS_SECRET_ACCESS_KEY": "k"}
    env = job_environment(source=source)
    assert env == {"OMP_NUM_THREADS": "2", "LC_ALL": "C.UTF-8", "NCCL_DEBUG": "INFO",
                   "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
                   "PATH": "/usr/bin", "PYTHONUNBUFFERED": "1"}
    # the store's credentials by name, only when its URI holds any
    assert job_environment(source={}, tracking_uri="http://u:pw@mlflow:5000")["MLFLOW_TRACKING_URI"] == \
        "http://u:pw@mlflow:5000"
    assert "MLFLOW_TRACKING_URI" not in job_environment(source={}, tracking_uri="sqlite:///x.db")


def test_a_job_read_back_never_shows_credentials_even_from_a_row_stored_with_them():
    now = datetime.now(timezone.utc)
    row = SimpleNamespace(id="j1", name="j1", owner="alice", state="QUEUED", priority=0, overrides=[], world_size=1,
                          created_at=now, started_at=None, finished_at=None, exit_code=None, error=None, executor=None,
                          pid=None, mlflow_run_id=None,
                          config={"tracking": {"tracking_uri": "postgresql://svc:pw@db/mlflow", "run_id": None}})
    shown = JobPublic.from_job(row, None).model_dump(mode="json")
    assert shown["config"]["tracking"]["tracking_uri"] == "postgresql://db/mlflow"
    assert row.config["tracking"]["tracking_uri"] == "postgresql://svc:pw@db/mlflow"   # the row itself untouched


def test_the_tracker_connects_with_the_credentials_the_job_was_given(monkeypatch):
    import mlflow.tracking

    from trainer.config.schema import TrackingConfig
    from trainer.tracking.mlflow_tracker import MLflowTracker

    seen = []

    class Refusing:  # records where it was sent, then stops the tracker (no server in a unit test)
        def __init__(self, tracking_uri):
            seen.append(tracking_uri)
            raise ConnectionError("no server here")

    monkeypatch.setattr(mlflow.tracking, "MlflowClient", Refusing)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://alice:pw@mlflow:5000")
    for uri in ("http://mlflow:5000", "http://elsewhere:5000"):
        try:
            MLflowTracker(TrackingConfig(tracking_uri=uri))
        except ConnectionError:
            pass
    assert seen == ["http://alice:pw@mlflow:5000", "http://elsewhere:5000"]


def test_the_ray_entrypoint_carries_no_credentials_and_the_runtime_env_does(tmp_path):
    from service.executors.base import JobLaunch
    from service.executors.ray import RayExecutor
    from service.executors.ray_driver import decode_config

    submitted = {}

    class Jobs:
        def submit_job(self, **kwargs):
            submitted.update(kwargs)

    executor = RayExecutor("http://127.0.0.1:1")
    executor._client = Jobs()
    env = job_environment(source={}, tracking_uri="http://alice:pw@mlflow:5000")
    legacy = {"tracking": {"tracking_uri": "http://alice:pw@mlflow:5000"}}   # a row stored with them
    executor.start(JobLaunch(job_id="j1", workdir=tmp_path / "j1", config=legacy, world_size=1, env=env))
    encoded = submitted["entrypoint"].split("--config ")[1]
    assert decode_config(encoded)["tracking"]["tracking_uri"] == "http://mlflow:5000"
    assert "pw" not in submitted["entrypoint"]
    assert submitted["runtime_env"]["env_vars"]["MLFLOW_TRACKING_URI"] == "http://alice:pw@mlflow:5000"
