"""Control-plane latency and throughput on loopback (run by hand, not part of the default test run).

    python tests/bench/bench_api.py                  # 50 concurrent submits, 20 timed one by one, 5 s of GET /v1/jobs
    python tests/bench/bench_api.py --burst 50 --requests 20 --seconds 5 --concurrency 2 --capacity 2

Starts ``python -m api`` on a free port (SQLite job store and MLflow store in a temporary
directory, ``--capacity`` worker slots: 2 by default, so jobs really start while the burst is
answered) and prints:

- ``POST /v1/jobs x50 at once``: p50 / p99 latency of ``--burst`` submissions sent at the same
  moment by two users (a team resubmitting one config: each a full compose + validate + an MLflow
  run + a row, unless the service recognises the config);
- ``POST /v1/plans`` and ``POST /v1/jobs``: one at a time, ``--requests`` each, distinct configs
  (``train.steps`` differs), so no answer can be reused;
- ``GET /v1/jobs``: requests per second of one page of 50 jobs, ``--concurrency`` client threads,
  after the burst's jobs were cancelled (training would otherwise hold both cores).

The server is used once ``/readyz`` answers, i.e. after its warm-up validations. Measured on the
2-core development machine, otherwise quiet, two runs (docs/control-plane-load.md has the why):

    endpoint                          n   p50 ms   p99 ms  mean ms    req/s
    POST /v1/jobs x50 at once        50    443.3    646.7    454.3     77.3    (before: 1654 / 1993 ms)
    POST /v1/plans (distinct)        20    401.2    878.0    427.2      2.3
    POST /v1/jobs (distinct)         20    179.9    202.7    179.8      5.6    (before: 271 / 1364 ms)
    GET /v1/jobs (50/page)         3372      2.2      9.0      3.0    674.2    (before: 450 req/s)

    POST /v1/jobs x50 at once        50    485.3    685.1    491.8     73.0
    GET /v1/jobs (50/page)         3268      2.3     10.0      3.1    653.4
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ports import free_port  # noqa: E402  (tests/ is on sys.path now)

TOKENS = {"alice": "alice-bench-token", "bob": "bob-bench-token", "admin": "admin-bench-token"}
OVERRIDES = ["+parallel=dp", "mesh=[2]", "train.steps=10", "train.seq_len=32", "train.global_batch_size=4"]
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def headers(user: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[user]}"}


def start_server(root: Path, capacity: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "MESHFLOW_WORKSPACE": str(root / "workspace"), "MESHFLOW_CAPACITY": str(capacity),
           "MESHFLOW_TOKENS": "{" + ", ".join(f'"{u}": "{t}"' for u, t in TOKENS.items()) + "}",
           "MESHFLOW_ADMIN_USERS": '["admin"]', "MESHFLOW_MAX_QUEUED_PER_USER": "1000"}
    process = subprocess.Popen([sys.executable, "-m", "api", "--port", str(port), "--log-level", "warning"],
                               env=env, cwd=root, stdout=open(root / "server.log", "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.3)
    process.kill()
    raise TimeoutError((root / "server.log").read_text()[-2000:])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def time_posts(client: httpx.Client, path: str, count: int, expect: int, first_steps: int) -> list[float]:
    """``count`` requests one after another, each a config not sent before."""
    latencies = []
    for index in range(count):
        body = {"name": "bench", "overrides": [*OVERRIDES, f"train.steps={first_steps + index}"]}
        start = time.perf_counter()
        response = client.post(path, json=body)
        latencies.append(time.perf_counter() - start)
        assert response.status_code == expect, response.text
    return latencies


def burst(url: str, count: int) -> list[float]:
    """``count`` submissions of one config released together, alternating between two users."""
    latencies: list[float] = []
    lock = threading.Lock()
    gate = threading.Barrier(count)

    def submit(index: int) -> None:
        user = ("alice", "bob")[index % 2]
        with httpx.Client(base_url=url, headers=headers(user), timeout=120) as client:
            gate.wait()
            start = time.perf_counter()
            response = client.post("/v1/jobs", json={"name": f"burst-{index}", "overrides": OVERRIDES})
            elapsed = time.perf_counter() - start
        assert response.status_code == 201, response.text
        with lock:
            latencies.append(elapsed)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(latencies) == count, f"{count - len(latencies)} submissions failed"
    return latencies


def cancel_all(client: httpx.Client) -> None:
    """Cancel every job and wait until none is active (so no training competes with the GET run)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        jobs = client.get("/v1/jobs", params={"limit": 500}).json()["items"]
        live = [job for job in jobs if job["state"] not in TERMINAL]
        if not live:
            return
        for job in live:
            if job["state"] != "CANCELLING":
                client.post(f"/v1/jobs/{job['id']}/cancel")
        time.sleep(0.5)
    raise TimeoutError("jobs still active two minutes after cancelling them")


def list_rate(url: str, seconds: float, concurrency: int) -> tuple[float, list[float]]:
    """Requests per second of ``GET /v1/jobs?limit=50`` over ``concurrency`` keep-alive connections.

    The requests are written on plain sockets: on these 2 cores a Python HTTP client (httpx) spends
    as much CPU per request as the server, and would measure itself. Each answer is still checked:
    200, and a page of 50 jobs."""
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds
    host, port = url.removeprefix("http://").rsplit(":", 1)
    request = (f"GET /v1/jobs?limit=50 HTTP/1.1\r\nHost: {host}\r\n"
               f"Authorization: {headers('admin')['Authorization']}\r\n\r\n").encode()

    def worker() -> None:
        with socket.create_connection((host, int(port))) as sock:
            while time.monotonic() < stop:
                start = time.perf_counter()
                sock.sendall(request)
                status, body = read_response(sock)
                assert status == 200 and len(json.loads(body)["items"]) == 50, body[:500]
                with lock:
                    latencies.append(time.perf_counter() - start)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(latencies) / (time.monotonic() - began), latencies


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a Content-Length body: (status, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return int(lines[0].split()[1]), body


def row(name: str, values: list[float], rate: float | None = None) -> str:
    rate = rate if rate is not None else len(values) / sum(values)
    return (f"{name:<28} {len(values):>6} {percentile(values, 50) * 1e3:>8.1f} {percentile(values, 99) * 1e3:>8.1f} "
            f"{statistics.mean(values) * 1e3:>8.1f} {rate:>8.1f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--burst", type=int, default=50, help="submissions sent at once")
    parser.add_argument("--requests", type=int, default=20, help="distinct submissions timed one by one per endpoint")
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of the GET /v1/jobs run")
    parser.add_argument("--concurrency", type=int, default=2, help="client threads for GET /v1/jobs")
    parser.add_argument("--capacity", type=int, default=2, help="the server's worker slots")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="meshflow-bench-") as tmp:
        process, url = start_server(Path(tmp), args.capacity)
        try:
            with httpx.Client(base_url=url, headers=headers("admin"), timeout=120) as client:
                time_posts(client, "/v1/plans", 2, 200, first_steps=1000)  # warm-up
                bursts = burst(url, args.burst)
                plans = time_posts(client, "/v1/plans", args.requests, 200, first_steps=2000)
                jobs = time_posts(client, "/v1/jobs", args.requests, 201, first_steps=3000)
                cancel_all(client)
            rate, gets = list_rate(url, args.seconds, args.concurrency)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)

    print(f"Meshflow control plane on loopback ({os.cpu_count()} CPUs, capacity {args.capacity})")
    print(f"{'endpoint':<28} {'n':>6} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'req/s':>8}")
    print(row(f"POST /v1/jobs x{args.burst} at once", bursts, rate=len(bursts) / max(bursts)))
    print(row("POST /v1/plans (distinct)", plans))
    print(row("POST /v1/jobs (distinct)", jobs))
    print(row("GET /v1/jobs (50/page)", gets, rate=rate))


if __name__ == "__main__":
    main()
