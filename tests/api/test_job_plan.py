"""A control-plane job's plan is resolved once, at submission, and carried to its workers: the validation pool
resolves it and the job store keeps it; the executor writes it beside job.json; the job's launcher checks it
against its meta model and its workers against their own builds, and neither resolves it again.

    python -m pytest tests/api/test_job_plan.py -q -n 0     # one server and one 2-worker job, ~60 s on 2 cores
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from api_testkit import TINY, wait_for

ENV = "MESHFLOW_TEST_PLAN_COUNTS"  # tests/dist/plan_counts.py's
SITE = Path(__file__).parent / "plan_site"  # its sitecustomize counts in every process started with ENV set


def _counts(folder: Path) -> dict[int, Counter]:
    """``{pid: Counter(what)}`` of every process that counted something into ``folder``."""
    return {int(path.name): Counter(path.read_text().split("\n")[:-1]) for path in folder.iterdir()}


def test_a_job_resolves_its_plan_at_submission_and_never_in_its_launcher_or_workers(start_server, tmp_path,
                                                                                     monkeypatch):
    folder = tmp_path / "counts"
    folder.mkdir()
    monkeypatch.setenv(ENV, str(folder))  # the server and its pool count; the job gets it through job_env
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")])))
    server = start_server(capacity=2, job_env=json.dumps({ENV: str(folder)}))
    warm = _counts(folder)  # the server's and the pool's warm-up validations, before any job
    assert sum(c["resolve_plan"] for c in warm.values()) >= 1
    with server.client("alice") as client:
        response = client.post("/v1/jobs", json={"name": "planned", "overrides": [
            *TINY, "+parallel=fsdp", "mesh=[2]", "train.steps=2"]})
        assert response.status_code == 201, response.text
        job = response.json()
        done = wait_for(client, job["id"], {"SUCCEEDED", "FAILED"})
    assert done["state"] == "SUCCEEDED", done["error"]

    workdir = server.workspace / "jobs" / job["id"]
    stored = json.loads((workdir / "resolved_plan.json").read_text())
    assert stored["plan"]["mesh"]["shape"] == [2] and stored["plan"]["data_parallel"]["mode"] == "fsdp"
    counted = _counts(folder)
    validation = {pid: counted[pid] - warm[pid] for pid in warm if counted[pid] != warm[pid]}
    # One pool worker resolved it, on the meta model its warm-up built (the default model: kept, not rebuilt).
    assert list(validation.values()) == [Counter({"resolve_plan": 1})], validation
    job_processes = {pid: c for pid, c in counted.items() if pid not in warm}
    cmdlines = {pid: (Path(f"{folder}.cmdlines") / str(pid)).read_text() for pid in job_processes
                if (Path(f"{folder}.cmdlines") / str(pid)).is_file()}
    launchers = [pid for pid, command in cmdlines.items() if "-m trainer.launch" in command]
    assert len(launchers) == 1, cmdlines
    assert job_processes.pop(launchers[0]) == Counter({"meta model": 1})  # built to check the stored plan
    assert len(job_processes) == 2, job_processes  # the two workers, forked: each checks its own build
    assert all(worker == Counter({"meta model": 1}) for worker in job_processes.values()), job_processes
