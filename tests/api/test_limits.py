"""Limits of one user, and the service under load: ceilings, quotas, nested JSON, log streams and big logs.

One server with capacity 0 (jobs are validated and queued, never run) and small limits.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from api_testkit import TINY, auth
from timing import Deadline, scaled

BIG_MODEL = ["model.dim=1024", "model.ffn_hidden_dim=4096", "model.n_layers=16"]  # ~4 GiB of weights + AdamW


@pytest.fixture(scope="module")
def limited(start_server):
    return start_server(capacity=0, max_steps="1000", max_restarts="2", max_rank_memory_gb="1", max_queued_per_user="3",
                        max_log_streams_per_user="16", max_json_depth="32", max_plans_per_user="1",
                        max_plan_reply_bytes="200000")


def problem(response: httpx.Response, status: int = 422) -> dict:
    assert response.status_code == status, response.text
    [found] = response.json()["detail"]
    assert set(found) == {"path", "reason", "fix"} and found["fix"]
    return found


def test_ceilings_and_priority_are_refused_with_the_limit(limited):
    with limited.client("alice") as alice, limited.client("admin") as admin:
        steps = problem(alice.post("/v1/jobs", json={"overrides": ["train.steps=1000000"]}))
        assert steps["path"] == "train.steps" and "1000 (max_steps)" in steps["reason"]
        restarts = problem(alice.post("/v1/jobs", json={"overrides": ["launch.max_restarts=50"]}))
        assert restarts["path"] == "launch.max_restarts" and "2 (max_restarts)" in restarts["reason"]
        budget = problem(alice.post("/v1/jobs", json={"overrides": ["launch.memory_budget_gb=1000"]}))
        assert budget["path"] == "launch.memory_budget_gb" and "1.00 GiB (max_rank_memory_gb)" in budget["reason"]
        big = problem(alice.post("/v1/jobs", json={"overrides": BIG_MODEL}))
        assert big["path"] == "launch.memory_budget_gb" and "budget of 1.00 GiB" in big["reason"]
        assert "exceeds" in problem(alice.post("/v1/plans", json={"overrides": BIG_MODEL}))["reason"]
        priority = problem(alice.post("/v1/jobs", json={"overrides": TINY, "priority": 100}))
        assert priority["path"] == "priority" and "only admins" in priority["reason"]
        created = admin.post("/v1/jobs", json={"overrides": TINY, "priority": 100})
        assert created.status_code == 201 and created.json()["priority"] == 100
        assert created.json()["config"]["launch"]["memory_budget_gb"] == 1.0  # the service's limit, applied
        assert admin.post(f"/v1/jobs/{created.json()['id']}/cancel").status_code == 200


def test_queued_jobs_per_user_are_capped(limited):
    with limited.client("bob") as bob, limited.client("alice") as alice:
        ids = [bob.post("/v1/jobs", json={"overrides": TINY}).json()["id"] for _ in range(3)]
        full = problem(bob.post("/v1/jobs", json={"overrides": TINY}), status=429)
        assert full["path"] == "<queue>" and "3 (max_queued_per_user)" in full["reason"]
        assert bob.post("/v1/jobs/" + ids[0] + "/cancel").status_code == 200
        again = bob.post("/v1/jobs", json={"overrides": TINY})
        assert again.status_code == 201
        for job_id in [*ids[1:], again.json()["id"]]:
            assert bob.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
        assert alice.post("/v1/jobs", json={"overrides": TINY}).status_code == 201  # another user's quota


def test_deeply_nested_json_is_a_422_not_a_500(limited):
    with limited.client("alice") as alice:
        for depth in (40, 900, 5000):
            nested = "[" * depth + "]" * depth
            body = '{"name": "deep", "config": {"train": {"steps": 1, "x": ' + nested + "}}}"
            response = alice.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
            found = problem(response)
            assert found["path"] == "<body>" and "32 (max_json_depth)" in found["reason"]
        flat = alice.post("/v1/plans", json={"overrides": TINY, "name": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["})
        assert flat.status_code != 500  # brackets inside strings do not count
    assert "RecursionError" not in limited.log_text()


@pytest.mark.parametrize("content_type", ["application/JSON", "Application/Json; charset=utf-8", "text/plain", None])
def test_the_depth_limit_holds_whatever_the_content_type_says(limited, content_type):
    # FastAPI parses application/JSON (media types are case-insensitive) and a body without the
    # header as JSON: nesting 500-900 deep then reached its parser and answered 500.
    nested = "[" * 700 + "]" * 700
    body = '{"name": "deep", "config": {"train": {"steps": 1, "x": ' + nested + "}}}"
    headers = {"content-type": content_type} if content_type else {}
    with limited.client("alice") as alice:
        for route in ("/v1/jobs", "/v1/plans"):
            request = alice.build_request("POST", route, content=body, headers=headers)
            if content_type is None:
                request.headers.pop("content-type", None)
            found = problem(alice.send(request))
            assert found["path"] == "<body>" and "32 (max_json_depth)" in found["reason"]
    assert "RecursionError" not in limited.log_text()


def test_405_lists_the_allowed_methods(limited):
    with limited.client("alice") as alice:
        response = alice.put("/v1/jobs")
        assert response.status_code == 405 and response.headers["allow"] == "GET, POST"
        assert alice.delete("/healthz").headers["allow"] == "GET"


def test_workspace_and_store_are_private(limited):
    workspace = limited.workspace
    assert workspace.stat().st_mode & 0o777 == 0o700
    assert (workspace / "jobs").stat().st_mode & 0o777 == 0o700
    store = Path(limited.env["MESHFLOW_DATABASE_URL"].removeprefix("sqlite:///"))
    for path in (store, store.with_name(store.name + "-wal")):
        if path.exists():
            assert path.stat().st_mode & 0o077 == 0, path


def test_a_huge_log_is_served_in_constant_memory(limited):
    """300 MB of log (sparse: written in a blink) whole, as a tail and as a Range: RSS grows < 50 MB."""
    with limited.client("alice") as alice:
        job = alice.post("/v1/jobs", json={"overrides": TINY}).json()
        workdir = limited.workspace / "jobs" / job["id"]
        workdir.mkdir()
        size = 300 << 20
        with open(workdir / "job.log", "wb") as f:
            f.truncate(size)
            f.seek(size)
            f.write(b"".join(b"line %d\n" % i for i in range(100)))
        server = psutil.Process(limited.process.pid)
        before, peak, done = server.memory_info().rss, [0], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], server.memory_info().rss)
                time.sleep(0.02)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            received = 0
            with alice.stream("GET", f"/v1/jobs/{job['id']}/logs", timeout=scaled(300)) as response:
                assert response.status_code == 200
                for chunk in response.iter_bytes():
                    received += len(chunk)
            tail = alice.get(f"/v1/jobs/{job['id']}/logs", params={"tail": 3})
            ranged = alice.get(f"/v1/jobs/{job['id']}/logs", headers={"Range": f"bytes={size}-{size + 6}"})
        finally:
            done.set()
            sampler.join()
        assert received == size + len(b"".join(b"line %d\n" % i for i in range(100)))
        assert tail.text == "line 97\nline 98\nline 99\n"
        assert ranged.status_code == 206 and ranged.text == "line 0\n"
        assert peak[0] - before < 50 << 20, f"server RSS grew {(peak[0] - before) >> 20} MB"
        assert alice.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200


def test_many_follow_streams_leave_the_service_answering(limited):
    """16 live streams of alice's (her limit): a 17th gets 429, bob's requests answer quickly (within
    5 s on an idle host: scaled by the host's slowness, tests/timing.py), no 5xx."""
    with limited.client("alice") as alice:
        job_id = alice.post("/v1/jobs", json={"overrides": TINY}).json()["id"]
    stop, opened, statuses = threading.Event(), threading.Semaphore(0), []

    def follow() -> None:
        with httpx.Client(base_url=limited.url, headers=auth("alice"), timeout=scaled(60)) as client:
            with client.stream("GET", f"/v1/jobs/{job_id}/logs", params={"follow": "true"}) as response:
                statuses.append(response.status_code)
                opened.release()
                stop.wait(scaled(120))

    threads = [threading.Thread(target=follow) for _ in range(16)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert opened.acquire(timeout=scaled(60))
    try:
        assert statuses == [200] * 16
        with limited.client("alice") as alice:
            extra = problem(alice.get(f"/v1/jobs/{job_id}/logs", params={"follow": "true"}), status=429)
            assert extra["path"] == "follow" and "16 (max_log_streams_per_user)" in extra["reason"]

        def bob_reads(_: int) -> tuple[int, float]:
            with limited.client("bob") as bob:
                started = time.monotonic()
                status = bob.get("/v1/jobs").status_code
                return status, time.monotonic() - started

        with ThreadPoolExecutor(max_workers=4) as pool:
            answers = list(pool.map(bob_reads, range(20)))
        assert all(status == 200 for status, _ in answers), answers
        assert max(seconds for _, seconds in answers) < scaled(5.0), answers
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=scaled(30))
    with limited.client("alice") as alice:  # the closed streams gave their slots back
        deadline, status = Deadline(30), 429
        while status == 429 and not deadline.expired():
            with alice.stream("GET", f"/v1/jobs/{job_id}/logs", params={"follow": "true"}) as response:
                status = response.status_code
            time.sleep(0.5)
        assert status == 200
        assert alice.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
    assert "Traceback" not in limited.log_text()


def test_an_oversized_plan_is_refused_before_any_planning(limited):
    """A million ranks took the server from 0.57 to 6.2 GB and the kernel killed it: now the ceilings
    refuse it from the composed config, and neither the server nor a validation worker grows."""
    oversized = {"overrides": ["+parallel=dp", "mesh=[1000000]", "train.global_batch_size=1000000"]}
    server = psutil.Process(limited.process.pid)
    workers = {child.pid: child for child in server.children()}
    before = server.memory_info().rss + sum(w.memory_info().rss for w in workers.values())
    with limited.client("alice") as alice:
        for route in ("/v1/plans", "/v1/jobs"):
            response = alice.post(route, json=oversized)
            assert response.status_code == 422, response.text
            mesh, batch = response.json()["detail"]
            assert mesh == {"path": "mesh", "reason": "needs 1000000 worker slots; this service's limit is 4096 "
                            "(max_world_size)", "fix": "use a mesh of at most 4096 devices, e.g. mesh=[4096]"}
            assert batch["path"] == "train.global_batch_size" and "65536 (max_global_batch_size)" in batch["reason"]
    assert {child.pid for child in server.children()} == set(workers)  # no worker died or was replaced
    after = server.memory_info().rss + sum(w.memory_info().rss for w in workers.values())
    assert after - before < 50 << 20, f"grew {(after - before) >> 20} MB"


FSDP_256 = ["+parallel=fsdp", "mesh=[256]", "train.global_batch_size=256"]


def test_a_plan_reply_is_bounded(limited):
    with limited.client("alice") as alice:
        # 256 ranks: the placement picture's slice table alone passes the 200 kB this server allows.
        big = alice.post("/v1/plans", json={"overrides": FSDP_256})
        assert big.status_code == 200, big.text
        assert len(big.content) <= 200_000 and big.json()["world_size"] == 256 and big.json()["pictures"] is None
        assert "above this service's limit of 200000 (max_plan_reply_bytes)" in big.json()["pictures_note"]
        small = alice.post("/v1/plans", json={"overrides": TINY}).json()
        assert small["pictures"]["placement_png"] and small["pictures_note"] is None


def test_the_auto_planners_candidates_come_in_pages(limited):
    with limited.client("alice") as alice:
        auto = ["+parallel=auto", "mesh=[2]", "tracking.pictures=false", "+parallel.auto.schedules=[1F1B]",
                "+parallel.auto.microbatches=[2]", "+parallel.auto.activation_checkpointing=[none]"]
        whole = alice.post("/v1/plans", json={"overrides": auto}).json()
        total = whole["auto_plan_total"]
        assert total == len(whole["auto_plan"]) >= 5 and whole["auto_plan"][0]["status"] == "chosen"
        page = alice.post("/v1/plans", params={"auto_plan_offset": 2, "auto_plan_limit": 2}, json={"overrides": auto})
        assert page.json()["auto_plan_total"] == total and page.json()["auto_plan"] == whole["auto_plan"][2:4]
        assert alice.post("/v1/plans", params={"auto_plan_limit": 0}, json={"overrides": auto}).status_code == 422


def test_plans_of_one_user_at_once_are_limited(limited):
    """max_plans_per_user=1: of two plans sent together, one is computed and the other gets 429 with
    Retry-After (each holds its slot for the seconds a 256-rank plan takes); then alice plans again."""
    start = threading.Barrier(2)

    def plan(_: int) -> httpx.Response:
        with limited.client("alice") as alice:
            start.wait()
            return alice.post("/v1/plans", json={"overrides": FSDP_256})

    with ThreadPoolExecutor(max_workers=2) as pool:
        responses = list(pool.map(plan, range(2)))
    assert sorted(r.status_code for r in responses) == [200, 429], [r.text for r in responses]
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.headers["retry-after"] == "2"
    found = problem(refused, status=429)
    assert found["path"] == "<plans>" and "1 (max_plans_per_user)" in found["reason"]
    with limited.client("alice") as alice:
        assert alice.post("/v1/plans", json={"overrides": TINY}).status_code == 200

