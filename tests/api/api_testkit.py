"""Helpers for the API tests: a ``python -m api`` subprocess on a free loopback port, tokens, polling."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from ports import free_port
from timing import Deadline, scaled

REPO = Path(__file__).resolve().parents[2]
TOKENS = {"alice": "alice-token", "bob": "bob-token", "admin": "admin-token"}
ADMIN = {"Authorization": f"Bearer {TOKENS['admin']}"}
TINY = ["train.seq_len=32", "train.global_batch_size=4", "data.max_bytes=100000", "train.log_every=1"]
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def auth(user: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[user]}"}



@dataclass
class Server:
    """One ``python -m api`` process; ``restart()`` keeps the same settings (workspace, job store)."""

    root: Path
    env: dict[str, str]
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def workspace(self) -> Path:
        return Path(self.env["MESHFLOW_WORKSPACE"])

    def start(self, timeout: float = 120.0) -> "Server":
        """Start the process and wait for /readyz to answer 200 (or the process to exit); ``timeout``
        (idle-host seconds, scaled: tests/timing.py) only stops a server that hangs."""
        log = open(self.root / f"server-{self.port}.log", "ab")
        self.process = subprocess.Popen([sys.executable, "-m", "api", "--port", str(self.port), "--log-level",
                                         "warning"],
                                        cwd=self.root, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = Deadline(timeout)
        while not deadline.expired():
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}: {self.log_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=scaled(2)).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"server not ready after {deadline.seconds_scaled:.0f} s: {self.log_text()[-3000:]}")

    def log_text(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.root.glob("server-*.log")))

    def kill(self) -> None:
        """SIGKILL: no lifespan shutdown, as a crash would do."""
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=scaled(30))

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=scaled(20))
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> "Server":
        self.kill()
        self.port = free_port()
        return self.start()

    def client(self, user: str = "admin", timeout: float = 60.0) -> httpx.Client:
        """An httpx client as ``user``; ``timeout`` (per request, scaled) only stops a request that hangs."""
        return httpx.Client(base_url=self.url, headers=auth(user), timeout=scaled(timeout))

    def kill_leftover_jobs(self) -> None:
        """Teardown: no job process may outlive the test session."""
        for pid in job_pids_in(self.workspace):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def stored_jobs(server: Server) -> dict[str, str]:
    """``{job id: state}`` read straight from the server's job store (SQLite or PostgreSQL), not over HTTP."""
    from sqlalchemy import create_engine, text

    engine = create_engine(server.env["MESHFLOW_DATABASE_URL"])
    try:
        with engine.connect() as connection:
            return dict(connection.execute(text("SELECT id, state FROM jobs")).all())
    finally:
        engine.dispose()


def job_pids_in(workspace: Path) -> list[int]:
    """Process-group leaders of jobs whose cwd is inside ``workspace`` (found through /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(workspace) in os.readlink(entry / "cwd") and int(entry.name) == os.getpgid(int(entry.name)):
                    found.append(int(entry.name))
            except (OSError, ProcessLookupError):
                continue
    return found


def _progress(client: httpx.Client, job: dict) -> tuple:
    """What changes while a job gets anywhere: its state, its log's last line, and (while it waits
    in the queue) the states of the jobs the client sees, one of which must end to make room."""
    last_line = client.get(f"/v1/jobs/{job['id']}/logs", params={"tail": 1}).text
    queue = ()
    if job["state"] == "QUEUED":
        queue = tuple((j["id"], j["state"]) for j in client.get("/v1/jobs", params={"limit": 100}).json()["items"])
    return job["state"], last_line, queue


def wait_for(client: httpx.Client, job_id: str, states: set[str], timeout: float = 180.0) -> dict:
    """Poll a job until it is in one of ``states``; its record.

    ``timeout`` bounds silence, not the whole wait: idle-host seconds (scaled by the host's
    slowness, tests/timing.py) without progress (see ``_progress``). Jobs run niced, so on a busy
    host they slow down far more than the test process that measures the slowness; a job that
    keeps stepping is waited for, up to 10 times ``timeout`` in all."""
    silence, whole = Deadline(timeout), Deadline(10 * timeout)
    job, seen = {}, None
    while not silence.expired() and not whole.expired():
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["state"] in states:
            return job
        if job["state"] in TERMINAL:
            raise AssertionError(f"job ended {job['state']} while waiting for {states}: {job.get('error')}")
        if (mark := _progress(client, job)) != seen:
            seen = mark
            silence.restart()
        time.sleep(0.2)
    raise TimeoutError(f"job {job_id} still {job.get('state')} after {silence.seconds_scaled:.0f} s without "
                       f"progress ({whole.seconds_scaled:.0f} s in all)")
