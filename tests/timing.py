"""Deadlines that hold on a busy machine: every wall-clock limit a test sets is ``scaled(seconds)``.

The figures written in the tests are what an idle 2-core host needs, with headroom. A host that is
slower, or shared with other work, gets them multiplied by its measured slowness: a fixed pure-Python
workload is timed, and

    slowness = (wall time / this thread's CPU time)            # how much of a core we get right now
             * max(1, CPU time / REFERENCE_CPU_S)              # how slow a core is, against the reference

never below 1 (a fast idle host keeps the written figures: they are a floor) and never above
``MAX_SLOWNESS``. The measurement takes about 0.2 s and is refreshed when it is older than
``REFRESH_S``, so load that arrives in the middle of a session is seen by the deadlines set after it.
``MESHFLOW_TEST_SLOWNESS=<factor>`` fixes the factor instead (e.g. on a CI runner known to be slow).

    from tests.timing import Deadline, scaled
    subprocess.run(command, timeout=scaled(600))       # a guard against a hang, not a figure to meet
    deadline = Deadline(180)                           # a poll loop: deadline.left(), deadline.expired()
    deadline.restart()                                 # ... and a limit on silence: again from now
"""

from __future__ import annotations

import os
import time

# CPU seconds of one _workload() call on the reference host (the 2-core machine the figures were
# written on; 0.069 s idle, 0.070 s beside two busy processes: CPU time hardly moves with load).
REFERENCE_CPU_S = 0.069
ROUNDS = 3  # workload calls per measurement: one ~70 ms call sees too few scheduler periods
MAX_SLOWNESS = 50.0  # past this the host is not running tests, it is swapping: fail, eventually
REFRESH_S = 60.0
ENV_VAR = "MESHFLOW_TEST_SLOWNESS"

_last: tuple[float, float] | None = None  # (when measured, factor)


def _workload() -> int:
    """A fixed amount of interpreter work: no allocation to speak of, no I/O, no C extension."""
    total = 0
    for i in range(1_000_000):
        total += i * i % 7
    return total


def measure_slowness() -> float:
    """Time the workload now and return the factor (>= 1) the module docstring defines."""
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(ROUNDS):
        _workload()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    share = wall / max(cpu, 1e-9)  # 1.0 with a core to ourselves, 1.5 with 3 runnable on 2 cores
    core = max(1.0, cpu / ROUNDS / REFERENCE_CPU_S)
    return min(MAX_SLOWNESS, max(1.0, share * core))


def slowness() -> float:
    """The factor every deadline is multiplied by: the environment's, else a measurement no older than REFRESH_S."""
    global _last
    fixed = os.environ.get(ENV_VAR)
    if fixed:
        try:
            return max(1.0, float(fixed))
        except ValueError:
            raise ValueError(f"{ENV_VAR}={fixed!r} is not a number: set it to a factor such as 2, or unset it "
                             "to measure the host") from None
    now = time.monotonic()
    if _last is None or now - _last[0] > REFRESH_S:
        _last = (now, measure_slowness())
    return _last[1]


def scaled(seconds: float) -> float:
    """``seconds`` (what an idle reference host needs, with headroom) times this host's slowness."""
    return seconds * slowness()


class Deadline:
    """A point ``scaled(seconds)`` from now, for poll loops.

    ``seconds`` is the written (idle-host) figure; ``seconds_scaled`` what this host got, which
    error messages should name so that a miss says how long was really waited. ``restart()`` on
    each sign of progress makes it a limit on silence rather than on the whole wait."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.restart()

    def restart(self) -> None:
        """Start counting again from now (the factor measured anew if it is old): progress was seen."""
        self.seconds_scaled = scaled(self.seconds)
        self._end = time.monotonic() + self.seconds_scaled

    def left(self) -> float:
        """Seconds to the deadline (0 once passed): for a blocking call's own timeout."""
        return max(0.0, self._end - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self._end

    def __repr__(self) -> str:
        return f"Deadline({self.seconds_scaled:.0f} s, {self.left():.0f} s left)"
