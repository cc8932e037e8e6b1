"""How the launcher starts its workers cheaply: one fork server that imported torch once, and no
stack walks in the elastic agent.

On a small host start-up is CPU: each worker that starts from scratch (``spawn``) imports torch,
DTensor and the training loop, about 5 CPU-seconds on this project's 2-core test machine, so 8
workers spend some 40 CPU-seconds (20 s of wall time) before their first collective. With
``start_method="forkserver"`` the elastic launcher forks every worker from a server process that
imported those modules once (:data:`PRELOAD`): they start with the imports done. The server is
entered in one place, a launch's :class:`~trainer.launch.launcher.LaunchSession`, started by the first
launch that enters it and stopped when the process's last launch ends, so a
later launch (a sweep's next job) gets one that reads its own environment; an elastic restart
within the launch, and launches running at once in threads of one process, share it. The server never touches a GPU
(importing torch does not initialise CUDA), so CUDA is first initialised in each worker, as with ``spawn``.

torch's dynamic rendezvous names the method that records each rendezvous event by calling
``inspect.stack()`` twice (``dynamic_rendezvous.get_method_name``); every call builds the source
context of every frame and, in a launcher that imported Hydra, MLflow and the trainer, costs
about 0.7 CPU-seconds, 6 s per launch, taken from the workers' start-up. :func:`cheap_method_names`
gives it the same name from the frame itself.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

START_METHOD = "forkserver"
# What every worker imports before its first step (trainer.launch.worker imports torch and the
# mesh; the loop brings DTensor, FSDP2 and the pipeline schedules); server_ready, last, freezes them.
# torch._dynamo is not imported by those, but by torch itself at a worker's first model build (a
# _disable_dynamo wrapper): about 2 CPU-seconds in every worker when it is not preloaded. The pipeline
# schedules (torch.distributed.pipelining) load at a pipelined model's first step: 0.75 s of rank 0's
# first step under load when each worker imported them itself.
PRELOAD = ("trainer.launch.worker", "trainer.run.loop", "torch._dynamo", "torch.distributed.pipelining",
           "trainer.launch.server_ready")


_users = 0  # launches inside worker_server() now (threads of one process may launch at once)
_users_lock = threading.Lock()


@contextmanager
def worker_server() -> Iterator[None]:
    """Workers started inside fork from a server that preloaded :data:`PRELOAD`; the server stops when
    the last launch inside (of this process's threads) ends. No worker imports MLflow: rank 0 logs
    through the launcher's client (:mod:`trainer.tracking.relay`).

    The server starts on entry, not at the first worker: its imports (torch, DTensor, the loop) run
    beside what the launcher does before it starts the workers (the command line's imports, the
    validation), on another core."""
    from multiprocessing import forkserver  # start-up: only a launch that starts workers needs it

    global _users
    with _users_lock:
        if _users == 0:
            *modules, ready = PRELOAD  # server_ready freezes what was imported before it: last
            multiprocessing.set_forkserver_preload([*modules, ready])
            forkserver.ensure_running()
        _users += 1
    try:
        yield
    finally:
        with _users_lock:
            _users -= 1
            if _users == 0:
                # The server keeps the environment it started with: the next launch starts its own.
                # (multiprocessing has no public way to stop it; _stop is what its own tests use.)
                # It is killed first: asked politely it would finish its imports before it reads the
                # request, 5 CPU-seconds spent for nothing when the config was refused before any
                # worker started. Its workers, if any, have ended with the launch.
                server: Any = forkserver._forkserver  # typeshed declares neither of the private names used
                if (pid := server._forkserver_pid) is not None:
                    os.kill(pid, signal.SIGKILL)
                server._stop()


def _method_name(depth: int = 2) -> str:
    """``dynamic_rendezvous.get_method_name`` without ``inspect.stack()``: the name of the function
    ``depth`` frames up from this one, as the original returns it."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # fewer frames than that
        return "no_method_name"


def cheap_method_names() -> None:
    """Make torch's rendezvous events name their method from the frame, not from ``inspect.stack()``."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous  # start-up: torch, in the launch only

    if callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        dynamic_rendezvous.get_method_name = _method_name
