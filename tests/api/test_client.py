"""The client, as an SDK and as ``python -m api.client``, against the live (queue-only) server."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from api_testkit import TINY, TOKENS
from timing import scaled

from api.client import MeshflowClient, MeshflowError


def test_sdk_submit_get_list_cancel_wait(queue_server):
    with MeshflowClient(queue_server.url, token=TOKENS["alice"], timeout=scaled(30)) as client:
        job = client.submit([*TINY, "train.steps=3"], name="sdk", idempotency_key="sdk-1")
        assert client.submit([*TINY, "train.steps=3"], name="sdk", idempotency_key="sdk-1")["id"] == job["id"]
        assert client.get(job["id"])["state"] == "QUEUED"
        experiment_id = _experiment_id(queue_server, job)
        assert job["mlflow_ui_url"] == (f"http://mlflow.example:5000/#/experiments/{experiment_id}/runs/{job['mlflow_run_id']}"
                                         "?workflowType=machine_learning")
        # the job's own summary links to the same UI (the service's mlflow_ui_url, forced into the config)
        assert job["config"]["tracking"]["ui_url"] == "http://mlflow.example:5000/"
        assert job["id"] in [j["id"] for j in client.list(state="QUEUED", limit=500)["items"]]
        assert client.cancel(job["id"])["state"] == "CANCELLED"
        assert client.wait(job["id"], timeout=scaled(10))["state"] == "CANCELLED"
        assert client.logs(job["id"]) == ""
        assert list(client.follow_logs(job["id"])) == []
        assert client.plan(["+parallel=pp", "mesh=[2]"])["stage_boundaries"]
        with pytest.raises(MeshflowError) as bad:
            client.submit(["hydra.job.chdir=true"])
        assert bad.value.status == 422 and bad.value.detail[0]["path"] == "hydra.job.chdir"
        client.delete(job["id"])
        with pytest.raises(MeshflowError) as gone:
            client.get(job["id"])
        assert gone.value.status == 404


def _experiment_id(server, job) -> str:
    from mlflow.tracking import MlflowClient

    return MlflowClient(server.env["MESHFLOW_MLFLOW_TRACKING_URI"]).get_run(job["mlflow_run_id"]).info.experiment_id


def test_cli_submit_list_get_cancel_logs(queue_server):
    env = {**os.environ, "MESHFLOW_URL": queue_server.url, "MESHFLOW_TOKEN": TOKENS["bob"]}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "api.client", *args], env=env, capture_output=True, text=True,
                              timeout=scaled(60))

    submitted = cli("submit", *TINY, "train.steps=3", "--name", "from-cli")
    assert submitted.returncode == 0, submitted.stderr
    job_id, state = submitted.stdout.split()[:2]
    assert state == "QUEUED"
    assert job_id in cli("list", "--state", "QUEUED").stdout
    assert f'"id": "{job_id}"' in cli("get", job_id).stdout
    assert "CANCELLED" in cli("cancel", job_id).stdout
    assert cli("logs", job_id).returncode == 0
    refused = cli("submit", "train.checkpoint.dir=/etc")
    assert refused.returncode == 2 and "train.checkpoint.dir" in refused.stderr
    unauthorised = subprocess.run([sys.executable, "-m", "api.client", "--token", "nope", "list"], capture_output=True,
                                  text=True, env={**env, "MESHFLOW_TOKEN": ""}, timeout=scaled(60))
    assert unauthorised.returncode == 1 and "401" in unauthorised.stderr
