"""Fixtures: the real control plane over HTTP (``python -m api`` on a free loopback port, SQLite in tmp).

One server per test session (capacity 2 worker slots) serves most tests; tests that kill or
reconfigure a server start their own through ``start_server``. All servers of a session share
one MLflow SQLite store: creating one costs ~20 s on a small machine. ``job_store_url`` gives a
test its job store on either database (``"sqlite"``: the server's default file; ``"postgresql"``:
a new database on the session's PostgreSQL server, see tests/pg.py).
"""

from __future__ import annotations

import os

import pytest
from api_testkit import TOKENS, Server


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture(scope="session")
def start_server(tmp_path_factory, mlflow_uri):
    """Factory: a started server with its own workspace and job store; stopped (and its jobs killed) at the end."""
    servers: list[Server] = []

    def _start(*, capacity: int = 2, **settings: str) -> Server:
        root = tmp_path_factory.mktemp("api")
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "MESHFLOW_WORKSPACE": str(root / "workspace"),
               "MESHFLOW_DATABASE_URL": f"sqlite:///{root / 'jobs.db'}",
               "MESHFLOW_MLFLOW_TRACKING_URI": mlflow_uri,
               "MESHFLOW_TOKENS": '{' + ", ".join(f'"{u}": "{t}"' for u, t in TOKENS.items()) + '}',
               "MESHFLOW_ADMIN_USERS": '["admin"]',
               "MESHFLOW_CAPACITY": str(capacity),
               "MESHFLOW_CANCEL_GRACE_S": "15",
               "MESHFLOW_POLL_INTERVAL_S": "0.1"}
        env.update({f"MESHFLOW_{k.upper()}": v for k, v in settings.items()})
        server = Server(root=root, env=env)
        servers.append(server)
        return server.start()

    yield _start
    for server in servers:
        server.stop()
        server.kill_leftover_jobs()


@pytest.fixture(scope="session")
def server(start_server) -> Server:
    """The shared server: capacity for 2 single-worker jobs."""
    return start_server(capacity=2)


@pytest.fixture(scope="session")
def job_store_url(request):
    """``job_store_url("sqlite" | "postgresql")``: settings for ``start_server`` that put its job store
    there (``{}`` for SQLite, the default; a fresh PostgreSQL database otherwise)."""
    import uuid

    def _url(kind: str) -> dict[str, str]:
        if kind == "sqlite":
            return {}
        postgres = request.getfixturevalue("postgres")
        return {"database_url": postgres.create_database(f"api_{uuid.uuid4().hex[:12]}")}

    return _url


@pytest.fixture(scope="session")
def queue_server(start_server) -> Server:
    """A server with capacity 0: jobs are validated, stored and queued, and never run."""
    return start_server(capacity=0, mlflow_ui_url="http://mlflow.example:5000/")
