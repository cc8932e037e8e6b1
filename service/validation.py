"""The submit path's validation, concurrent: a process pool, identical requests coalesced, results cached.

    validator = Validator(settings)          # settings.validation_workers processes (0: in the caller)
    validator.start()                        # spawns and warms the pool in the background
    cfg, plan = validator.validate_job(overrides=["+parallel=dp", "mesh=[2]"], document=None, workdir=jobs / job_id)
    validator.stop()

Why this shape (measured on the 2-core development machine, see docs/control-plane-load.md):

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
- Plans never take every worker: at most ``plan_workers`` compute at once (by default all but one of
  the workers), so a submission waits only behind other submissions, never behind a plan, and the
  plans' workers go to users in turn (:class:`service.plan_queue.PlanQueue`): four slow plans of one
  user had made another user's submission wait 277 s (issue 49).
- Every request computed in a worker has a time limit (``plan_timeout_s``: the worker is then
  replaced, by pebble's pool, and the request refused) and a memory limit (``plan_memory_gb`` of
  address space on top of what the worker holds, by ``RLIMIT_AS``); the plans of
  :mod:`service.plans` run here too, so nothing a request sends is computed in the server.
"""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import psutil
from pebble import ProcessExpired, ProcessPool

from parallel.errors import ConfigError, ConfigIssue
from parallel.plan.spec import ParallelPlan
from service import fork_server
from service.leftovers import record_worker
from service.limits import limit_request
from service.plan_queue import PlanQueue
from service.settings import Settings
from service.submit import resolve_config
from trainer.config.compose import CONF_DIR
from trainer.config.schema import RunConfig
from trainer.data.text import STDLIB
from trainer.tracking.run_record import launch_plan

WORKDIR_MARK = "\x00workdir\x00"  # stands for the job's workdir in cached results; no path contains NUL
CACHEABLE_MODELS = ("llama", "mlp")          # built in: the checks read no file
CACHEABLE_DATA = ("synthetic", "regression")  # generated; and text from `stdlib`: nothing under datasets/ is listed
GIB = 2**30


def resolve_as_service(settings: Settings, *, overrides: list[str] | None, document: dict[str, Any] | None,
                       workdir: Path) -> tuple[RunConfig, ParallelPlan]:
    """:func:`resolve_config` with this service's workspace, tracking store, limits (the size
    ceilings before any planning, the memory budget) and executor (a cluster executor takes several
    nodes): what a job and a plan request both get."""
    assert settings.mlflow_tracking_uri is not None, "Settings fills it in"
    return resolve_config(overrides=overrides, document=document, workspace=settings.workspace, workdir=workdir,
                          tracking_uri=settings.mlflow_tracking_uri, run_id=None,
                          limit_raw=partial(limit_request, settings=settings),
                          multi_node=settings.executor != "local", ui_url=settings.mlflow_ui_url)


def _resolve(overrides: list[str] | None, document: dict[str, Any] | None, *, workdir: Path,
             settings: Settings) -> tuple[str, Any]:
    """One submission's validation, in a pool worker or in the caller: ``("ok", {"config": config as JSON,
    "plan": its resolved plan as JSON or None})`` or ``("invalid", [(path, reason, fix), ...])``. Plain values,
    so a worker's answer pickles. The plan (:class:`~parallel.plan.serial.ResolvedPlan`, with the fingerprint of
    the meta model validation built) travels with the job to its launcher, which does not resolve it again."""
    try:
        cfg, plan = resolve_as_service(settings, overrides=overrides, document=document, workdir=workdir)
    except ConfigError as err:
        return "invalid", [(i.path, i.reason, i.fix) for i in err.issues]
    resolved = launch_plan(cfg, plan)  # None for a model that cannot be planned on the meta device
    return "ok", {"config": cfg.model_dump(mode="json"), "plan": resolved.to_dict() if resolved else None}


def _limit_refusal(path: str, reason: str) -> tuple[str, str, str]:
    # Prose, not a command: the request's own overrides (or document) plus dry_run=true are what to run locally.
    return (path, reason, "plan a smaller mesh or model, or plan this config on your own machine: the same "
                          "overrides with dry_run=true, given to python -m trainer")


@contextmanager
def address_space_limit(extra_bytes: float) -> Iterator[None]:
    """Allocations past ``extra_bytes`` more address space than this process holds now fail
    (MemoryError) until the block ends; the previous limit comes back after it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = int(psutil.Process().memory_info().vms + extra_bytes)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _out_of_memory(err: BaseException) -> bool:
    # Python and numpy raise MemoryError; torch's CPU allocator a RuntimeError.
    return isinstance(err, MemoryError) or (isinstance(err, RuntimeError) and "can't allocate memory" in str(err))


def limited(path: str, compute: Callable[..., tuple[str, Any]], *args: Any, settings: Settings,
            **kwargs: Any) -> tuple[str, Any]:
    """``compute(*args, settings=settings, **kwargs)`` within ``plan_memory_gb`` of new address
    space: its answer, or ``("invalid", [the refusal at path])`` when an allocation failed."""
    try:
        with address_space_limit(settings.plan_memory_gb * GIB):
            return compute(*args, settings=settings, **kwargs)
    except Exception as err:  # only running out of memory becomes a refusal; anything else is raised
        if not _out_of_memory(err):
            raise
    return "invalid", [_limit_refusal(path, f"computing it needs more than this service's limit of "
                                            f"{settings.plan_memory_gb:g} GiB of memory (plan_memory_gb)")]


def _follow_parent(parent: int, workspace: Path | None = None) -> None:
    """A pool worker's initializer: leave when the server that started it is gone. A server killed
    with SIGKILL cannot stop its pool, and its workers (hundreds of MB each, torch imported) would
    otherwise live on, reparented, for as long as the machine runs. A worker forked by the fork server
    (:mod:`service.fork_server`) is that server's child, and the fork server leaves when the server that
    started it does: the worker leaves when its parent or the server is gone. It also records itself under
    ``workspace``, so a restarted server ends it should it still run (:mod:`service.leftovers`)."""
    if workspace is not None:
        record_worker(workspace, server_pid=parent)
    own_parent = os.getppid()  # the server, or the fork server it started

    def watch() -> None:
        # the server itself is looked for too: a fork server leaves only once its interpreter has ended
        while os.getppid() == own_parent and (own_parent == parent or psutil.pid_exists(parent)):
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

    def __init__(self, settings: Settings, *, workers: int | None = None, cache_size: int | None = None,
                 warm_up: Callable[[Settings], int] = _warm_worker) -> None:
        self.settings = settings
        self.warm_up = warm_up  # run once in every new worker before requests; answers its pid
        self.workers = settings.validation_workers if workers is None else workers
        self.cache_size = settings.validation_cache_size if cache_size is None else cache_size
        # Plans get at most this many workers at once; with one worker or none, they share it with submissions.
        plan_workers = settings.plan_workers if settings.plan_workers is not None else max(1, self.workers - 1)
        self.plans = PlanQueue(plan_workers, max_waiting=settings.plan_queue_size, wait_s=settings.plan_timeout_s)
        self._pool: ProcessPool | None = None
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
                    self._pool = ProcessPool(self.workers, context=fork_server.context(),
                                             initializer=_follow_parent, initargs=(os.getpid(),
                                                                                   self.settings.workspace))
                    self._warming = [self._pool.schedule(self.warm_up, (self.settings,)) for _ in range(self.workers)]

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
            pool.stop()
            pool.join()

    def worker_pids(self) -> list[int]:
        pool = self._pool
        # pebble keeps its workers by pid; for tests and /metrics only
        return sorted(pool._pool_manager.worker_manager.workers) if pool is not None else []

    def run(self, path: str, compute: Callable[..., tuple[str, Any]], *args: Any, **kwargs: Any) -> tuple[str, Any]:
        """``compute(*args, settings=..., **kwargs)`` (a module-level function answering plain values)
        in a pool worker within the time and memory limits, or ``("invalid", [a refusal at path])``
        past them; in the caller, without limits, when the validator has no workers."""
        return self._run(path, compute, args, kwargs)[0]

    def run_plan(self, owner: str, path: str, compute: Callable[..., tuple[str, Any]], *args: Any,
                 **kwargs: Any) -> tuple[str, Any]:
        """:meth:`run` for a plan of ``owner``: it first waits for one of the plans' workers, granted fairly
        between owners (:class:`~service.plan_queue.PlanQueue`; :class:`~service.limits.QuotaExceeded` when the
        queue is full or the wait too long). A worker ended at the time limit is replaced and warmed up again;
        the plans' share stays taken until that warm-up has ended, so it is never the submissions' wait."""
        release = self.plans.acquire(owner)
        warming: Future | None = None
        try:
            answer, warming = self._run(path, compute, args, kwargs)
            return answer
        finally:
            if warming is None:
                release()
            else:
                warming.add_done_callback(lambda _: release())

    def _run(self, path: str, compute: Callable[..., tuple[str, Any]], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> tuple[tuple[str, Any], Future | None]:
        """:meth:`run`'s answer, and the warm-up of the worker that replaced an ended one (else None)."""
        timeout = self.settings.plan_timeout_s
        for attempt in (1, 2):
            pool = self._pool
            if pool is None:
                return compute(*args, settings=self.settings, **kwargs), None
            try:
                try:
                    future = pool.schedule(limited, (path, compute, *args), {"settings": self.settings, **kwargs},
                                           timeout=timeout)
                except RuntimeError as err:  # pebble's word for a pool that is not running
                    raise BrokenProcessPool(str(err)) from None
                return future.result(), None
            except TimeoutError:  # pebble has ended the worker and started another
                reason = f"computing it took longer than this service's limit of {timeout:g} s (plan_timeout_s)"
            except ProcessExpired as err:  # killed from outside (the kernel's OOM killer, an operator)
                reason = f"the worker computing it ended ({err}); it may have needed more memory than this host has"
            except BrokenProcessPool:
                # pebble gives up on the whole pool when a worker dies while none computes anything
                # (killed while idle): not this request's doing, so it goes to a fresh pool.
                self._replace_pool(pool)
                if attempt == 1:
                    continue
                raise
            # The new worker warms up before it takes requests (most likely: the other workers are warm and busy).
            warming = pool.schedule(self.warm_up, (self.settings,))
            return ("invalid", [_limit_refusal(path, reason)]), warming
        raise AssertionError("unreachable")

    def _replace_pool(self, pool: ProcessPool) -> None:
        with self._lock:
            if self._pool is not pool:
                return  # another request replaced it already
            self._pool = None
        pool.stop()
        self.start()

    def resolve_job(self, *, overrides: list[str] | None, document: dict[str, Any] | None, workdir: Path) -> RunConfig:
        """The validated, confined config of a new job whose (fresh) workdir is ``workdir``, or
        :class:`ConfigError` naming every problem."""
        return self.validate_job(overrides=overrides, document=document, workdir=workdir)[0]

    def validate_job(self, *, overrides: list[str] | None, document: dict[str, Any] | None,
                     workdir: Path) -> tuple[RunConfig, dict[str, Any] | None]:
        """:meth:`resolve_job`'s config and its resolved plan as JSON (``ResolvedPlan.to_dict()``; None when
        the model cannot be planned on the meta device)."""
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
        if answer[0] == "ok" and cacheable(answer[1]["config"]):
            with self._lock:
                # the plan names no path: only the config is re-targeted
                self._cache[key] = ("ok", {**answer[1], "config": _retarget(answer[1]["config"], real_workdir,
                                                                            WORKDIR_MARK)})
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        mine.set_result((answer, real_workdir))
        with self._lock:
            self._inflight.pop(key, None)
        return self._answer(answer, real_workdir, real_workdir)

    def _compute(self, overrides: list[str] | None, document: dict[str, Any] | None, workdir: Path) -> tuple[str, Any]:
        return self.run("<config>", _resolve, overrides, document, workdir=workdir)

    @staticmethod
    def _answer(answer: tuple[str, Any], old_workdir: str, workdir: str) -> tuple[RunConfig, dict[str, Any] | None]:
        kind, value = answer
        if kind == "invalid":
            raise ConfigError([ConfigIssue(*(_retarget(part, old_workdir, workdir) for part in issue))
                               for issue in value])
        config = value["config"] if old_workdir == workdir else _retarget(value["config"], old_workdir, workdir)
        return RunConfig.model_validate(config), value["plan"]
