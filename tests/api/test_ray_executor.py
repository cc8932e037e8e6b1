"""The Ray executor against a real two-node Ray cluster started here (:mod:`ray_cluster`), under the
real control plane with ``MESHFLOW_EXECUTOR=ray``: a two-node job trains with one device's losses,
a restarted control plane re-attaches to a running Ray job, a cancel leaves no process on any
node, and a killed node fails its job with the node named.

The tests run in this order on one cluster; the last one kills the cluster's second node.
"""

from __future__ import annotations

import os
import time

import pytest
from api_testkit import TINY, wait_for
from ray_cluster import RayCluster, is_alive, job_processes
from timing import Deadline

pytest.importorskip("ray", reason="the ray extra (pip install 'meshflow[ray]') is part of the dev install")
pytestmark = pytest.mark.slow

TWO_NODES = ["+parallel=fsdp", "mesh=[4]", "launch.nnodes=2", *TINY]


@pytest.fixture(scope="module")
def cluster():
    started = RayCluster()
    try:
        yield started.start(dict(os.environ))
    finally:
        started.stop()


@pytest.fixture(scope="module")
def ray_server(start_server, cluster):
    return start_server(capacity=4, executor="ray", ray_address=cluster.address, cancel_grace_s="10")


def wait_for_log(client, job_id: str, text: str, timeout: float = 300.0) -> str:
    """Poll a job's log until it holds ``text``; ``timeout`` is idle-host seconds, scaled (tests/timing.py)."""
    deadline = Deadline(timeout)
    while not deadline.expired():
        log = client.get(f"/v1/jobs/{job_id}/logs").text
        if text in log:
            return log
        state = client.get(f"/v1/jobs/{job_id}").json()["state"]
        assert state in {"QUEUED", "STARTING", "RUNNING"}, f"job ended {state} before logging {text!r}: {log[-2000:]}"
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} has not logged {text!r} after {deadline.seconds_scaled:.0f} s")


def wait_gone(job_id: str, pids: list[int], timeout: float) -> list[int]:
    """The job's processes (those seen before, and any it has now) still alive after up to ``timeout`` s (scaled)."""
    deadline = Deadline(timeout)
    while True:
        alive = sorted({pid for pid in pids if is_alive(pid)} | set(job_processes(job_id)))
        if not alive or deadline.expired():
            return alive
        time.sleep(0.5)


def test_two_node_job_on_ray_matches_one_device(ray_server):
    from mlflow.tracking import MlflowClient

    from trainer import train
    from trainer.config.compose import compose_dict

    with ray_server.client("alice") as alice:
        job = alice.post("/v1/jobs", json={"name": "two nodes", "overrides": [*TWO_NODES, "train.steps=3"]}).json()
        assert job["world_size"] == 4, job
        # The reference meanwhile, on one device in this process, through the trainer's public entry point.
        reference = train(compose_dict([*TINY, "train.steps=3", "tracking=none", "launch.log_dir=null",
                                         "train.checkpoint.save_final=false"]))["losses"]
        done = wait_for(alice, job["id"], {"SUCCEEDED", "FAILED"}, timeout=600)
        log = alice.get(f"/v1/jobs/{job['id']}/logs").text
    assert done["state"] == "SUCCEEDED" and done["exit_code"] == 0, (done["error"], log[-3000:])
    assert done["executor"] == "ray" and done["pid"] is None
    assert "2 node(s) on Ray" in log and "[node 1] node 1 of 2: workers rank 2..3 join the rendezvous" in log
    assert log.count("done: steps 1..3") == 1  # node 0's summary, once
    assert "the plan is resolved again" not in log  # each node's launcher found the submission's plan and read it
    history = MlflowClient(ray_server.env["MESHFLOW_MLFLOW_TRACKING_URI"]).get_metric_history(done["mlflow_run_id"],
                                                                                              "loss")
    losses = [m.value for m in sorted(history, key=lambda m: m.step)]
    assert len(reference) == 3 and losses == pytest.approx(reference, rel=1e-5)


def test_restarted_control_plane_reattaches_to_a_running_ray_job(ray_server, cluster):
    from ray.job_submission import JobSubmissionClient

    with ray_server.client("alice") as alice:
        job = alice.post("/v1/jobs", json={"name": "survivor", "overrides": [*TINY, "train.steps=300"]}).json()
        wait_for_log(alice, job["id"], "step 1/300")
    ray_server.kill()
    ray_jobs = JobSubmissionClient(cluster.address)
    assert str(ray_jobs.get_job_status(f"meshflow-{job['id']}")).endswith("RUNNING"), \
        "the job must outlive the control plane"
    ray_server.restart()
    with ray_server.client("alice") as alice:
        done = wait_for(alice, job["id"], {"SUCCEEDED", "FAILED"}, timeout=600)
        log = alice.get(f"/v1/jobs/{job['id']}/logs").text
    assert done["state"] == "SUCCEEDED" and done["exit_code"] == 0, done["error"]
    assert log.count("done: steps 1..300") == 1 and log.count("step 1/300 ") == 1  # ran once, logged once
    assert done["executor"] == "ray" and ray_jobs.get_job_info(f"meshflow-{job['id']}").driver_exit_code == 0


def test_cancel_leaves_no_process_on_any_node(ray_server):
    with ray_server.client("alice") as alice:
        job = alice.post("/v1/jobs", json={"name": "long", "overrides": [*TWO_NODES, "train.steps=5000"]}).json()
        wait_for_log(alice, job["id"], "step 1/5000 |")
        processes = job_processes(job["id"])  # driver, 2 launchers, 4 workers
        assert len(processes) >= 7, processes
        assert alice.post(f"/v1/jobs/{job['id']}/cancel").json()["state"] == "CANCELLING"
        done = wait_for(alice, job["id"], {"CANCELLED"}, timeout=120)
    assert done["finished_at"] is not None
    assert wait_gone(job["id"], processes, timeout=30) == []


def test_killed_node_fails_the_job_naming_it(ray_server, cluster):
    with ray_server.client("alice") as alice:
        job = alice.post("/v1/jobs", json={"name": "doomed", "overrides": [*TWO_NODES, "train.steps=5000"]}).json()
        wait_for_log(alice, job["id"], "step 1/5000 |")
        processes = job_processes(job["id"])
        victim = cluster.node_id("node1")
        raylets = cluster.nodes[1].raylet_pids()
        assert raylets
        for pid in raylets:
            os.kill(pid, 9)
        done = wait_for(alice, job["id"], {"FAILED"}, timeout=240)
    assert f"(Ray node {victim} at " in done["error"] and " died " in done["error"], done["error"]
    assert wait_gone(job["id"], processes, timeout=60) == [], "no process of the job may outlive it, on either node"
