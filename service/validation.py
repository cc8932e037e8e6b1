"""The submit path's validation, concurrent: a process pool, identical requests coalesced, results cached.

    validator = Validator(settings)          # settings.validation_workers processes (0: in the caller)
    validator.start()                        # spawns and warms the pool in the background
    cfg = validator.resolve_job(overrides=["+parallel=dp", "mesh=[2]"], document=None, workdir=jobs / job_id)
    validator.stop()

Why this shape (measured on the 2-core development machine, see README's control-plane section):

- A submission costs ~0.2 s of CPU: Hydra's composition (~0.1 s) and the model checks (the model
  built on the meta device, the plan resolved, memory predicted, ~0.1 s); pydantic is ~1 ms.
- Threads do not help. The work holds the GIL, and Hydra's compose API is not thread-safe: it
  keeps a process-wide ``GlobalHydra`` singleton, and two threads composing at once fail with
  "GlobalHydra is already initialized" (7 of 8 unlocked concurrent compositions did), so
  :mod:`service.submit` composes under one lock. 4 threads: 320 ms per submit, worse than serial.
- A pool of worker *processes* (spawned: the server has threads, so no fork) runs compositions in
  parallel, each with its own Hydra: 2 workers on 2 cores gave ~100 ms per distinct submit (2.4x).
- Identical submissions (a team resubmitting a config, a client retrying) are answered once:
  concurrent ones wait for the first (single flight), later ones hit an LRU cache. The result is
  computed for the first job's workdir and re-targeted to each job's own workdir. Only results
  whose checks read no file are cached (built-in models, generated data, no init_from): for
  those the answer depends on the request and the (fresh, empty) workdir alone. Anything that
  reads ``datasets/``, ``models/`` or a registered builder is validated afresh every time.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import wait as futures_wait
from concurrent.futures.process import BrokenProcessPool
from functools import partial
from pathlib import Path
from typing import Any

from parallel.errors import ConfigError, ConfigIssue
from parallel.plan.spec import ParallelPlan
from service.leftovers import record_worker
from service.limits import cap_memory_budget
from service.settings import Settings
from service.submit import resolve_config
from trainer.config.compose import CONF_DIR
from trainer.config.schema import RunConfig
from trainer.data.text import STDLIB

WORKDIR_MARK = "\x00workdir\x00"  # stands for the job's workdir in cached results; no path contains NUL
CACHEABLE_MODELS = ("llama", "mlp")          # built in: the checks read no file
CACHEABLE_DATA = ("synthetic", "regression")  # generated; and text from `stdlib`: nothing under datasets/ is listed


def resolve_as_service(settings: Settings, *, overrides: list[str] | None, document: dict[str, Any] | None,
                       workdir: Path) -> tuple[RunConfig, ParallelPlan]:
    """:func:`resolve_config` with this service's workspace, tracking store, memory limit and
    executor (a cluster executor takes several nodes): what a job and a plan request both get."""
    return resolve_config(overrides=overrides, document=document, workspace=settings.workspace, workdir=workdir,
                          tracking_uri=settings.mlflow_tracking_uri, run_id=None,
                          limit_raw=partial(cap_memory_budget, settings=settings),
                          multi_node=settings.executor != "local")


def _resolve(overrides: list[str] | None, document: dict[str, Any] | None, *, workdir: Path,
             settings: Settings) -> tuple[str, Any]:
    """One submission's validation, in a pool worker or in the caller: ``("ok", config as JSON)`` or
    ``("invalid", [(path, reason, fix), ...])``. Plain values, so a worker's answer pickles."""
    try:
        cfg, _ = resolve_as_service(settings, overrides=overrides, document=document, workdir=workdir)
    except ConfigError as err:
        return "invalid", [(i.path, i.reason, i.fix) for i in err.issues]
    return "ok", cfg.model_dump(mode="json")


def _follow_parent(parent: int, workspace: Path | None = None) -> None:
    """A pool worker's initializer: leave when the server that spawned it is gone. A server killed
    with SIGKILL cannot stop its pool, and its workers (hundreds of MB each, torch imported) would
    otherwise live on, reparented, for as long as the machine runs. The worker also records itself
    under ``workspace``, so a restarted server ends it should it still run (:mod:`service.leftovers`)."""
    if workspace is not None:
        record_worker(workspace)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="follow-parent", daemon=True).start()


def _warm_worker(settings: Settings) -> int:
    """Validate the default config once in a fresh worker, as a submission would be validated.

    Composing alone is not enough: the first model check imports torch.distributed's checkpoint
    and tensor packages and builds a first model (~1.3 s of CPU here, ten times a later
    validation), and that would otherwise be the first submission's wait (and that of every
    identical submission coalesced behind it)."""
    _resolve([], None, workdir=settings.jobs_dir / "plan", settings=settings)
    return os.getpid()


def _retarget(value: Any, old: str, new: str) -> Any:
    """``value`` with ``old`` replaced by ``new`` in every string (keys too)."""
    if isinstance(value, str):
        return value.replace(old, new)
    if isinstance(value, dict):
        return {_retarget(k, old, new): _retarget(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_retarget(v, old, new) for v in value]
    return value


def cacheable(config: dict[str, Any]) -> bool:
    """Whether validating ``config`` read no file, so its answer holds for any fresh workdir."""
    model, data, train = config.get("model", {}), config.get("data", {}), config.get("train", {})
    builtin_data = data.get("kind") in CACHEABLE_DATA or (data.get("kind") == "text" and data.get("root") == STDLIB)
    return model.get("arch") in CACHEABLE_MODELS and builtin_data and not train.get("init_from")


def conf_fingerprint() -> tuple[int, int]:
    """conf/'s presets as (count, newest mtime): an operator's edit invalidates the cache."""
    stats = [p.stat().st_mtime_ns for p in CONF_DIR.rglob("*.yaml")]
    return len(stats), max(stats, default=0)


class Validator:
    """Validates submissions for the plane; thread-safe. See the module docstring for the why."""

    def __init__(self, settings: Settings, *, workers: int | None = None, cache_size: int | None = None) -> None:
        self.settings = settings
        self.workers = settings.validation_workers if workers is None else workers
        self.cache_size = settings.validation_cache_size if cache_size is None else cache_size
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, tuple[str, Any]] = OrderedDict()
        self._inflight: dict[str, Future] = {}
        self._warming: list[Future] = []
        self.hits = self.misses = self.coalesced = 0

    def start(self) -> None:
        """Spawn the pool and warm every worker in the background (each imports torch: seconds)."""
        if self.workers > 0:
            with self._lock:
                if self._pool is None:
                    self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                                     initializer=_follow_parent, initargs=(os.getpid(), self.settings.workspace))
                    self._warming = [self._pool.submit(_warm_worker, self.settings) for _ in range(self.workers)]

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Wait until every worker's warm-up has ended (well or not: a worker that failed it still
        validates, only slower); whether they all had, within ``timeout``."""
        with self._lock:
            warming = list(self._warming)
        return not futures_wait(warming, timeout=timeout).not_done

    def stop(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def worker_pids(self) -> list[int]:
        pool = self._pool
        return sorted(pool._processes) if pool is not None else []  # noqa: SLF001 - for tests and /metrics only

    def resolve_job(self, *, overrides: list[str] | None, document: dict[str, Any] | None, workdir: Path) -> RunConfig:
        """The validated, confined config of a new job whose (fresh) workdir is ``workdir``, or
        :class:`ConfigError` naming every problem."""
        key = json.dumps([overrides, document, conf_fingerprint()], sort_keys=True, default=str)
        real_workdir = os.path.realpath(workdir)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.hits += 1
            leader = self._inflight.get(key)
            if cached is None and leader is None:
                mine: Future = Future()
                self._inflight[key] = mine
                self.misses += 1
            elif cached is None:
                self.coalesced += 1
        if cached is not None:
            return self._answer(cached, WORKDIR_MARK, real_workdir)
        if leader is not None:  # the same request is being validated now: share its answer
            answer, leader_workdir = leader.result()
            return self._answer(answer, leader_workdir, real_workdir)
        try:
            answer = self._compute(overrides, document, workdir)
        except BaseException as err:
            mine.set_exception(err)
            with self._lock:
                self._inflight.pop(key, None)
            raise
        if answer[0] == "ok" and cacheable(answer[1]):
            with self._lock:
                self._cache[key] = ("ok", _retarget(answer[1], real_workdir, WORKDIR_MARK))
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        mine.set_result((answer, real_workdir))
        with self._lock:
            self._inflight.pop(key, None)
        return self._answer(answer, real_workdir, real_workdir)

    def _compute(self, overrides: list[str] | None, document: dict[str, Any] | None, workdir: Path) -> tuple[str, Any]:
        args = dict(workdir=workdir, settings=self.settings)
        pool = self._pool
        if pool is None:
            return _resolve(overrides, document, **args)
        try:
            return pool.submit(_resolve, overrides, document, **args).result()
        except BrokenProcessPool:  # a worker died (killed, out of memory): a fresh pool for the next ones
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            self.start()
            return _resolve(overrides, document, **args)

    @staticmethod
    def _answer(answer: tuple[str, Any], old_workdir: str, workdir: str) -> RunConfig:
        kind, value = answer
        if old_workdir != workdir:
            value = _retarget(value, old_workdir, workdir)
        if kind == "invalid":
            raise ConfigError([ConfigIssue(*issue) for issue in value])
        return RunConfig.model_validate(value)
