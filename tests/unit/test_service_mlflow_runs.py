"""The service's MLflow side: one experiment look-up per name, and a deleted experiment still
refused with the config path that names it."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from parallel.errors import ConfigError
from service.mlflow_runs import MlflowRuns, ui_notice


def test_runs_reuse_the_experiment_looked_up_once_and_notice_its_deletion(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    runs = MlflowRuns(uri)
    lookups = []
    real = runs._client.get_experiment_by_name
    monkeypatch.setattr(runs._client, "get_experiment_by_name", lambda name: lookups.append(name) or real(name))
    first = runs.create_run("team", "job-1", {})
    second = runs.create_run("team", "job-2", {})
    assert first[0] == second[0] and first[1] != second[1]
    assert lookups == ["team"]
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(second[1]).info.experiment_id == first[0]

    client.delete_experiment(first[0])
    refusal = f"tracking.experiment: MLflow experiment 'team' \\(id {first[0]}\\) is deleted"
    with pytest.raises(ConfigError, match=refusal) as refused:
        runs.create_run("team", "job-3", {})
    # restored through the server the links point at (here where `mlflow ui` serves a local store), by its id;
    # tests/e2e/test_deploy_commands.py types it against a real server
    assert (f"`MLFLOW_TRACKING_URI=http://127.0.0.1:5000 mlflow experiments restore --experiment-id {first[0]}`"
            in str(refused.value))
    with_ui = MlflowRuns("http://user:secret@mlflow-internal:5000", "https://mlflow.example/")
    monkeypatch.setattr(with_ui, "_client", client)
    issue = with_ui._deleted("team")
    assert "MLFLOW_TRACKING_URI=https://mlflow.example mlflow" in issue.fix and "secret" not in issue.fix
    client.delete_experiment(client.create_experiment("purged"))
    monkeypatch.setattr(runs._client, "get_experiment_by_name", lambda name: None)  # removed for good meanwhile
    assert runs._deleted("purged").fix == "submit again"


def test_a_local_sqlite_store_is_switched_to_wal_and_others_are_left_alone(tmp_path):
    import sqlite3

    from service.mlflow_runs import use_wal

    def journal_mode(path) -> str:
        with sqlite3.connect(path) as connection:
            mode = connection.execute("PRAGMA journal_mode").fetchone()[0]
        connection.close()
        return mode

    MlflowRuns(f"sqlite:///{tmp_path}/plain.db").warm_up()
    assert journal_mode(tmp_path / "plain.db") == "delete"  # MLflow's own default, unless asked
    runs = MlflowRuns(f"sqlite:///{tmp_path}/wal.db", sqlite_wal=True)
    runs.warm_up()
    assert journal_mode(tmp_path / "wal.db") == "wal"  # kept in the file: every later opener gets it
    experiment_id, run_id = runs.create_run("team", "job-1", {"meshflow.job_id": "1"})
    assert MlflowClient(tracking_uri=runs.tracking_uri).get_run(run_id).info.experiment_id == experiment_id
    assert not use_wal("http://127.0.0.1:5000") and not use_wal("postgresql://u@h/db")
    assert not use_wal("sqlite:///:memory:")


def test_every_job_gets_a_run_link_built_from_the_store_the_jobs_use(tmp_path):
    """``mlflow_ui_url`` is filled whatever the settings: the service's own UI URL, else the tracking
    server, else where the command ``python -m api`` prints at start serves a database store."""
    view = "?workflowType=machine_learning"
    local = MlflowRuns(f"sqlite:///{tmp_path}/mlflow.db")
    assert local.ui_link("1", "ab") == f"http://127.0.0.1:5000/#/experiments/1/runs/ab{view}"
    assert local.ui_link("1", None) is None
    assert local.ui_command() == f"mlflow ui --backend-store-uri sqlite:///{tmp_path}/mlflow.db --port 5000"
    assert ui_notice(local.tracking_uri, None) == (
        f"MLflow: job run links point at http://127.0.0.1:5000; serve the jobs' store there with: {local.ui_command()}")
    server = MlflowRuns("http://svc:pw@mlflow:5000")  # a link never carries the service's credentials
    assert server.ui_link("1", "ab") == f"http://mlflow:5000/#/experiments/1/runs/ab{view}"
    assert server.ui_command() is None and ui_notice(server.tracking_uri, None) == "MLflow: job run links point at http://mlflow:5000"
    forwarded = MlflowRuns("http://mlflow:5000", "http://localhost:5001/")  # the UI as the users reach it
    assert forwarded.ui_link("1", "ab") == f"http://localhost:5001/#/experiments/1/runs/ab{view}"
