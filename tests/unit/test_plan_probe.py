"""``+parallel=auto`` planned by the control plane probes this host within the plan's limits
(trainer/planner/calibration/processes.py, service/validation.py): a plan cut off by ``plan_timeout_s``
leaves no probe process and no ``meshflow-probe-*`` directory behind, and a probe that completes is
cached, so the next identical plan does not probe again (issue 49: its 4 probes had run 4.5 minutes
past an 8 s limit, and every request probed anew). A real probe of 2 workers: about a minute.

    python -m pytest tests/unit/test_plan_probe.py -q -m slow
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil
import pytest

from parallel.errors import ConfigError
from service.plans import AutoPlanPage, plan_in_pool, warm_plan_worker
from service.settings import Settings
from service.validation import Validator
from timing import Deadline, scaled
from trainer.planner.calibration.processes import PREFIX

pytestmark = pytest.mark.slow

AUTO = ["+parallel=auto", "mesh=[2]", "tracking.pictures=false", "+parallel.auto.schedules=[1F1B]",
        "+parallel.auto.microbatches=[2]", "+parallel.auto.activation_checkpointing=[none]"]


class ProbeWatch:
    """What probing a thread sees while a request runs: probe directories under ``tmp`` and the
    processes the pool's workers started."""

    def __init__(self, validator: Validator, tmp: Path) -> None:
        self.validator, self.tmp = validator, tmp
        self.dirs: set[Path] = set()
        self.processes: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.dirs.update(self.tmp.glob(PREFIX + "*"))
            for worker in self.validator.worker_pids():
                try:
                    self.processes.update(p.pid for p in psutil.Process(worker).children())
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.02)

    def __enter__(self) -> "ProbeWatch":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def _running(pids: set[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_a_plans_probe_ends_at_its_limit_and_a_completed_one_is_reused(tmp_path, monkeypatch):
    tmp, cache = tmp_path / "tmp", tmp_path / "cache"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # the pool's workers are spawned after this: their temporary files
    monkeypatch.setenv("MESHFLOW_CACHE_DIR", str(cache))  # and their calibration cache
    settings = Settings(workspace=tmp_path / "ws", capacity=2, max_rank_memory_gb=4.0, plan_timeout_s=scaled(900))
    validator = Validator(settings, workers=1, warm_up=warm_plan_worker)
    validator.start()
    try:
        assert validator.wait_warm(timeout=scaled(300))
        # A limit the warm worker reaches the probe within (about 1 s), and the 2-worker probe (35 s) does not end in.
        validator.settings = settings.model_copy(update={"plan_timeout_s": scaled(8)})
        with ProbeWatch(validator, tmp) as cut_off, pytest.raises(ConfigError) as err:
            plan_in_pool(validator, owner="alice", overrides=AUTO, document=None, page=AutoPlanPage())
        assert "(plan_timeout_s)" in err.value.issues[0].reason
        assert len(cut_off.dirs) == 1 and len(cut_off.processes) >= 2, (cut_off.dirs, cut_off.processes)
        deadline = Deadline(60)
        while (_running(cut_off.processes) or list(tmp.glob(PREFIX + "*"))) and not deadline.expired():
            time.sleep(0.1)
        assert not _running(cut_off.processes) and not list(tmp.glob(PREFIX + "*"))
        assert not list(cache.rglob("*.json"))  # nothing measured, nothing cached

        validator.settings = settings
        first = plan_in_pool(validator, owner="alice", overrides=AUTO, document=None, page=AutoPlanPage())
        [cached] = cache.rglob("*.json")
        written = (cached.stat().st_mtime_ns, cached.read_text())
        with ProbeWatch(validator, tmp) as again_watch:
            again = plan_in_pool(validator, owner="bob", overrides=AUTO, document=None, page=AutoPlanPage())
        assert again_watch.dirs == set() and again_watch.processes == set()  # no probe started
        assert (cached.stat().st_mtime_ns, cached.read_text()) == written
        assert again.numbers["auto_plan"] == first.numbers["auto_plan"] and again.auto_plan_total >= 1
        assert not list(tmp.glob(PREFIX + "*"))
    finally:
        validator.stop()
