"""The calibration probe's processes end with the process that started them
(trainer/planner/calibration/processes.py): a validation worker ended by pebble (SIGTERM, as at
``plan_timeout_s``) or killed (SIGKILL) leaves no probe process, no ``meshflow-probe-*`` directory
(the next probe sweeps a killed one's) and no half-written cache behind.

    python -m pytest tests/unit/test_probe_processes.py -q
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from pebble import ProcessPool

from timing import Deadline
from trainer.planner.calibration.probe import load_or_probe
from trainer.planner.calibration.processes import PREFIX, sweep_stale_dirs


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _probe_running(pool: ProcessPool, tmp: Path, workers: int) -> tuple[int, list[int], Path]:
    """Wait until the pool's worker has started a probe: its directory and all its processes exist."""
    deadline = Deadline(300)
    while not deadline.expired():
        for pid in pool._pool_manager.worker_manager.workers:  # pebble keeps its workers by pid
            probes = [p.pid for p in psutil.Process(pid).children()]
            dirs = list(tmp.glob(PREFIX + "*"))
            if len(probes) == workers and len(dirs) == 1:
                return pid, probes, dirs[0]
        time.sleep(0.05)
    raise AssertionError("no probe started")


def _wait_until(condition, seconds: float = 60) -> bool:
    deadline = Deadline(seconds)
    while not condition() and not deadline.expired():
        time.sleep(0.1)
    return condition()


# SIGKILL: each probe process ends at the kernel's word, or, when its parent died while it was still
# starting (importing torch: seconds), as soon as it has started; slower, so in the slow pass.
@pytest.mark.parametrize("ending", [signal.SIGTERM, pytest.param(signal.SIGKILL, marks=pytest.mark.slow)],
                         ids=["sigterm", "sigkill"])
def test_a_probe_ends_with_the_pool_worker_that_started_it(tmp_path, monkeypatch, ending):
    tmp, cache = tmp_path / "tmp", tmp_path / "cache"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # where the pool's workers (spawned from now on) make the probe's directory
    pool = ProcessPool(1, context=multiprocessing.get_context("spawn"))
    try:
        future = pool.schedule(load_or_probe, (2, [2]), {"root": cache})
        worker, probes, directory = _probe_running(pool, tmp, workers=2)
        assert directory.name.startswith(f"{PREFIX}{worker}-")
        if ending == signal.SIGTERM:
            future.cancel()  # pebble ends a running task's worker as at its time limit: SIGTERM, 3 s later SIGKILL
        else:
            os.kill(worker, signal.SIGKILL)  # nothing of the worker runs: the probes end by themselves
        assert _wait_until(lambda: not any(_alive(p) for p in [*probes, worker])), (probes, worker)
        if ending == signal.SIGKILL:
            assert directory.is_dir()  # nothing could remove it; the next probe on the host does
            assert sweep_stale_dirs(tmp) == [directory]
        assert _wait_until(lambda: not directory.exists())
        assert not list(tmp.glob(PREFIX + "*"))
        assert not list(cache.glob("*.json")) and not list(cache.glob("*.tmp"))  # no calibration, none torn
    finally:
        pool.stop()
        pool.join()
