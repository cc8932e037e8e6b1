"""Where the validation pool's workers come from: a fork server that imported what a validation needs
once, started as early as the server can start it.

    start()                        # python -m api, before its own imports: the two import side by side
    pool = ProcessPool(2, context=context())

A validation worker's first validation imports some 615 modules beyond the service's (torch's compiler
and distributed packages, Hydra's internals, matplotlib for the plan's pictures): 5.8 s of a worker's
start on the 2-core host under load, 1.8 s once they are preloaded. Forked from a server that imported
them (:data:`PRELOAD`), every worker starts with them: the first ones, and each one that replaces a
worker ended at a plan's time limit. The control plane's server has threads, so its workers are never
forked from it directly. Measured (the first plan answered after ``python -m api``, the 2-core host at
load 40-90): 40.5-60.8 s with spawned workers, 35.7-37.0 s with this.
"""

from __future__ import annotations

import multiprocessing
import threading
from multiprocessing.context import BaseContext

PRELOAD = ("service.validation", "service.plans", "torch._dynamo", "torch.distributed.tensor",
           "torch.distributed.checkpoint", "torch.distributed.pipelining", "torch.distributed.fsdp",
           "hydra._internal.config_loader_impl", "matplotlib.pyplot")

_lock = threading.Lock()
_ours = False  # whether this process's fork server was started by start(), with PRELOAD


def _running() -> bool:
    """Whether this process runs a fork server (no public way to ask; multiprocessing's tests read this)."""
    from multiprocessing import forkserver  # start-up: a server that validates only

    return getattr(forkserver._forkserver, "_forkserver_pid", None) is not None


def start() -> None:
    """Start this process's fork server with :data:`PRELOAD`, in the background (its imports run
    beside the caller's); nothing when one runs already."""
    from multiprocessing import forkserver  # start-up: a server that validates only

    global _ours
    with _lock:
        if not _running():
            multiprocessing.set_forkserver_preload(list(PRELOAD))
            forkserver.ensure_running()
            _ours = True


def context() -> BaseContext:
    """The pool's workers forked from the fork server of :func:`start` (started now if none runs),
    or spawned when this process runs another one: a launch's, with its own preload
    (:mod:`trainer.launch.processes`); then each worker imports what it needs itself."""
    start()
    with _lock:
        return multiprocessing.get_context("forkserver" if _ours and _running() else "spawn")
