"""The service's MLflow side: one experiment look-up per name, and a deleted experiment still
refused with the config path that names it."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from parallel.errors import ConfigError
from service.mlflow_runs import MlflowRuns


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
    with pytest.raises(ConfigError, match="tracking.experiment: MLflow experiment 'team' is deleted"):
        runs.create_run("team", "job-3", {})
