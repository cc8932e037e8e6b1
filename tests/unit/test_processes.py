"""trainer.launch.processes: workers fork from one preloaded server, shared by launches that overlap
and stopped after the last; torch's rendezvous method names, read from the frame."""

from __future__ import annotations

import inspect
import multiprocessing
import os
import signal
import threading
from multiprocessing import forkserver

import pytest

from trainer.launch.processes import PRELOAD, START_METHOD, _method_name, worker_server


def _modules_present(queue) -> None:
    import sys

    queue.put([name in sys.modules for name in PRELOAD])


def _start_one() -> list[bool]:
    ctx = multiprocessing.get_context(START_METHOD)
    queue = ctx.SimpleQueue()
    proc = ctx.Process(target=_modules_present, args=(queue,))
    proc.start()
    proc.join()
    assert proc.exitcode == 0
    return queue.get()


@pytest.fixture
def no_fork_server_yet():
    """This process runs no fork server when the test starts. A test before this one in the same
    process may have left one running: the control plane's validation pool starts its own, with the
    service's preload (service.fork_server), and a launch then reuses it (one fork server per process)."""
    server = forkserver._forkserver
    if (pid := server._forkserver_pid) is not None:
        os.kill(pid, signal.SIGKILL)
        server._stop()


def test_overlapping_launches_share_the_server_and_the_last_stops_it(no_fork_server_yet):
    first_inside, first_may_leave = threading.Event(), threading.Event()
    seen: dict[str, list[bool]] = {}

    def first() -> None:
        with worker_server():
            seen["first"] = _start_one()
            first_inside.set()
            first_may_leave.wait()

    thread = threading.Thread(target=first)
    thread.start()
    with worker_server():
        first_inside.wait()
        server_pid = forkserver._forkserver._forkserver_pid
        first_may_leave.set()
        thread.join()  # the first launch has left; the server is still this one's
        seen["second"] = _start_one()
        assert forkserver._forkserver._forkserver_pid == server_pid
    assert forkserver._forkserver._forkserver_pid is None  # stopped with the last launch
    # every worker found torch, the trainer's worker module and the loop already imported
    assert seen == {"first": [True] * len(PRELOAD), "second": [True] * len(PRELOAD)}


def test_method_names_match_torchs_stack_walk():
    def torchs(depth: int = 2) -> str:  # what dynamic_rendezvous.get_method_name returns
        return inspect.stack()[depth].function if len(inspect.stack()) > depth else "no_method_name"

    def recorder(name_of) -> str:
        return name_of()

    def some_rendezvous_method() -> tuple[str, str]:
        return recorder(torchs), recorder(_method_name)

    assert some_rendezvous_method() == ("some_rendezvous_method", "some_rendezvous_method")
    assert _method_name(10_000) == "no_method_name"
