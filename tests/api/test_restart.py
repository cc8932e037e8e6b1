"""The control plane killed (SIGKILL) mid-job and restarted: jobs keep running and are tracked again,
vanished ones become FAILED, queued ones start; every record survives and nothing runs twice.
On both job stores: SQLite and PostgreSQL."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from api_testkit import TINY, stored_jobs, wait_for
from timing import Deadline

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_server_killed_and_restarted_mid_job(store, start_server, job_store_url):
    from mlflow.tracking import MlflowClient

    server = start_server(capacity=2, **job_store_url(store))
    with server.client("alice") as alice:
        survivor = alice.post("/v1/jobs", json={"name": "survivor", "overrides": [*TINY, "train.steps=25"]}).json()
        victim = alice.post("/v1/jobs", json={"name": "victim", "overrides": [*TINY, "train.steps=5000"]}).json()
        queued = alice.post("/v1/jobs", json={"name": "queued", "overrides": [*TINY, "train.steps=3"]}).json()
        survivor_pid = wait_for(alice, survivor["id"], {"RUNNING"})["pid"]
        victim_pid = wait_for(alice, victim["id"], {"RUNNING"})["pid"]
        assert alice.get(f"/v1/jobs/{queued['id']}").json()["state"] == "QUEUED"

    server.kill()
    assert _alive(survivor_pid), "a job must outlive the control plane"
    os.killpg(victim_pid, signal.SIGKILL)  # this one dies while nobody watches, leaving no exit code
    gone = Deadline(10)
    while _alive(victim_pid) and not gone.expired():  # dead (a zombie at most) before the plane looks
        time.sleep(0.05)
    assert not _alive(victim_pid)
    server.restart()

    with server.client("alice") as alice:
        lost = alice.get(f"/v1/jobs/{victim['id']}").json()
        assert lost["state"] == "FAILED" and "vanished while the control plane was down" in lost["error"]
        assert alice.get(f"/v1/jobs/{survivor['id']}").json()["pid"] == survivor_pid  # tracked, not restarted
        done = wait_for(alice, survivor["id"], {"SUCCEEDED", "FAILED"}, timeout=180)
        assert done["state"] == "SUCCEEDED" and done["exit_code"] == 0, done["error"]
        assert "done: steps 1..25" in alice.get(f"/v1/jobs/{survivor['id']}/logs").text
        late = wait_for(alice, queued["id"], {"SUCCEEDED", "FAILED"}, timeout=180)
        assert late["state"] == "SUCCEEDED", late["error"]
        assert {j["id"] for j in alice.get("/v1/jobs").json()["items"]} >= {survivor["id"], victim["id"], queued["id"]}

    assert {j: stored_jobs(server)[j] for j in (survivor["id"], victim["id"], queued["id"])} == {
        survivor["id"]: "SUCCEEDED", victim["id"]: "FAILED", queued["id"]: "SUCCEEDED"}  # in the store asked for
    runs = MlflowClient(server.env["MESHFLOW_MLFLOW_TRACKING_URI"])
    assert runs.get_run(survivor["mlflow_run_id"]).info.status == "FINISHED"
    assert runs.get_run(victim["mlflow_run_id"]).info.status == "FAILED"
    survivor_log = (server.workspace / "jobs" / survivor["id"] / "job.log").read_text()
    assert survivor_log.count("done: steps") == 1  # ran once
