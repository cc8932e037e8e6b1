"""What one user may ask of the service: ceilings on a job's config, quotas per user, live log streams.

Every refusal is a :class:`~parallel.errors.ConfigIssue` naming the field, the limit (and the
setting that holds it) and the fix. Config ceilings are 422s (:class:`ConfigError`); quotas,
which a user may meet again later with the same request, are 429s (:class:`QuotaExceeded`).
The size of a request (world size, mesh, batch) is checked on the composed document, before
anything is planned: a plan's or a validation's cost grows with them.

    issues = check_size_ceilings(raw, settings)                     # before planning; also via limit_request
    issues = check_ceilings(cfg, settings, priority=5, is_admin=False)
    check_queue_quota(session, owner="alice", settings=settings)    # raises QuotaExceeded
    with plane.log_streams.slot("alice"):                           # raises QuotaExceeded
        ...
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from parallel.topology import mesh_shape_of, mesh_world_size
from parallel.errors import ConfigError, ConfigIssue
from service.settings import Settings
from service.store import Job, JobState
from trainer.config.schema import RunConfig

GIB = 2**30
MAX_MESH_AXES = 8  # dp, pp, tp, ep, cp and hsdp's two data-parallel axes fit


class QuotaExceeded(Exception):
    """A per-user quota is full; the same request may succeed later (HTTP 429)."""

    def __init__(self, issue: ConfigIssue, *, retry_after_s: int | None = None) -> None:
        super().__init__(f"{issue.path}: {issue.reason} ({issue.fix})")
        self.issues = [issue]
        self.retry_after_s = retry_after_s  # the Retry-After header, when a retry soon may succeed


def workers_per_node(raw: dict[str, Any]) -> int:
    """The worker processes one node of the (not yet validated) config ``raw`` starts: its mesh's
    size (a shape, or explicit rank ids) over ``launch.nnodes``; 1 for anything malformed, which
    validation then refuses with its own message."""
    launch = raw.get("launch")
    launch = launch if isinstance(launch, dict) else {}
    nnodes = launch.get("nnodes", 1)
    try:
        world = mesh_world_size(raw.get("mesh"))
    except (TypeError, ValueError):
        return 1
    if not isinstance(nnodes, int) or isinstance(nnodes, bool) or nnodes < 1:
        return max(1, world)
    return max(1, -(-world // nnodes))


def cap_memory_budget(raw: dict[str, Any], settings: Settings) -> list[ConfigIssue]:
    """Set ``launch.memory_budget_gb`` to the service's per-rank limit (the trainer then refuses a
    model predicted to need more, by :func:`trainer.planner.memory.budget.check_memory`); a larger one sent is
    refused."""
    launch = raw.setdefault("launch", {})
    if not isinstance(launch, dict):
        return []
    limit, source = settings.rank_memory_limit(workers_per_node(raw))
    sent = launch.get("memory_budget_gb")
    # Written and printed rounded down: a budget read back from a job, or typed from the fix, is not
    # above the limit by a rounding.
    written, shown = math.floor(limit / GIB * 1000) / 1000, f"{math.floor(limit / GIB * 100) / 100:.2f}"
    if isinstance(sent, (int, float)) and not isinstance(sent, bool) and sent * GIB > limit:
        return [ConfigIssue("launch.memory_budget_gb", f"{sent} GiB per rank is above this service's limit of "
                            f"{shown} GiB ({source})", f"leave launch.memory_budget_gb out, or give at most {shown}")]
    if sent is None:
        launch["memory_budget_gb"] = written
    return []


def _mesh_extent(mesh: Any) -> tuple[int, int] | None:
    """``(world size, number of axes)`` of a document's mesh: a shape (``[2, 4]``) or explicit rank
    ids (``[[0, 1], [2, 3]]``); None when it is neither (the schema then says what is wrong)."""
    try:
        shape = mesh_shape_of(mesh)
    except TypeError:
        return None
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
        return None
    return max(1, mesh_world_size(mesh)), len(shape)


def _int_at(raw: dict[str, Any], *keys: str) -> int | None:
    value: Any = raw
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_size_ceilings(raw: dict[str, Any], settings: Settings) -> list[ConfigIssue]:
    """World size, mesh axes, global batch and micro-batches of a composed config document against
    the service's ceilings: what a plan or a validation costs grows with them, so they are checked
    before any of it is computed."""
    issues = []
    extent = _mesh_extent(raw.get("mesh"))
    if extent is not None:
        world, axes = extent
        limit, setting = settings.max_world_size, "max_world_size"
        if 0 < settings.capacity < limit:
            limit, setting = settings.capacity, "capacity"
        if world > limit:
            issues.append(ConfigIssue("mesh", f"needs {world} worker slots; this service's limit is "
                                              f"{limit} ({setting})",
                                      f"use a mesh of at most {limit} devices, e.g. mesh=[{limit}]"))
        if axes > MAX_MESH_AXES:
            issues.append(ConfigIssue("mesh", f"has {axes} axes; a mesh has at most {MAX_MESH_AXES}",
                                      "name one axis per parallelism, e.g. mesh=[2,2,2] with parallel.dims=[dp,pp,tp]"))
    batch = _int_at(raw, "train", "global_batch_size")
    if batch is not None and batch > settings.max_global_batch_size:
        limit = settings.max_global_batch_size
        issues.append(ConfigIssue("train.global_batch_size", f"{batch} sequences is above this service's limit of "
                                  f"{limit} (max_global_batch_size)", f"use train.global_batch_size={limit} or less"))
    microbatches = _int_at(raw, "parallel", "pipeline", "microbatches")
    if microbatches is not None and microbatches > settings.max_microbatches:
        limit = settings.max_microbatches
        issues.append(ConfigIssue("parallel.pipeline.microbatches", f"{microbatches} is above this service's limit "
                                  f"of {limit} (max_microbatches)",
                                  f"use parallel.pipeline.microbatches={limit} or less"))
    return issues


def limit_request(raw: dict[str, Any], settings: Settings) -> list[ConfigIssue]:
    """The service's limits on a confined document, before any planning (``limit_raw`` of
    :func:`service.submit.resolve_config`): an oversized request is refused at once, nothing of it
    computed; otherwise the memory budget is capped (:func:`cap_memory_budget`)."""
    if issues := check_size_ceilings(raw, settings):
        raise ConfigError(issues)
    return cap_memory_budget(raw, settings)


def check_ceilings(cfg: RunConfig, settings: Settings, *, priority: int, is_admin: bool) -> list[ConfigIssue]:
    """train.steps, launch.max_restarts and the priority against the service's limits."""
    issues = []
    if cfg.train.steps > settings.max_steps:
        issues.append(ConfigIssue("train.steps", f"{cfg.train.steps} steps is above this service's limit of "
                                  f"{settings.max_steps} (max_steps)", f"use train.steps <= {settings.max_steps}, "
                                  "or continue in a new job with train.init_from"))
    if cfg.launch.max_restarts > settings.max_restarts:
        issues.append(ConfigIssue("launch.max_restarts", f"{cfg.launch.max_restarts} is above this service's limit "
                                  f"of {settings.max_restarts} (max_restarts)",
                                  f"use launch.max_restarts <= {settings.max_restarts}"))
    if priority > 0 and not is_admin:
        issues.append(ConfigIssue("priority", f"{priority} is above the default 0; only admins raise a job's priority",
                                  "leave priority out (0), or give a negative one; ask an admin to raise it"))
    return issues


def check_queue_quota(session: Session, *, owner: str, settings: Settings) -> None:
    """Raise :class:`QuotaExceeded` when ``owner`` already has ``max_queued_per_user`` jobs QUEUED."""
    queued = session.scalar(select(func.count()).select_from(Job).where(
        Job.owner == owner, Job.state == JobState.QUEUED.value)) or 0
    if queued >= settings.max_queued_per_user:
        raise QuotaExceeded(ConfigIssue("<queue>", f"user {owner!r} has {queued} jobs queued; the limit is "
                                        f"{settings.max_queued_per_user} (max_queued_per_user)",
                                        "wait for some to start, or cancel one, then submit again"))


class UserSlots:
    """At most ``limit`` of something per user at once (a thread-safe counter); a user past it gets
    :class:`QuotaExceeded` naming ``path``, the number open, ``setting`` and ``fix``."""

    def __init__(self, limit: int, *, path: str, what: str, setting: str, fix: str,
                 retry_after_s: int | None = None) -> None:
        self.limit = limit
        self.path, self.what, self.setting, self.fix, self.retry_after_s = path, what, setting, fix, retry_after_s
        self._open: Counter[str] = Counter()
        self._lock = threading.Lock()

    def acquire(self, user: str) -> Callable[[], None]:
        """Take one of ``user``'s slots (:class:`QuotaExceeded` when none is free); the returned
        function gives it back, once however often it is called."""
        with self._lock:
            if self._open[user] >= self.limit:
                raise QuotaExceeded(ConfigIssue(self.path, f"user {user!r} has {self._open[user]} {self.what}; "
                                                f"the limit is {self.limit} ({self.setting})", self.fix),
                                    retry_after_s=self.retry_after_s)
            self._open[user] += 1
        released = threading.Event()

        def release() -> None:
            with self._lock:
                if not released.is_set():
                    released.set()
                    self._open[user] -= 1
                    if self._open[user] <= 0:
                        del self._open[user]

        return release

    @contextmanager
    def slot(self, user: str) -> Iterator[None]:
        release = self.acquire(user)
        try:
            yield
        finally:
            release()


def stream_slots(limit: int) -> UserSlots:
    """Live ``logs?follow=true`` streams per user."""
    return UserSlots(limit, path="follow", what="live log streams open", setting="max_log_streams_per_user",
                     fix="close a stream, or read the log without follow (tail=N)")


def plan_slots(limit: int) -> UserSlots:
    """Plans computing at once per user (each holds a validation worker for up to ``plan_timeout_s``)."""
    return UserSlots(limit, path="<plans>", what="plans computing", setting="max_plans_per_user",
                     fix="wait for a plan to finish, then ask again", retry_after_s=2)
