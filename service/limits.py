"""What one user may ask of the service: ceilings on a job's config, quotas per user, live log streams.

Every refusal is a :class:`~parallel.errors.ConfigIssue` naming the field, the limit (and the
setting that holds it) and the fix. Config ceilings are 422s (:class:`ConfigError`); quotas,
which a user may meet again later with the same request, are 429s (:class:`QuotaExceeded`).

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

from parallel.config import mesh_shape_of
from parallel.errors import ConfigIssue
from service.settings import Settings
from service.store import Job, JobState
from trainer.config.schema import RunConfig

GIB = 2**30


class QuotaExceeded(Exception):
    """A per-user quota is full; the same request may succeed later (HTTP 429)."""

    def __init__(self, issue: ConfigIssue) -> None:
        super().__init__(f"{issue.path}: {issue.reason} ({issue.fix})")
        self.issues = [issue]


def workers_per_node(raw: dict[str, Any]) -> int:
    """The worker processes one node of the (not yet validated) config ``raw`` starts: its mesh's
    size (a shape, or explicit rank ids) over ``launch.nnodes``; 1 for anything malformed, which
    validation then refuses with its own message."""
    launch = raw.get("launch") if isinstance(raw.get("launch"), dict) else {}
    nnodes = launch.get("nnodes", 1)
    try:
        world = math.prod(mesh_shape_of(raw.get("mesh")))
    except (TypeError, ValueError):
        return 1
    if not isinstance(nnodes, int) or isinstance(nnodes, bool) or nnodes < 1:
        return max(1, world)
    return max(1, -(-world // nnodes))


def cap_memory_budget(raw: dict[str, Any], settings: Settings) -> list[ConfigIssue]:
    """Set ``launch.memory_budget_gb`` to the service's per-rank limit (the trainer then refuses a
    model predicted to need more, by :func:`trainer.planner.memory.budget.check_memory`); a larger one sent is refused."""
    launch = raw.setdefault("launch", {})
    if not isinstance(launch, dict):
        return []
    limit, source = settings.rank_memory_limit(workers_per_node(raw))
    sent = launch.get("memory_budget_gb")
    if isinstance(sent, (int, float)) and not isinstance(sent, bool) and sent * GIB > limit:
        return [ConfigIssue("launch.memory_budget_gb", f"{sent} GiB per rank is above this service's limit of "
                            f"{limit / GIB:.2f} GiB ({source})",
                            f"leave launch.memory_budget_gb out, or give at most {limit / GIB:.2f}")]
    if sent is None:
        launch["memory_budget_gb"] = round(limit / GIB, 3)
    return []


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


class StreamSlots:
    """Live log streams per user, at most ``limit`` each (a thread-safe counter)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: Counter[str] = Counter()
        self._lock = threading.Lock()

    def acquire(self, user: str) -> Callable[[], None]:
        """Take one of ``user``'s slots (:class:`QuotaExceeded` when none is free); the returned
        function gives it back, once however often it is called."""
        with self._lock:
            if self._open[user] >= self.limit:
                raise QuotaExceeded(ConfigIssue("follow", f"user {user!r} has {self._open[user]} live log streams open; "
                                                f"the limit is {self.limit} (max_log_streams_per_user)",
                                                "close a stream, or read the log without follow (tail=N)"))
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
