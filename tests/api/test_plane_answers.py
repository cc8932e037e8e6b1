"""What the control plane answers where an operator probed it: a job store that is down, a config read
back and sent again, an integral priority written as a float, the memory a single-device job may
use, where MLflow keeps a job's artifacts.

The real app in this process (FastAPI's TestClient: lifespan, middleware, real SQLite job store, the
session's MLflow store), validating in the request's thread, so a test can take the store away or
give the host another size. Jobs are queued on a capacity-0 plane and never run.

    python -m pytest tests/api/test_plane_answers.py -q
"""

from __future__ import annotations

import os
import sqlite3
import uuid

import pytest
from api_testkit import TOKENS, auth
from timing import scaled
from fastapi.testclient import TestClient
from sqlalchemy import event

from api.main import create_app
from service.settings import Settings

SMALL = ["train.steps=3", "train.seq_len=32", "train.global_batch_size=4"]
# SmolLM-135M's shape on the built-in Llama: ~135M parameters, 7.6 GiB predicted peak for one worker.
SMOL_135M = ["model.dim=576", "model.n_layers=30", "model.n_heads=9", "model.n_kv_heads=3", "model.ffn_hidden_dim=1536",
             "model.vocab_size=49152", "data=synthetic", "train.seq_len=256", "train.global_batch_size=8",
             "tracking.pictures=false"]
GIB = 2**30


@pytest.fixture(scope="module")
def make_client(tmp_path_factory, mlflow_uri):
    """Factory: an admin's client of a started in-process app with these settings; stopped at the end."""
    clients: list[TestClient] = []

    def _make(**settings) -> TestClient:
        root = tmp_path_factory.mktemp("plane")
        config = Settings(workspace=root / "ws", database_url=f"sqlite:///{root / 'jobs.db'}",
                          mlflow_tracking_uri=mlflow_uri, tokens=dict(TOKENS), admin_users=["admin"],
                          validation_workers=0, poll_interval_s=0.1, **settings)
        client = TestClient(create_app(config), headers=auth("admin"))
        client.__enter__()  # runs the lifespan: the plane starts
        clients.append(client)
        return client

    yield _make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture(scope="module")
def queue(make_client) -> TestClient:
    return make_client(capacity=0)


def test_a_store_outage_answers_503_with_retry_after(queue):
    """The database refuses connections (a restart, a network cut): 503 and Retry-After on every
    route that needs it, not a 500; the same requests work again once it is back."""
    plane = queue.app.state.plane
    # /readyz answers "warming up" (Retry-After 1) until the first validations ran: wait for that first.
    assert plane.warm.wait(timeout=scaled(600)), "the plane never finished warming up"
    job = queue.post("/v1/jobs", json={"overrides": SMALL}).json()

    def refuse(*_):
        raise sqlite3.OperationalError("unable to open database file")

    event.listen(plane.engine, "do_connect", refuse)
    plane.engine.dispose()  # pooled connections gone: every request must connect
    try:
        requests = [("GET", "/v1/jobs", None), ("GET", f"/v1/jobs/{job['id']}", None),
                    ("POST", f"/v1/jobs/{job['id']}/cancel", None), ("POST", "/v1/jobs", {"overrides": SMALL}),
                    ("GET", f"/v1/jobs/{job['id']}/logs", None), ("GET", "/readyz", None)]
        for method, path, body in requests:
            response = queue.request(method, path, json=body)
            assert (response.status_code, response.headers.get("retry-after")) == (503, "5"), (path, response.text)
            assert "unable to open" not in response.text  # the driver's words stay in the server's log
    finally:
        event.remove(plane.engine, "do_connect", refuse)
        plane.engine.dispose()
    assert queue.get(f"/v1/jobs/{job['id']}").json()["state"] == "QUEUED"


def test_a_config_read_back_is_accepted_as_is(queue):
    """GET /v1/jobs/{id} returns the config with every path resolved; sent back as a document, it is
    a new job whose own paths are in its own workdir and whose inputs are the same files."""
    plane = queue.app.state.plane
    corpus = plane.settings.workspace / "datasets" / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    (corpus / "a.txt").write_text("some text to train on " * 200)
    first = queue.post("/v1/jobs", json={"overrides": [*SMALL, "data=text", "data.root=datasets/corpus",
                                                       "data.glob=*.txt"]})
    assert first.status_code == 201, first.text
    config = queue.get(f"/v1/jobs/{first.json()['id']}").json()["config"]
    assert config["train"]["checkpoint"]["dir"].startswith("/")  # what used to be refused as absolute
    again = queue.post("/v1/jobs", json={"config": config})
    assert again.status_code == 201, again.text
    second = again.json()
    workdir = plane.settings.jobs_dir / second["id"]
    assert second["config"]["train"]["checkpoint"]["dir"] == str(workdir / "checkpoints")
    assert second["config"]["launch"]["log_dir"] == str(workdir / "logs")
    assert second["config"]["data"]["root"] == config["data"]["root"] == str(corpus)
    mine = {"train": {"checkpoint": {"dir"}}, "launch": {"log_dir"}, "tracking": {"run_id"}}
    assert _without(second["config"], mine) == _without(config, mine)
    # Paths outside the workspace's areas stay refused, absolute or not.
    for path in ("/etc", f"{plane.settings.workspace}/meshflow.db", f"{plane.settings.jobs_dir}/x/../../meshflow.db"):
        refused = queue.post("/v1/jobs", json={"config": {**config, "data": {**config["data"], "root": path}}})
        assert refused.status_code == 422 and refused.json()["detail"][0]["path"] == "data.root", path


def _without(config: dict, keys: dict) -> dict:
    """``config`` less the nested ``keys`` (a dict of sections, a set of leaves)."""
    if isinstance(keys, set):
        return {k: v for k, v in config.items() if k not in keys}
    return {k: _without(v, keys[k]) if k in keys else v for k, v in config.items()}


def test_an_integral_priority_written_as_a_float_is_accepted(queue):
    # JSON Schema's integer is any number without a fraction: the schema allows 53.0, so does the server.
    created = queue.post("/v1/jobs", json={"overrides": SMALL, "priority": 53.0})
    assert (created.status_code, created.json()["priority"]) == (201, 53)
    for bad in (53.5, "53", True):
        refused = queue.post("/v1/jobs", json={"overrides": SMALL, "priority": bad})
        assert refused.status_code == 422 and refused.json()["detail"][0]["path"] == "priority", bad


@pytest.fixture
def host_of_24_gib(monkeypatch):
    real = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: 24 * GIB // real("SC_PAGE_SIZE") if name == "SC_PHYS_PAGES"
                        else real(name))


def test_a_single_device_job_may_use_the_host_not_a_capacity_share(make_client, host_of_24_gib):
    """24 GiB host, capacity 8: a single-device 135M job (7.6 GiB predicted) was refused against
    24 x 0.9 / 8 = 2.7 GiB. The budget is the host over the job's own workers."""
    plane = make_client(capacity=8)
    alone = plane.post("/v1/plans", json={"overrides": SMOL_135M})
    assert alone.status_code == 200, alone.text
    assert alone.json()["memory_budget_bytes"] == pytest.approx(0.9 * 24 * GIB, rel=1e-3)
    assert alone.json()["config"]["launch"]["memory_budget_gb"] == 21.6
    # A job's workers share the host: each of an 8-worker job's gets an eighth (as capacity 8 gave everyone).
    assert plane.app.state.plane.settings.rank_memory_limit(8)[0] == pytest.approx(0.9 * 3 * GIB)


def test_mlflow_artifacts_stay_in_the_workspace(queue, mlflow_uri):
    from mlflow.tracking import MlflowClient

    experiment = f"artifacts-{uuid.uuid4().hex[:8]}"
    created = queue.post("/v1/jobs", json={"overrides": [*SMALL, f"tracking.experiment={experiment}"]})
    assert created.status_code == 201, created.text
    client = MlflowClient(tracking_uri=mlflow_uri)
    root = (queue.app.state.plane.settings.workspace / "mlartifacts").as_uri()
    assert client.get_experiment_by_name(experiment).artifact_location == f"{root}/{experiment}"
    run = client.get_run(created.json()["mlflow_run_id"])
    assert run.info.artifact_uri.startswith(f"{root}/{experiment}/")
