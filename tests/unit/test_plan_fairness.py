"""One user's plans cannot starve the others (service/plan_queue.py, service/validation.py): plans get
at most ``plan_workers`` of the validation workers, handed out to users in turn, and a submission
never waits behind a plan. Plans here block on a file the test writes, so every step is an event.

    python -m pytest tests/unit/test_plan_fairness.py -q
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from service.limits import QuotaExceeded
from service.plan_queue import PlanQueue
from service.settings import Settings
from service.validation import Validator
from timing import Deadline, scaled

TINY = ["+parallel=dp", "mesh=[2]", "train.steps=3", "train.seq_len=32", "train.global_batch_size=4"]


def _wait_until(condition: Callable[[], bool], seconds: float = 120) -> None:
    deadline = Deadline(seconds)
    while not condition():
        assert not deadline.expired(), "timed out waiting"
        time.sleep(0.02)


def _in_thread(call: Callable[[], Any]) -> Future:
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(call())
        except BaseException as err:  # noqa: BLE001 - handed to the test
            future.set_exception(err)

    threading.Thread(target=run, daemon=True).start()
    return future


# ------------------------------------------------------------------ the queue alone


def test_the_next_plan_is_the_user_with_fewest_computing_then_served_longest_ago():
    queue = PlanQueue(1, max_waiting=8, wait_s=scaled(120))
    first = queue.acquire("alice")
    granted: list[str] = []

    def plan(user: str) -> Future:
        def run() -> None:
            release = queue.acquire(user)
            granted.append(user)
            release()
        future = _in_thread(run)
        _wait_until(lambda: sum(queue.waiting().values()) == len(waiting) + 1)
        waiting.append(user)
        return future

    waiting: list[str] = []
    futures = [plan("alice"), plan("alice"), plan("bob"), plan("carol")]  # alice's two came first
    assert queue.running() == {"alice": 1} and queue.waiting() == {"alice": 2, "bob": 1, "carol": 1}
    first()
    first()  # a release counts once
    for future in futures:
        future.result(timeout=scaled(60))
    # bob and carol were never served: they go before alice's second and third; then alice in order
    assert granted == ["bob", "carol", "alice", "alice"]
    assert queue.running() == {} and queue.waiting() == {}


def test_a_full_queue_and_a_long_wait_are_429s_naming_their_setting():
    queue = PlanQueue(1, max_waiting=1, wait_s=0.2)
    hold = queue.acquire("alice")
    waiter = _in_thread(lambda: queue.acquire("alice"))
    _wait_until(lambda: queue.waiting() == {"alice": 1})
    with pytest.raises(QuotaExceeded) as full:
        queue.acquire("bob")
    [issue] = full.value.issues
    assert issue.path == "<plans>" and "queues at most 1 (plan_queue_size)" in issue.reason and issue.fix
    assert full.value.retry_after_s is not None and full.value.retry_after_s >= 1
    with pytest.raises(QuotaExceeded) as slow:  # alice's waiter gave up after wait_s: the worker is still held
        waiter.result(timeout=scaled(60))
    assert "within 0.2 s (plan_timeout_s)" in slow.value.issues[0].reason and slow.value.retry_after_s
    assert queue.waiting() == {}
    hold()
    queue.acquire("bob")()  # free again


# ------------------------------------------------------- the validator's pool, two users


def _blocking_plan(name: str, flags: str, *, settings: Settings) -> tuple[str, Any]:
    """A plan that computes until the test writes ``release-<name>``."""
    (Path(flags) / f"started-{name}").touch()
    while not (Path(flags) / f"release-{name}").exists():
        time.sleep(0.01)
    return "ok", {"name": name, "pid": os.getpid()}


def _pid(settings: Settings) -> int:
    return os.getpid()  # a warm-up that costs nothing


def test_one_users_plans_leave_a_worker_to_submissions_and_the_next_turn_to_another_user(tmp_path):
    settings = Settings(workspace=tmp_path / "ws", capacity=2, max_rank_memory_gb=4.0, validation_workers=2)
    flags = tmp_path / "flags"
    flags.mkdir()
    validator = Validator(settings, warm_up=_pid)
    assert validator.plans.workers == 1  # two validation workers: one for plans, one kept for submissions
    validator.start()
    started = lambda name: (flags / f"started-{name}").exists()  # noqa: E731
    release = lambda name: (flags / f"release-{name}").touch()  # noqa: E731

    def plan(user: str, name: str) -> Future:
        return _in_thread(lambda: validator.run_plan(user, "<plan>", _blocking_plan, name, str(flags)))

    try:
        assert validator.wait_warm(timeout=scaled(300))
        alice_1 = plan("alice", "a1")
        _wait_until(lambda: started("a1"))
        alice_2 = plan("alice", "a2")
        _wait_until(lambda: validator.plans.waiting() == {"alice": 1})

        # bob's submission is validated by the other worker while both of alice's plans are unanswered
        cfg, resolved = validator.validate_job(overrides=TINY, document=None, workdir=settings.jobs_dir / "bob-1")
        assert cfg.world_size == 2 and resolved is not None and resolved["plan"]["mesh"]["shape"] == [2]
        assert not alice_1.done() and not alice_2.done() and not started("a2")

        bob_1 = plan("bob", "b1")
        _wait_until(lambda: validator.plans.waiting() == {"alice": 1, "bob": 1})
        release("a1")
        assert alice_1.result(timeout=scaled(60))[1]["name"] == "a1"
        _wait_until(lambda: started("b1"))  # bob's one plan goes before alice's second
        assert not started("a2") and validator.plans.running() == {"bob": 1}
        release("b1")
        _wait_until(lambda: started("a2"))
        release("a2")
        assert [f.result(timeout=scaled(60))[1]["name"] for f in (bob_1, alice_2)] == ["b1", "a2"]
        assert validator.plans.running() == {} and validator.plans.waiting() == {}
    finally:
        for name in ("a1", "a2", "b1"):
            release(name)
        validator.stop()
