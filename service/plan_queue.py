"""Plans' share of the validation workers, handed out fairly between users.

    queue = PlanQueue(workers=1, max_waiting=16, wait_s=120.0)
    release = queue.acquire("alice")     # blocks until one of the plans' workers is this request's
    try:
        ...                              # compute the plan in the pool
    finally:
        release()

Why (issue 49): plans and submissions shared the validation pool's workers in arrival order, so four
slow plans of one user (each running to ``plan_timeout_s``) made another user's ``POST /v1/jobs`` wait
277 s instead of about 1 s. Now at most ``workers`` plans compute at once (the pool's other workers
are kept for submissions, :class:`service.validation.Validator`), and when one of them frees, the next
plan is that of the user with the fewest plans computing, then the user served longest ago, then the
oldest request: one user's queue of plans waits behind another user's single plan, never the reverse.
Waiting is bounded twice, each refusal a 429 with Retry-After naming its setting: at most
``max_waiting`` requests wait (``plan_queue_size``), each at most ``wait_s`` (``plan_timeout_s``).
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from parallel.errors import ConfigIssue
from service.limits import QuotaExceeded

FIX = "wait for a plan to finish, then ask again"


@dataclass(order=True)
class _Ticket:
    seq: int
    user: str = field(compare=False)


class PlanQueue:
    """At most ``workers`` plans computing at once, granted fairly between users; thread-safe."""

    def __init__(self, workers: int, *, max_waiting: int, wait_s: float) -> None:
        self.workers, self.max_waiting, self.wait_s = max(1, workers), max_waiting, wait_s
        self._cond = threading.Condition()
        self._running: Counter[str] = Counter()
        self._served: dict[str, int] = {}  # user -> when last granted (a grant count, not a clock)
        self._waiting: list[_Ticket] = []
        self._seq = itertools.count()
        self._grants = itertools.count(1)

    def running(self) -> dict[str, int]:
        """Plans computing now, per user."""
        with self._cond:
            return dict(self._running)

    def waiting(self) -> dict[str, int]:
        """Plans waiting for a worker, per user."""
        with self._cond:
            return dict(Counter(t.user for t in self._waiting))

    def _retry_after(self) -> int:
        # a slot frees when a plan ends: at worst plan_timeout_s from now, shared by the plan workers
        return max(1, min(30, math.ceil(self.wait_s / self.workers)))

    def _next(self) -> _Ticket:
        return min(self._waiting, key=lambda t: (self._running[t.user], self._served.get(t.user, 0), t.seq))

    def acquire(self, user: str) -> Callable[[], None]:
        """Wait for one of the plans' workers (:class:`QuotaExceeded` when the queue is full, or
        after ``wait_s``); the returned function gives it back, once however often it is called."""
        with self._cond:
            if len(self._waiting) >= self.max_waiting:
                raise QuotaExceeded(ConfigIssue(
                    "<plans>", f"{len(self._waiting)} plans are waiting for a worker; this service queues at most "
                    f"{self.max_waiting} (plan_queue_size)", FIX), retry_after_s=self._retry_after())
            ticket = _Ticket(next(self._seq), user)
            self._waiting.append(ticket)
            deadline = time.monotonic() + self.wait_s
            try:
                while sum(self._running.values()) >= self.workers or self._next() is not ticket:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        ahead = len(self._waiting) - 1
                        raise QuotaExceeded(ConfigIssue(
                            "<plans>", f"no plan worker became free within {self.wait_s:g} s (plan_timeout_s); "
                            f"{sum(self._running.values())} plans computing, {ahead} other(s) waiting", FIX),
                            retry_after_s=self._retry_after())
                    self._cond.wait(left)
            finally:
                self._waiting.remove(ticket)
                self._cond.notify_all()  # the next in line may be another waiter now
            self._running[user] += 1
            self._served[user] = next(self._grants)
        released = threading.Event()

        def release() -> None:
            with self._cond:
                if released.is_set():
                    return
                released.set()
                self._running[user] -= 1
                if self._running[user] <= 0:
                    del self._running[user]
                self._cond.notify_all()

        return release
