"""A small client for the control plane, as a Python SDK and a command line.

    python -m api.client submit +parallel=dp mesh=[2] train.steps=20 --name demo --wait
    python -m api.client list --state RUNNING
    python -m api.client get <job-id>
    python -m api.client logs <job-id> --follow
    python -m api.client cancel <job-id>

The server and token come from ``--url`` / ``--token`` or ``MESHFLOW_URL`` / ``MESHFLOW_TOKEN``.

    from api.client import MeshflowClient
    with MeshflowClient("http://127.0.0.1:8000", token="...") as client:
        job = client.submit(["train.steps=20"], name="demo")
        job = client.wait(job["id"])
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


class MeshflowError(RuntimeError):
    """A non-2xx answer; ``status`` and ``detail`` (the server's problem list or message) are kept."""

    def __init__(self, status: int, detail: Any) -> None:
        self.status, self.detail = status, detail
        if isinstance(detail, list):
            text = "\n".join(f"  - {p.get('path')}: {p.get('reason')} ({p.get('fix')})" for p in detail)
            super().__init__(f"HTTP {status}:\n{text}")
        else:
            super().__init__(f"HTTP {status}: {detail}")


class MeshflowClient:
    """Synchronous httpx client; every method returns the decoded JSON (or text) or raises :class:`MeshflowError`."""

    def __init__(self, url: str = "http://127.0.0.1:8000", *, token: str | None = None, timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=url, headers=headers, timeout=timeout)

    def __enter__(self) -> "MeshflowClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail")
            except ValueError:
                detail = response.text
            raise MeshflowError(response.status_code, detail)
        return response

    def submit(self, overrides: list[str] | None = None, *, name: str = "job", config: dict | None = None,
               priority: int = 0, idempotency_key: str | None = None) -> dict:
        body: dict[str, Any] = {"name": name, "priority": priority}
        body.update({"config": config} if config is not None else {"overrides": list(overrides or [])})
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._call("POST", "/v1/jobs", json=body, headers=headers).json()

    def plan(self, overrides: list[str] | None = None, *, config: dict | None = None) -> dict:
        body = {"config": config} if config is not None else {"overrides": list(overrides or [])}
        return self._call("POST", "/v1/plans", json=body).json()

    def list(self, *, state: str | None = None, owner: str | None = None, limit: int = 50, offset: int = 0) -> dict:
        params = {k: v for k, v in {"state": state, "owner": owner, "limit": limit, "offset": offset}.items()
                  if v is not None}
        return self._call("GET", "/v1/jobs", params=params).json()

    def get(self, job_id: str) -> dict:
        return self._call("GET", f"/v1/jobs/{job_id}").json()

    def cancel(self, job_id: str) -> dict:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel").json()

    def delete(self, job_id: str) -> None:
        self._call("DELETE", f"/v1/jobs/{job_id}")

    def logs(self, job_id: str) -> str:
        return self._call("GET", f"/v1/jobs/{job_id}/logs").text

    def follow_logs(self, job_id: str) -> Iterator[str]:
        """Log lines as they are written, until the job ends (Server-Sent Events)."""
        with self._http.stream("GET", f"/v1/jobs/{job_id}/logs", params={"follow": "true"}, timeout=None) as response:
            if response.status_code >= 400:
                response.read()
                raise MeshflowError(response.status_code, response.text)
            event = "message"
            for line in response.iter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:") and event == "message":
                    yield line[6:] if line.startswith("data: ") else line[5:]
                elif not line:
                    event = "message"

    def metrics(self, job_id: str) -> dict:
        return self._call("GET", f"/v1/jobs/{job_id}/metrics").json()

    def wait(self, job_id: str, *, timeout: float = 600.0, poll: float = 0.5) -> dict:
        """Poll until the job ends; its final record. Raises TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.get(job_id)
            if job["state"] in TERMINAL:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['state']} after {timeout:.0f} s")
            time.sleep(poll)


def _summary(job: dict) -> str:
    return f"{job['id']}  {job['state']:<10} {job['owner']:<12} ws={job['world_size']:<3} {job['name']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m api.client", description="Meshflow control-plane client.")
    parser.add_argument("--url", default=os.environ.get("MESHFLOW_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--token", default=os.environ.get("MESHFLOW_TOKEN"))
    commands = parser.add_subparsers(dest="command", required=True)
    submit = commands.add_parser("submit", help="submit a job: overrides as for python -m trainer")
    submit.add_argument("overrides", nargs="*")
    submit.add_argument("--name", default="job")
    submit.add_argument("--priority", type=int, default=0)
    submit.add_argument("--idempotency-key")
    submit.add_argument("--wait", action="store_true", help="wait until the job ends")
    listing = commands.add_parser("list", help="list jobs")
    listing.add_argument("--state")
    listing.add_argument("--owner")
    listing.add_argument("--limit", type=int, default=50)
    for name in ("get", "cancel"):
        commands.add_parser(name, help=f"{name} a job").add_argument("job_id")
    logs = commands.add_parser("logs", help="print a job's log")
    logs.add_argument("job_id")
    logs.add_argument("--follow", action="store_true")
    args = parser.parse_args(argv)

    try:
        with MeshflowClient(args.url, token=args.token) as client:
            if args.command == "submit":
                job = client.submit(args.overrides, name=args.name, priority=args.priority,
                                    idempotency_key=args.idempotency_key)
                print(_summary(job))
                if args.wait:
                    job = client.wait(job["id"], timeout=24 * 3600)
                    print(_summary(job))
                    return 0 if job["state"] == "SUCCEEDED" else 1
            elif args.command == "list":
                for job in client.list(state=args.state, owner=args.owner, limit=args.limit)["items"]:
                    print(_summary(job))
            elif args.command == "get":
                print(json.dumps(client.get(args.job_id), indent=2))
            elif args.command == "cancel":
                print(_summary(client.cancel(args.job_id)))
            elif args.command == "logs":
                if args.follow:
                    for line in client.follow_logs(args.job_id):
                        print(line, flush=True)
                else:
                    sys.stdout.write(client.logs(args.job_id))
    except MeshflowError as err:
        print(err, file=sys.stderr)
        return 2 if err.status == 422 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
