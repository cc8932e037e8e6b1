"""The Slurm executor under the real control plane (``MESHFLOW_EXECUTOR=slurm``) against a real Slurm on
this host (tests/slurm_cluster.py): a 2-process job trains with one device's losses, its log streamed from
the job's output; a cancel ends the Slurm job CANCELLED and leaves none of its processes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from api_testkit import TINY, wait_for
from timing import Deadline

from tests.slurm_cluster import start_slurm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = start_slurm(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def slurm_server(start_server, slurm):
    with pytest.MonkeyPatch.context() as patch:  # the server's environment: its Slurm client finds this cluster
        patch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
        return start_server(capacity=4, executor="slurm")


def _job_processes(slurm_job: str) -> list[int]:
    """Processes (not zombies) running in that Slurm job: ``SLURM_JOB_ID=<id>`` in their environment."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z" and \
                    f"SLURM_JOB_ID={slurm_job}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def _wait_for_log(client, job_id: str, text: str, timeout: float = 300.0) -> str:
    deadline = Deadline(timeout)
    while not deadline.expired():
        log = client.get(f"/v1/jobs/{job_id}/logs").text
        if text in log:
            return log
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} has not logged {text!r}")


def test_a_two_process_job_on_slurm_trains_with_one_devices_losses(slurm_server, slurm):
    from mlflow.tracking import MlflowClient

    from trainer import train
    from trainer.config.compose import compose_dict

    with slurm_server.client("alice") as alice:
        job = alice.post("/v1/jobs", json={"name": "on slurm",
                                           "overrides": ["+parallel=fsdp", "mesh=[2]", *TINY, "train.steps=3"]}).json()
        reference = train(compose_dict([*TINY, "train.steps=3", "tracking=none", "launch.log_dir=null",
                                         "train.checkpoint.save_final=false"]))["losses"]
        done = wait_for(alice, job["id"], {"SUCCEEDED", "FAILED"}, timeout=600)
        log = alice.get(f"/v1/jobs/{job['id']}/logs").text
    assert done["state"] == "SUCCEEDED" and done["exit_code"] == 0, (done["error"], log[-3000:])
    assert done["executor"] == "slurm"
    assert "meshflow: slurm job " in log and log.count("done: steps 1..3") == 1, log[-3000:]
    slurm_job = log.split("meshflow: slurm job ", 1)[1].split()[0]
    state = slurm.run("scontrol", "show", "job", "--oneliner", slurm_job).stdout
    assert "JobState=COMPLETED" in state and f"JobName=meshflow-{job['id']}" in state, state
    history = MlflowClient(slurm_server.env["MESHFLOW_MLFLOW_TRACKING_URI"]).get_metric_history(
        done["mlflow_run_id"], "loss")
    losses = [m.value for m in sorted(history, key=lambda m: m.step)]
    assert len(reference) == 3 and losses == pytest.approx(reference, rel=1e-5)


def test_a_cancelled_job_is_cancelled_in_slurm_and_leaves_no_process(slurm_server, slurm):
    with slurm_server.client("alice") as alice:
        job = alice.post("/v1/jobs", json={"name": "long", "overrides": [*TINY, "train.steps=5000",
                                                                         "train.checkpoint.save_final=false"]}).json()
        log = _wait_for_log(alice, job["id"], "step 1/5000")
        slurm_job = log.split("meshflow: slurm job ", 1)[1].split()[0]
        assert _job_processes(slurm_job), "the job's processes run on this host"
        assert alice.post(f"/v1/jobs/{job['id']}/cancel").json()["state"] == "CANCELLING"
        done = wait_for(alice, job["id"], {"CANCELLED", "FAILED", "SUCCEEDED"}, timeout=120)
    assert done["state"] == "CANCELLED", done
    assert "JobState=CANCELLED" in slurm.run("scontrol", "show", "job", "--oneliner", slurm_job).stdout
    deadline = Deadline(60)
    while _job_processes(slurm_job) and not deadline.expired():
        time.sleep(0.5)
    assert _job_processes(slurm_job) == [] and os.environ.get("SLURM_CONF") is None
