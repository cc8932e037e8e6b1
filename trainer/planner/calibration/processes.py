"""The probe's worker processes, bound to the process that starts them.

    text = run_bound(worker, nprocs=4, args=(4, [2, 4]))   # worker(rank, tmp_dir, 4, [2, 4]) in 4 processes;
                                                          # answers what they left in tmp_dir/result.json

A probe started inside a request (the control plane's ``POST /v1/plans`` with ``+parallel=auto``) has to
end with it: a plan refused at its 8 s limit had left its 4 probe processes running 4.5 more minutes
(1.9 GB) and a ``meshflow-probe-*`` directory behind (issue 49). The process that starts a probe can end
three ways, and each is covered:

- it returns or raises (KeyboardInterrupt too): ``finally`` kills the workers left and removes the directory;
- SIGTERM, the way pebble ends a validation worker past ``plan_timeout_s``: pebble's handler runs
  multiprocessing's exit function, which runs the same cleanup (a registered finalizer) before it exits. The
  workers are daemonic, so that function terminates them too; torch's default, non-daemonic, made it *join*
  them, so the worker waited on its probe until pebble's SIGKILL three seconds later and the probe ran on;
- SIGKILL (the kernel's OOM killer, pebble after those 3 s): every worker has asked the kernel to kill it
  when its parent ends (``PR_SET_PDEATHSIG`` with SIGKILL; torch sets SIGINT, which a worker blocked in a
  collective or still importing never acts on), and the next probe removes the directories of probes whose
  process is gone (the directory's name carries its pid).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.util import Finalize
from pathlib import Path
from typing import Any

import psutil

PREFIX = "meshflow-probe-"
RESULT = "result.json"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _end_with_parent(parent: int) -> None:
    """This process ends when ``parent`` does (at once on Linux; within 0.2 s elsewhere)."""
    if sys.platform.startswith("linux"):
        import ctypes  # only here: the one platform call

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    else:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.2)
            os._exit(1)

        threading.Thread(target=watch, name="probe-follow-parent", daemon=True).start()
    if os.getppid() != parent:  # it ended before the request above was made
        os._exit(1)


def _bound(rank: int, fn: Callable[..., None], parent: int, tmp: str, *args: Any) -> None:
    _end_with_parent(parent)
    fn(rank, tmp, *args)


def _pid_of(directory: Path) -> int | None:
    head = directory.name.removeprefix(PREFIX).split("-", 1)[0]
    return int(head) if head.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE  # a zombie has ended: it waits to be reaped
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # another user's process
        return True


def sweep_stale_dirs(root: Path | None = None) -> list[Path]:
    """Remove the directories of probes whose starting process is gone (killed with SIGKILL, so
    nothing of it could clean up); the removed ones."""
    root = Path(root or tempfile.gettempdir())
    stale = [d for d in root.glob(PREFIX + "*")
             if d.is_dir() and (pid := _pid_of(d)) is not None and pid != os.getpid() and not _alive(pid)]
    for directory in stale:
        shutil.rmtree(directory, ignore_errors=True)
    return stale


def run_bound(fn: Callable[..., None], *, nprocs: int, args: tuple[Any, ...]) -> str:
    """``fn(rank, tmp_dir, *args)`` in ``nprocs`` spawned processes that end with this one (see the
    module docstring); the text they left in ``tmp_dir/result.json``. The directory is removed after."""
    import torch.multiprocessing as mp

    sweep_stale_dirs()
    tmp = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
    started: list[Any] = []  # the workers' context, once they are all started

    def clean() -> None:
        for process in started[0].processes if started else []:
            if process.is_alive():
                process.kill()
                process.join()
        shutil.rmtree(tmp, ignore_errors=True)

    # Run by multiprocessing's exit function too: on a normal exit, and in pebble's SIGTERM handler.
    cleanup = Finalize(None, clean, exitpriority=10)
    try:
        started.append(mp.start_processes(_bound, args=(fn, os.getpid(), tmp, *args), nprocs=nprocs, join=False,
                                          daemon=True, start_method="spawn"))
        while not started[0].join():
            pass
        return (Path(tmp) / RESULT).read_text()
    finally:
        cleanup()  # runs clean() once, and unregisters it
