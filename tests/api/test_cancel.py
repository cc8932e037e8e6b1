"""Cancelling a running multi-worker job stops its whole process group; its MLflow run ends KILLED."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from api_testkit import TINY, wait_for
from timing import Deadline, scaled

from tests.conftest import unprefixed

pytestmark = pytest.mark.slow


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def job_processes(leader: int) -> dict[int, str]:
    """pid -> start time of every live process in the leader's group or descended from it."""
    stats = {int(p.name): s for p in Path("/proc").iterdir() if p.name.isdigit() and (s := _stat(int(p.name)))}
    members = {pid for pid, s in stats.items() if int(s[2]) == leader and s[0] != "Z"}
    frontier = {leader}
    while frontier:
        children = {pid for pid, s in stats.items() if int(s[1]) in frontier and s[0] != "Z"} - members
        members |= children
        frontier = children
    return {pid: stats[pid][19] for pid in members}


def still_alive(processes: dict[int, str]) -> list[int]:
    return [pid for pid, start in processes.items() if (s := _stat(pid)) and s[19] == start and s[0] != "Z"]


def _group_gone(pgid: int, timeout: float) -> bool:
    deadline = Deadline(timeout)
    while not deadline.expired():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


@pytest.fixture(scope="module")
def server_for_3d(start_server):
    """A server with the 8 worker slots a [2,2,2] job needs."""
    return start_server(capacity=8)


def test_cancel_running_3d_job_leaves_no_process(server_for_3d):
    from mlflow.tracking import MlflowClient

    server = server_for_3d
    overrides = ["+parallel=3d", "mesh=[2,2,2]", *TINY, "train.global_batch_size=8", "train.steps=5000"]
    with server.client("alice") as alice:
        job = alice.post("/v1/jobs", json={"name": "long 3d", "overrides": overrides}).json()
        assert job["world_size"] == 8
        try:
            # Follow the log live until training has started on the workers.
            with alice.stream("GET", f"/v1/jobs/{job['id']}/logs", params={"follow": "true"},
                              timeout=scaled(240)) as stream:
                for line in stream.iter_lines():
                    if unprefixed(line.removeprefix("data: ")).startswith("step "):  # a worker's "[rank0]: step ..."
                        break
            running = alice.get(f"/v1/jobs/{job['id']}").json()
            assert running["state"] == "RUNNING" and running["pid"]
            processes = job_processes(running["pid"])
            assert len(processes) >= 10, processes  # supervisor, launcher, 8 workers (+ helpers)
            assert alice.delete(f"/v1/jobs/{job['id']}").status_code == 409

            cancelled = alice.post(f"/v1/jobs/{job['id']}/cancel")
            assert cancelled.status_code == 200 and cancelled.json()["state"] == "CANCELLING"
            done = wait_for(alice, job["id"], {"CANCELLED"}, timeout=90)
            assert done["finished_at"] is not None
            deadline = Deadline(10)
            while still_alive(processes) and not deadline.expired():
                time.sleep(0.2)
            assert still_alive(processes) == []
            assert job_processes(running["pid"]) == {}
            assert _group_gone(running["pid"], timeout=10)  # zombies included, once init has reaped them
            run = MlflowClient(server.env["MESHFLOW_MLFLOW_TRACKING_URI"]).get_run(job["mlflow_run_id"])
            assert run.info.status == "KILLED"
            assert alice.post(f"/v1/jobs/{job['id']}/cancel").status_code == 409
            assert alice.delete(f"/v1/jobs/{job['id']}").status_code == 204
        finally:
            alice.post(f"/v1/jobs/{job['id']}/cancel")


def test_cancel_queued_job_is_immediate(queue_server):
    server = queue_server  # nothing ever starts
    with server.client("bob") as bob:
        job = bob.post("/v1/jobs", json={"overrides": [*TINY, "train.steps=3"]}).json()
        time.sleep(0.5)
        assert bob.get(f"/v1/jobs/{job['id']}").json()["state"] == "QUEUED"
        cancelled = bob.post(f"/v1/jobs/{job['id']}/cancel").json()
        assert cancelled["state"] == "CANCELLED" and cancelled["started_at"] is None
        from mlflow.tracking import MlflowClient

        runs = MlflowClient(server.env["MESHFLOW_MLFLOW_TRACKING_URI"])
        assert runs.get_run(job["mlflow_run_id"]).info.status == "KILLED"
