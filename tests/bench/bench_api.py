"""Control-plane latency and throughput on loopback (run by hand, not part of the default test run).

    python tests/bench/bench_api.py                  # 100 submissions per endpoint, 5 s of GET /v1/jobs
    python tests/bench/bench_api.py --requests 300 --seconds 10 --concurrency 4

Starts ``python -m api`` on a free port with capacity 0 (jobs are queued, never run) and an
SQLite job store in a temporary directory, then prints p50/p99 latency of POST /v1/plans and
POST /v1/jobs (each a full compose + validate, the model built on the meta device) and the
requests per second of GET /v1/jobs (one page of 50 jobs).
"""

from __future__ import annotations

import argparse
import os
import signal
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

TOKEN = "bench-token"
BODY = {"name": "bench", "overrides": ["+parallel=dp", "mesh=[2]", "train.steps=10", "train.seq_len=32",
                                       "train.global_batch_size=4"]}



def start_server(root: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "MESHFLOW_WORKSPACE": str(root / "workspace"), "MESHFLOW_CAPACITY": "0",
           "MESHFLOW_TOKENS": f'{{"bench": "{TOKEN}"}}', "MESHFLOW_ADMIN_USERS": '["bench"]'}
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


def time_posts(client: httpx.Client, path: str, count: int, expect: int) -> list[float]:
    latencies = []
    for _ in range(count):
        start = time.perf_counter()
        response = client.post(path, json=BODY)
        latencies.append(time.perf_counter() - start)
        assert response.status_code == expect, response.text
    return latencies


def list_rate(url: str, seconds: float, concurrency: int) -> tuple[float, list[float]]:
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def worker() -> None:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
            while time.monotonic() < stop:
                start = time.perf_counter()
                assert client.get("/v1/jobs", params={"limit": 50}).status_code == 200
                with lock:
                    latencies.append(time.perf_counter() - start)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(latencies) / (time.monotonic() - began), latencies


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100, help="submissions timed per endpoint")
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of the GET /v1/jobs run")
    parser.add_argument("--concurrency", type=int, default=2, help="client threads for GET /v1/jobs")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="meshflow-bench-") as tmp:
        process, url = start_server(Path(tmp))
        try:
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as client:
                time_posts(client, "/v1/plans", 3, 200)  # warm-up
                plans = time_posts(client, "/v1/plans", args.requests, 200)
                jobs = time_posts(client, "/v1/jobs", args.requests, 201)
            rate, gets = list_rate(url, args.seconds, args.concurrency)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)

    print(f"Meshflow control plane on loopback ({os.cpu_count()} CPUs), {args.requests} requests per endpoint")
    print(f"{'endpoint':<28} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'req/s':>8}")
    for name, values in (("POST /v1/plans", plans), ("POST /v1/jobs (queued)", jobs)):
        print(f"{name:<28} {percentile(values, 50) * 1e3:>8.1f} {percentile(values, 99) * 1e3:>8.1f} "
              f"{statistics.mean(values) * 1e3:>8.1f} {len(values) / sum(values):>8.1f}")
    print(f"{'GET /v1/jobs (50/page)':<28} {percentile(gets, 50) * 1e3:>8.1f} {percentile(gets, 99) * 1e3:>8.1f} "
          f"{statistics.mean(gets) * 1e3:>8.1f} {rate:>8.1f}")


if __name__ == "__main__":
    main()
