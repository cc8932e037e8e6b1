"""What ``MESHFLOW_JOB_NICE`` trades: API latency against a job's speed on a busy host (run by hand, not
part of the test run; a few minutes).

    python tests/bench/bench_job_nice.py                       # nice 0 and 10, one busy loop per core
    python tests/bench/bench_job_nice.py --nice 0 10 19 --load 2 --steps 5

For each nice value: ``python -m api`` on a free port with ``MESHFLOW_JOB_NICE`` set (capacity 1, stores
in a temporary directory), ``--load`` busy loops in sessions of their own (other work on the host, at
the default priority), then one small job (the default model, ``--steps`` steps, a metric point per
step). While the job is queued, starting and running, a client times ``GET /v1/jobs/{id}`` every
0.2 s. Printed per nice value: the API's p50 / p99 / max latency over the job's life, the job's
start-up (submitted -> first step logged), its median step time (the job's own ``step_time_s``,
the first step left out) and its whole wall time (submitted -> SUCCEEDED). Measured on the 2-core
development machine shared with other engineers' test runs (load average 12-17; docs/control-plane.md):

    nice  GET n   p50 ms   p99 ms   max ms start-up s  step ms  wall s
       0    180      8.5     34.2     35.9       30.6   2264.9    43.0
      10   1941      4.6     29.9     57.7      275.2  49888.7   425.4
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_api import TOKENS, headers, percentile  # noqa: E402  (tests/bench is on sys.path now)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ports import free_port  # noqa: E402  (tests/ is on sys.path now)

BUSY = "while True: pass"


def start_server(root: Path, nice: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "MESHFLOW_WORKSPACE": str(root / "workspace"), "MESHFLOW_CAPACITY": "1",
           "MESHFLOW_JOB_NICE": str(nice),
           "MESHFLOW_TOKENS": "{" + ", ".join(f'"{u}": "{t}"' for u, t in TOKENS.items()) + "}",
           "MESHFLOW_ADMIN_USERS": '["admin"]'}
    process = subprocess.Popen([sys.executable, "-m", "api", "--port", str(port), "--log-level", "warning"],
                               env=env, cwd=root, stdout=open(root / "server.log", "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    process.kill()
    raise TimeoutError((root / "server.log").read_text()[-2000:])


def one_job(url: str, steps: int) -> dict[str, float]:
    """Submit the job, time GET /v1/jobs/{id} until it ends; its figures."""
    overrides = [f"train.steps={steps}", "train.log_every=1", "train.seq_len=64", "train.global_batch_size=8",
                 "tracking.pictures=false", "tracking.system_metrics=false", "train.checkpoint.save_final=false"]
    latencies: list[float] = []
    with httpx.Client(base_url=url, headers=headers("alice"), timeout=300) as client:
        submitted = time.monotonic()
        response = client.post("/v1/jobs", json={"name": "nice-bench", "overrides": overrides})
        assert response.status_code == 201, response.text
        job_id = response.json()["id"]
        first_step = None
        while True:
            began = time.monotonic()
            state = client.get(f"/v1/jobs/{job_id}").json()["state"]
            latencies.append(time.monotonic() - began)
            if first_step is None and state == "RUNNING":
                points = client.get(f"/v1/jobs/{job_id}/metrics").json()["metrics"].get("step_time_s", [])
                first_step = time.monotonic() if points else None
            if state in ("SUCCEEDED", "FAILED", "CANCELLED"):
                break
            time.sleep(0.2)
        wall = time.monotonic() - submitted
        assert state == "SUCCEEDED", client.get(f"/v1/jobs/{job_id}/logs").text[-2000:]
        points = client.get(f"/v1/jobs/{job_id}/metrics").json()["metrics"]["step_time_s"]
    step_times = [p["value"] for p in sorted(points, key=lambda p: p["step"])][1:]
    return {"p50": percentile(latencies, 50), "p99": percentile(latencies, 99), "max": max(latencies),
            "requests": len(latencies), "startup": (first_step or submitted + wall) - submitted,
            "step": statistics.median(step_times), "wall": wall}


def measure(nice: int, load: int, steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="meshflow-nice-bench-") as tmp:
        process, url = start_server(Path(tmp), nice)
        busy = [subprocess.Popen([sys.executable, "-c", BUSY], start_new_session=True) for _ in range(load)]
        try:
            time.sleep(1)  # the loops at full speed before the job arrives
            return one_job(url, steps)
        finally:
            for loop in busy:
                loop.kill()
                loop.wait()
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nice", type=int, nargs="+", default=[0, 10], help="MESHFLOW_JOB_NICE values to compare")
    parser.add_argument("--load", type=int, default=os.cpu_count() or 1, help="busy loops beside the job")
    parser.add_argument("--steps", type=int, default=3, help="the job's steps")
    args = parser.parse_args(argv)
    print(f"MESHFLOW_JOB_NICE on {os.cpu_count()} CPUs, {args.load} busy loops, a {args.steps}-step job")
    print(f"{'nice':>4} {'GET n':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'start-up s':>10} "
          f"{'step ms':>8} {'wall s':>7}", flush=True)
    for nice in args.nice:  # a row as soon as it is measured
        m = measure(nice, args.load, args.steps)
        print(f"{nice:>4} {m['requests']:>6} {m['p50'] * 1e3:>8.1f} {m['p99'] * 1e3:>8.1f} {m['max'] * 1e3:>8.1f} "
              f"{m['startup']:>10.1f} {m['step'] * 1e3:>8.1f} {m['wall']:>7.1f}", flush=True)

if __name__ == "__main__":
    main()
