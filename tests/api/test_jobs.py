"""A job's life over REST: submit -> RUNNING -> SUCCEEDED, its MLflow run, metrics, logs; replays; plans."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from api_testkit import TINY, wait_for


def test_submit_runs_to_success_with_mlflow_run_and_metrics(server):
    from mlflow.tracking import MlflowClient

    with server.client("alice") as client:
        response = client.post("/v1/jobs", json={"name": "tiny", "overrides": [*TINY, "train.steps=6"]})
        assert response.status_code == 201, response.text
        job = response.json()
        assert job["state"] == "QUEUED" and job["owner"] == "alice" and job["world_size"] == 1
        run_id = job["mlflow_run_id"]
        assert run_id and job["config"]["tracking"]["run_id"] == run_id
        assert job["config"]["tracking"]["tracking_uri"] == server.env["MESHFLOW_MLFLOW_TRACKING_URI"]
        assert job["config"]["train"]["checkpoint"]["dir"] == str(server.workspace / "jobs" / job["id"] / "checkpoints")

        running = wait_for(client, job["id"], {"RUNNING", "SUCCEEDED"})
        assert running["state"] == "RUNNING" and running["pid"] and running["started_at"]  # a run takes seconds
        done = wait_for(client, job["id"], {"SUCCEEDED", "FAILED"})
        assert done["state"] == "SUCCEEDED", done["error"]
        assert done["exit_code"] == 0 and done["started_at"] <= done["finished_at"]

        assert MlflowClient(server.env["MESHFLOW_MLFLOW_TRACKING_URI"]).get_run(run_id).info.status == "FINISHED"
        metrics = client.get(f"/v1/jobs/{job['id']}/metrics").json()
        assert metrics["run_status"] == "FINISHED" and metrics["mlflow_run_id"] == run_id
        assert [p["step"] for p in metrics["metrics"]["loss"]] == [1, 2, 3, 4, 5, 6]
        assert all(0 < p["value"] < 10 for p in metrics["metrics"]["loss"])

        log = client.get(f"/v1/jobs/{job['id']}/logs")
        assert log.status_code == 200 and "done: steps 1..6" in log.text
        # The run's link, with no mlflow_ui_url set: where `mlflow ui` serves the jobs' store, which the
        # server says at start and the job's summary says again, and the model the final save left.
        uri = server.env["MESHFLOW_MLFLOW_TRACKING_URI"]
        mlflow = MlflowClient(uri)
        experiment_id = mlflow.get_run(run_id).info.experiment_id
        link = f"http://127.0.0.1:5000/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"
        assert done["mlflow_ui_url"] == link and job["config"]["tracking"]["ui_url"] is None
        serve = f"mlflow ui --backend-store-uri {uri} --port 5000"
        assert f"  mlflow run: {link}  (serve it: {serve})" in log.text.splitlines()
        assert f"MLflow: job run links point at http://127.0.0.1:5000; serve the jobs' store there with: {serve}" \
            in server.log_text().splitlines()
        assert [a.path for a in mlflow.list_artifacts(run_id, "model")] == ["model/hf", "model/model.safetensors"]
        assert (server.workspace / "jobs" / job["id"] / "checkpoints" / "step_00000006" / "COMPLETE").is_file()
        with client.stream("GET", f"/v1/jobs/{job['id']}/logs", params={"follow": "true"}) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            events = list(stream.iter_lines())
        assert "data: done: steps 1..6, loss" in "\n".join(events)
        assert events[-3:-1] == ["event: end", "data: SUCCEEDED"]

        # The workdir holds the exact config the trainer ran with: the one stored at submit.
        ran = json.loads((server.workspace / "jobs" / job["id"] / "job.json").read_text())
        assert ran["train"]["steps"] == 6 and ran["tracking"]["run_id"] == run_id
        assert ran == client.get(f"/v1/jobs/{job['id']}").json()["config"]

        assert client.delete(f"/v1/jobs/{job['id']}").status_code == 204
        assert client.get(f"/v1/jobs/{job['id']}").status_code == 404
        assert not (server.workspace / "jobs" / job["id"]).exists()


def test_idempotent_resubmission_returns_the_same_job(queue_server):
    server = queue_server
    body = {"name": "once", "overrides": [*TINY, "train.steps=3"]}
    with server.client("alice") as alice, server.client("bob") as bob:
        first = alice.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k-1"})
        again = alice.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k-1"})
        assert (first.status_code, again.status_code) == (201, 200)
        assert again.json()["id"] == first.json()["id"]
        changed = alice.post("/v1/jobs", json={**body, "name": "other"}, headers={"Idempotency-Key": "k-1"})
        assert changed.status_code == 409
        bobs = bob.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k-1"})  # keys are per owner
        assert bobs.status_code == 201 and bobs.json()["id"] != first.json()["id"]
        listed = alice.get("/v1/jobs", params={"limit": 500}).json()["items"]
        assert sum(j["id"] == first.json()["id"] for j in listed) == 1
        for client, job in ((alice, first.json()), (bob, bobs.json())):
            assert client.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200
            assert client.get(f"/v1/jobs/{job['id']}").json()["state"] == "CANCELLED"


def test_list_filters_and_pagination(queue_server):
    server = queue_server
    with server.client("alice") as alice:
        ids = [alice.post("/v1/jobs", json={"name": f"page-{i}", "overrides": [*TINY, "train.steps=3"], "priority": -5}
                          ).json()["id"] for i in range(3)]
        for job_id in ids:
            alice.post(f"/v1/jobs/{job_id}/cancel")
        page = alice.get("/v1/jobs", params={"limit": 2, "offset": 0}).json()
        assert page["limit"] == 2 and len(page["items"]) == 2 and page["total"] >= 3
        assert [j["id"] for j in page["items"]] == ids[::-1][:2]  # newest first
        assert "config" not in page["items"][0] and page["items"][0]["overrides"] == [*TINY, "train.steps=3"]
        following = alice.get("/v1/jobs", params={"limit": 2, "offset": 2}).json()
        assert following["items"][0]["id"] == ids[0] and following["total"] == page["total"]
        assert alice.get(f"/v1/jobs/{ids[0]}").json()["config"]["train"]["steps"] == 3  # one job: the whole config
        assert alice.get("/v1/jobs", params={"limit": 501}).status_code == 422
        cancelled = alice.get("/v1/jobs", params={"state": "CANCELLED", "limit": 500}).json()["items"]
        assert all(j["state"] == "CANCELLED" for j in cancelled)
        assert alice.get("/v1/jobs", params={"state": "NOPE"}).status_code == 422


def test_config_document_round_trips_and_plans_launch_nothing(queue_server):
    server = queue_server
    from trainer.config.compose import compose_dict

    document = compose_dict(["+parallel=3d", "mesh=[2,2,2]"])
    with server.client("bob") as bob:
        before = bob.get("/v1/jobs").json()["total"]
        plan = bob.post("/v1/plans", json={"config": document})
        assert plan.status_code == 200, plan.text
        body = plan.json()
        assert body["world_size"] == 8 and body["mesh_shape"] == [2, 2, 2] and body["dims"] == ["dp", "pp", "tp"]
        assert body["stage_boundaries"] == ["layers.2"] and len(body["per_pp_rank"]) == 2
        for rank in body["per_pp_rank"]:  # the peak by named term (docs/planning.md, Memory)
            assert rank["peak_phase"] in ("backward", "gradient reduce", "optimizer step")
            assert sum(rank["terms_bytes"].values()) == pytest.approx(rank["peak_bytes"])
            assert rank["terms_bytes"]["weights"] > 0
        assert body["config"]["parallel"]["tensor_parallel"] == {"dim": "tp", "plan": "megatron",
                                                                 "sequence_parallel": False,
                                                                  "loss_parallel": True}
        by_overrides = bob.post("/v1/plans", json={"overrides": ["+parallel=3d", "mesh=[2,2,2]"]}).json()
        assert by_overrides["per_pp_rank"] == body["per_pp_rank"]
        assert bob.get("/v1/jobs").json()["total"] == before
        # the plan drawn: placement and predicted 1F1B timeline (p=2, m=4), as a run logs them
        pictures = body["pictures"]
        for key in ("placement_png", "timeline_png"):
            assert base64.b64decode(pictures[key]).startswith(b"\x89PNG\r\n\x1a\n"), key
        assert pictures["bubble_theory"] == pytest.approx(1 / 5)
        ranks = {e["pid"] for e in pictures["timeline"]["traceEvents"] if e.get("ph") == "X"}
        assert ranks == {0, 1}  # one track per pipeline rank
        wq = pictures["placement"]["groups"]["layers.*.attn.wq.weight"]
        assert sorted(entry["stage"] for entry in wq) == [0, 1]
        none = bob.post("/v1/plans", json={"overrides": ["+parallel=3d", "mesh=[2,2,2]", "tracking.pictures=false"]})
        assert none.json()["pictures"] is None
        assert body["auto_plan"] is None  # a hand-written layout has no ranking
        auto = bob.post("/v1/plans", json={"overrides": [
            "+parallel=auto", "mesh=[2]", "tracking.pictures=false", "+parallel.auto.schedules=[1F1B]",
            "+parallel.auto.microbatches=[2]", "+parallel.auto.activation_checkpointing=[none]"]}).json()
        rows = auto["auto_plan"]
        assert rows[0]["status"] == "chosen" and rows[0]["parallel"]["dims"] == auto["dims"]
        assert {r["label"] for r in rows} >= {"tp2", "pp2(1F1B, m2)", "dp2(ddp)", "dp2(fsdp)", "dp2(zero2)"}


def test_plan_of_per_stage_layouts_gives_each_stage_its_own_numbers(queue_server):
    """pp_stages over REST: stage 0 (fsdp over 2) holds its parameters whole per tp rank, stage 1
    (Megatron tp over 2) about half of its own; a stage whose output the meta pass cannot hand on
    (Paddle's 3-D example) gets a lower bound and the reason, not a failure."""
    with queue_server.client("bob") as bob:
        body = bob.post("/v1/plans", json={"overrides": ["+parallel=pp_stages"]}).json()
        first, second = body["per_pp_rank"]
        assert body["world_size"] == 4 and body["stage_params"] == [107264, 107328]
        assert first["params"] == 107264 and first["param_bytes"] == 107264 * 4 / 2  # fsdp shards over 2
        assert 107328 / 2 < second["params"] < 107328 and second["param_bytes"] == second["params"] * 4
        assert body["memory_note"] is None and first["activation_bytes"] > 0
        assert set(body["comm_bytes_per_step"]) == {"stage 0 dp", "stage 1 tp", "pp"}
        paddle = bob.post("/v1/plans", json={"overrides": ["+examples=stages_dp_x_tp"]}).json()
        assert paddle["memory_note"].startswith("activations not predicted")
        assert [r["peak_bytes"] for r in paddle["per_pp_rank"]] == [r["param_bytes"] * 4 for r in paddle["per_pp_rank"]]


PRESETS = sorted(p.stem for p in (Path(__file__).parents[2] / "conf" / "parallel").glob("*.yaml"))


@pytest.mark.parametrize("preset", [pytest.param(p, marks=pytest.mark.slow) if p == "auto" else p for p in PRESETS])
def test_job_json_is_the_resolved_config(preset, tmp_path):
    """What the runner writes reads back (``python -m trainer.launch job.json``) into the same config."""
    from service.runner import trainer_command, write_job_config
    from service.submit import resolve_config
    from trainer.config.schema import RunConfig

    experts = ["model=gpt_moe"] if preset.endswith("ep") else []  # an ep axis needs a model with experts
    cfg, plan = resolve_config(overrides=[f"+parallel={preset}", *experts], document=None, workspace=tmp_path,
                               workdir=tmp_path / "job", tracking_uri="sqlite:///x.db", run_id=None)
    assert plan.mesh.world_size == cfg.world_size
    path = write_job_config(tmp_path, cfg.model_dump(mode="json"))
    assert RunConfig.model_validate_json(path.read_text()) == cfg
    assert trainer_command(tmp_path)[1:] == ["-m", "trainer.launch", str(path)]


def test_readiness_waits_for_the_first_validations(tmp_path):
    """A fresh server says 503 on /readyz until its warm-up validation ran (in-process: no server)."""
    from fastapi.testclient import TestClient

    from api.main import create_app
    from service.plane import ControlPlane
    from service.settings import Settings

    settings = Settings(workspace=tmp_path / "ws", auth_disabled=True, validation_workers=0, capacity=0)
    app = create_app(settings)
    plane = app.state.plane = ControlPlane(settings)  # not started: no warm-up has run
    try:
        client = TestClient(app)  # outside a `with`: no lifespan, this very plane
        cold = client.get("/readyz")
        assert cold.status_code == 503 and cold.json() == {"detail": "warming up: the first validations are running"}
        plane._warm_up()  # what start() runs in its warm-up thread
        assert client.get("/readyz").json() == {"status": "ok"}
    finally:
        plane.stop()


def test_health_readiness_and_prometheus_metrics(server):
    with server.client() as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        assert client.get("/readyz").json() == {"status": "ok"}
        text = client.get("/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line
              and not line.startswith("#")}
    assert values["meshflow_slots_capacity"] == 2
    assert values["meshflow_submissions_total"] >= 0 and 'meshflow_jobs{state="QUEUED"}' in values
    assert values["meshflow_queue_depth"] == values['meshflow_jobs{state="QUEUED"}']
    assert values["meshflow_plans_computing"] == values["meshflow_plans_waiting"] == 0  # no plan asked for
