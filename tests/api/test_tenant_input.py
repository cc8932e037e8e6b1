"""What a tenant sends cannot make the control plane answer 500 or speak for the service: NUL bytes in
paths and chat templates that do not render are 422s naming the path; the run's owner tags are the
service's; ``/metrics`` asks for the same token as every other route.

The real app in this process (FastAPI's TestClient: lifespan, middleware, real SQLite job store, the
session's MLflow store), two tenants (alice, bob) and an admin. Jobs are queued on a capacity-0 plane
and never run.

    python -m pytest tests/api/test_tenant_input.py -q
"""

from __future__ import annotations


import pytest
from api_testkit import TOKENS, auth
from fastapi.testclient import TestClient
from timing import scaled

from api.main import create_app
from service.settings import Settings

SMALL = ["train.steps=3", "train.seq_len=32", "train.global_batch_size=4"]


@pytest.fixture(scope="module")
def plane(tmp_path_factory, mlflow_uri):
    """A started capacity-0 plane, validating in the request's thread; its client carries no token."""
    root = tmp_path_factory.mktemp("tenants")
    config = Settings(workspace=root / "ws", database_url=f"sqlite:///{root / 'jobs.db'}",
                      mlflow_tracking_uri=mlflow_uri, tokens=dict(TOKENS), admin_users=["admin"],
                      validation_workers=0, poll_interval_s=0.1, capacity=0)
    with TestClient(create_app(config), raise_server_exceptions=False) as client:
        assert client.app.state.plane.warm.wait(timeout=scaled(600)), "the plane never finished warming up"
        yield client


def _problems(response) -> list[dict]:
    assert response.status_code == 422, (response.status_code, response.text[-2000:])
    problems = response.json()["detail"]
    assert all(set(p) == {"path", "reason", "fix"} and p["fix"] for p in problems), problems
    return problems


@pytest.fixture(scope="module")
def chat_files(plane):
    """A chat tokenizer under the workspace's models/ and conversations under its datasets/."""
    from tests.hf_assets import conversations, write_chat_tokenizer, write_chats

    workspace = plane.app.state.plane.settings.workspace
    write_chat_tokenizer(workspace / "models" / "chat", vocab_size=256)
    (workspace / "datasets" / "chats").mkdir(parents=True, exist_ok=True)
    write_chats(workspace / "datasets" / "chats" / "a.jsonl", conversations(8))
    return ["data=chat", "data.paths=[datasets/chats/*.jsonl]", "data.tokenizer=models/chat", "model.vocab_size=320",
            *SMALL]


NUL_PATHS = ["train.checkpoint.dir", "train.init_from", "data.root", "launch.log_dir", "data.template"]


@pytest.mark.parametrize("key", NUL_PATHS)
def test_a_nul_byte_in_a_path_is_a_422_naming_it(plane, chat_files, key):
    value = "models/a\x00b.jinja" if key == "data.template" else "a\x00b"
    base = chat_files if key == "data.template" else SMALL
    from trainer.config.compose import compose_dict

    document = compose_dict(base)
    section = document
    *parents, leaf = key.split(".")
    for part in parents:
        section = section[part]
    section[leaf] = value
    for route in ("/v1/jobs", "/v1/plans"):
        for body in ({"overrides": [*base, f"{key}='{value}'"]}, {"config": document}):
            problems = _problems(plane.post(route, json=body, headers=auth("bob")))
            assert [p["path"] for p in problems] == [key], problems
            assert "NUL byte" in problems[0]["reason"], problems


TEMPLATES = {
    "syntax": "{% for m in messages %}{{ m.content }",
    "include": "{% include 'secrets.jinja' %}",
    "sandbox": "{% for m in messages %}{{ m.content.__class__.__mro__ }}{% endfor %}",
}


@pytest.mark.parametrize("kind", TEMPLATES)
def test_a_chat_template_that_does_not_render_is_a_422(plane, chat_files, kind):
    workspace = plane.app.state.plane.settings.workspace
    (workspace / "datasets" / f"{kind}.jinja").write_text(TEMPLATES[kind])
    for route in ("/v1/jobs", "/v1/plans"):
        response = plane.post(route, json={"overrides": [*chat_files, f"data.template=datasets/{kind}.jinja"]},
                              headers=auth("alice"))
        problems = _problems(response)
        assert [p["path"] for p in problems] == ["data.template"], problems
        assert "does not render" in problems[0]["reason"] and "data.template=chatml" in problems[0]["fix"]
    good = plane.post("/v1/plans", json={"overrides": [*chat_files, "data.template=chatml"]}, headers=auth("alice"))
    assert good.status_code == 200, good.text


HOSTILE_TAGS = "+tracking.tags={meshflow.owner: bob, meshflow.job_id: not-mine, mlflow.user: bob}"


def test_a_tenant_cannot_set_the_service_s_tags(plane, mlflow_uri):
    from mlflow.tracking import MlflowClient

    from trainer.config.compose import compose_dict

    document = compose_dict(SMALL)
    document["tracking"]["tags"].update({"meshflow.owner": "bob", "MLflow.user": "bob"})
    for route in ("/v1/jobs", "/v1/plans"):
        for body in ({"overrides": [*SMALL, HOSTILE_TAGS]}, {"config": document}):
            problems = _problems(plane.post(route, json=body, headers=auth("alice")))
            paths = sorted(p["path"] for p in problems)
            assert paths == (["tracking.tags.meshflow.job_id", "tracking.tags.meshflow.owner",
                              "tracking.tags.mlflow.user"] if "overrides" in body else
                             ["tracking.tags.MLflow.user", "tracking.tags.meshflow.owner"]), problems
            assert "+tracking.tags.owner=..." in " ".join(p["fix"] for p in problems) or "config" in body
    created = plane.post("/v1/jobs", json={"overrides": [*SMALL, "+tracking.tags={team: nlp}"]}, headers=auth("alice"))
    assert created.status_code == 201, created.text
    job = created.json()
    tags = MlflowClient(tracking_uri=mlflow_uri).get_run(job["mlflow_run_id"]).data.tags
    assert (tags["meshflow.owner"], tags["mlflow.user"], tags["meshflow.job_id"]) == ("alice", "alice", job["id"])
    assert plane.post(f"/v1/jobs/{job['id']}/cancel", headers=auth("alice")).status_code == 200


def test_metrics_ask_for_a_token_unless_the_operator_opens_them(plane, tmp_path, mlflow_uri):
    assert plane.get("/metrics").status_code == 401
    assert plane.get("/metrics", headers={"Authorization": "Bearer guessed"}).status_code == 401
    text = plane.get("/metrics", headers=auth("bob")).text
    assert "meshflow_slots_capacity 0" in text.splitlines()
    config = Settings(workspace=tmp_path / "ws", database_url=f"sqlite:///{tmp_path / 'jobs.db'}",
                      mlflow_tracking_uri=mlflow_uri, tokens=dict(TOKENS), validation_workers=0, capacity=0,
                      metrics_public=True)
    with TestClient(create_app(config)) as open_plane:
        assert open_plane.get("/metrics").status_code == 200
        assert open_plane.get("/v1/jobs").status_code == 401  # the rest still asks


def test_a_pickle_as_init_from_is_refused_before_the_job(plane):
    """It used to pass validation and fail in the job's workers with a raw SafetensorError."""
    import torch

    models = plane.app.state.plane.settings.workspace / "models"
    models.mkdir(parents=True, exist_ok=True)
    torch.save({"tok_embeddings.weight": torch.zeros(2, 2)}, models / "model.safetensors")
    for route in ("/v1/jobs", "/v1/plans"):
        response = plane.post(route, json={"overrides": [*SMALL, "train.init_from=models/model.safetensors"]},
                              headers=auth("bob"))
        [problem] = _problems(response)
        assert problem["path"] == "train.init_from" and "is a pickle (torch.save)" in problem["reason"], problem
        assert "python -m trainer.export" in problem["fix"] and "train.init_from=null" in problem["fix"]
