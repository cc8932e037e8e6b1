"""Shared fixtures: compose configs the way the CLI does, and run the trainer in-process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from timing import Deadline, scaled, slowness

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def compose():
    from trainer.config.compose import compose_dict
    from trainer.validate.checks import validate_config

    def _compose(*overrides: str):
        return validate_config(compose_dict(list(overrides)))

    return _compose


def run_cli(args: list[str], *, cwd: Path, timeout: float = 300,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m trainer <args>`` in ``cwd``, as a user would type it; ``timeout`` guards against a
    hang (idle-host seconds, scaled by the host's slowness: tests/timing.py)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "trainer", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=scaled(timeout))


def worker_pids(proc: subprocess.Popen, lines: list[str], *, until: str, timeout: float = 300) -> dict[int, int]:
    """Read a running trainer's output (into ``lines``) until a line starts with ``until``;
    return {rank: pid} from the launcher's ``workers: rank0=<pid> ...`` line. ``timeout`` (scaled)
    only stops a trainer that hangs without a word: each line read is an event, not a poll."""
    ranks: dict[int, int] = {}
    deadline = Deadline(timeout)
    while not deadline.expired():
        line = proc.stdout.readline()
        lines.append(line)
        assert line or proc.poll() is None, "".join(lines)
        line = unprefixed(line)
        if line.startswith("workers: "):
            ranks = {int(k.removeprefix("rank")): int(v) for k, v in (w.split("=") for w in line.split()[1:])}
        if line.startswith(until) and ranks:
            return ranks
    raise AssertionError(f"workers did not start within {deadline.seconds_scaled:.0f} s:\n" + "".join(lines))


TORCH_THREADS = torch.get_num_threads()  # torch's own choice, before pytest_configure sets one


@pytest.fixture
def torch_default_threads():
    """torch's own thread count for one test: what a one-device ``python -m trainer`` trains with (in its
    own process, no worker), for a test that continues such a run in this process bit for bit."""
    torch.set_num_threads(TORCH_THREADS)
    yield
    torch.set_num_threads(1)


def pytest_configure(config) -> None:
    """One torch thread in the test process, as the trainer's workers run (trainer.launch.worker): the
    references and in-process runs here are tiny, and with one thread per core their OpenMP threads
    spin against the workers and servers the tests start (the 150-step entropy run took 124
    CPU-seconds with 2 threads beside other work, 13 with one)."""
    torch.set_num_threads(1)


def pytest_report_header() -> str:
    """The deadline factor of this session, on pytest's first lines (a slow run says why it waited)."""
    return f"deadlines scaled by {slowness():.2f} (host slowness, tests/timing.py)"


WORKER_PREFIX = re.compile(r"^\[rank\d+\]: ")


def unprefixed(line: str) -> str:
    """A worker's console line without the ``[rank3]: `` the launcher puts before it."""
    return WORKER_PREFIX.sub("", line)


@pytest.fixture(autouse=True, scope="session")
def calibration_cache(tmp_path_factory):
    """The auto-planner's host calibration (trainer.calibrate) goes to a folder of this session, never
    the user's ~/.cache: probed at most once per worker count, shared by the session's tests (and the
    trainer processes they start, through the environment)."""
    path = tmp_path_factory.mktemp("meshflow-cache")
    old = os.environ.get("MESHFLOW_CACHE_DIR")
    os.environ["MESHFLOW_CACHE_DIR"] = str(path)
    if not os.environ.get("MESHFLOW_TEST_PROBE"):
        seed_recorded_calibrations()
    yield path
    if old is None:
        os.environ.pop("MESHFLOW_CACHE_DIR", None)
    else:
        os.environ["MESHFLOW_CACHE_DIR"] = old


@pytest.fixture(autouse=True, scope="session")
def meshflow_home(tmp_path_factory):
    """The trainer's default MLflow store (``$MESHFLOW_HOME/mlflow.db``, else ``~/.meshflow``) is a folder
    of this session, never the user's home: set in the environment, so every trainer process the tests
    start (and its workers) writes there. A test that reads the default store gives its run a home of
    its own (``env={"MESHFLOW_HOME": ...}``), as the session's is shared by its tests."""
    path = tmp_path_factory.mktemp("meshflow-home")
    old = os.environ.get("MESHFLOW_HOME")
    os.environ["MESHFLOW_HOME"] = str(path)
    yield path
    if old is None:
        os.environ.pop("MESHFLOW_HOME", None)
    else:
        os.environ["MESHFLOW_HOME"] = old


@pytest.fixture(scope="session")
def postgres(tmp_path_factory):
    """A real PostgreSQL server for the whole session (tests/pg.py: initdb + pg_ctl on 127.0.0.1, run as
    an unprivileged user when we are root), stopped with ``pg_ctl stop -m fast`` at the end. Skips
    without the binaries, fails under CI=true."""
    from tests.pg import require_postgres, start_postgres

    require_postgres()
    server = start_postgres(tmp_path_factory.mktemp("postgres"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def postgres_url(postgres, request) -> str:
    """A fresh database on the session's server for this test: its ``postgresql+psycopg://`` URL."""
    import uuid

    return postgres.create_database(f"t_{uuid.uuid4().hex[:12]}")


RECORDED_CALIBRATIONS = Path(__file__).parent / "data" / "calibration"


def seed_recorded_calibrations() -> None:
    """Put the calibrations recorded on a 2-core CPU host (``tests/data/calibration``, 4 and 8 workers)
    in this session's cache under this host's name: a probe of 8 workers at once takes 100-130 s on
    2 cores, and the tests that plan only need a calibration, not this host's own. The probe itself
    is tested by tests/unit/test_calibrate.py (1 and 2 workers, probed for real);
    ``MESHFLOW_TEST_PROBE=1`` probes for every test instead. Only CPU calibrations are seeded."""
    import json
    import socket
    import time

    import torch

    from trainer.planner.calibration.probe import _device_name, cache_path

    for recorded in sorted(RECORDED_CALIBRATIONS.glob("cpu-w*.json")):
        data = json.loads(recorded.read_text())
        target = cache_path(data["workers"], "cpu")
        data.update(host=socket.gethostname(), device=_device_name(torch.device("cpu")), created=time.time())
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(data, indent=1))
