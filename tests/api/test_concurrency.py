"""Many concurrent submissions with capacity for 2 single-worker jobs: all accepted, never more than
2 running at once (judged from the jobs' own start and finish times), all finish SUCCEEDED.

8 submissions at once, not 50: each tiny job costs ~10 s of start-up (torch, MLflow) on a 2-core
machine, so the jobs' own start-up is all more of them would add (20 took 3.5 minutes); 8 still
race each other and the scheduler, and run in 4 waves of 2. The same on a job store in PostgreSQL
with 6.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import pytest
from api_testkit import TINY, stored_jobs, wait_for

pytestmark = pytest.mark.slow

JOBS_PER_STORE = {"sqlite": 8, "postgresql": 6}


def max_overlap(intervals: list[tuple[datetime, datetime]]) -> int:
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals],
                    key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_concurrent_submissions_respect_capacity(store, request, start_server, job_store_url):
    # SQLite: the session's shared server; PostgreSQL: a server of its own on a new database.
    server = request.getfixturevalue("server") if store == "sqlite" else start_server(capacity=2,
                                                                                      **job_store_url(store))
    num_jobs = JOBS_PER_STORE[store]

    def submit(i: int):
        with server.client("alice" if i % 2 else "bob") as client:
            return client.post("/v1/jobs", json={"name": f"swarm-{i}", "overrides": [*TINY, "train.steps=3"]})

    with ThreadPoolExecutor(max_workers=num_jobs) as pool:
        responses = list(pool.map(submit, range(num_jobs)))
    assert [r.status_code for r in responses] == [201] * num_jobs, [r.text for r in responses if r.status_code != 201]
    ids = [r.json()["id"] for r in responses]
    assert len(set(ids)) == num_jobs

    with server.client("admin") as admin:
        jobs = [wait_for(admin, job_id, {"SUCCEEDED", "FAILED"}, timeout=600) for job_id in ids]
        assert [j["state"] for j in jobs] == ["SUCCEEDED"] * num_jobs, [j["error"] for j in jobs if j["error"]]
        intervals = [(datetime.fromisoformat(j["started_at"]), datetime.fromisoformat(j["finished_at"])) for j in jobs]
        assert max_overlap(intervals) == 2
        metrics = admin.get("/metrics").text
    assert {job_id: stored_jobs(server)[job_id] for job_id in ids} == dict.fromkeys(ids, "SUCCEEDED")  # in that store
    peak = next(float(line.split()[1]) for line in metrics.splitlines() if line.startswith("meshflow_max_slots_in_use"))
    assert peak <= 2
