"""Validation workers a killed server left behind: each worker records itself, a starting server ends
the orphans among them.

    record_worker(workspace)          # a pool worker's initializer (service.validation)
    ended = end_leftovers(workspace)  # ControlPlane.start: the pids it ended

A worker already leaves when its server dies (``service.validation._follow_parent`` looks for its
parent and its server every second); this is the second line, for a worker that could not (stopped, or busy in
code that never lets its watcher run): ~285 MB each, reparented, for as long as the host runs.

A record is ``<workspace>/.validation-workers/<pid>``: the worker's pid and start time, its
server's pid and start time, and its command line. A starting server ends a recorded process only
when all of these hold, so it never ends an unrelated process, nor another live server's worker:

- the pid runs, and started when the record says (not a later process given the same pid);
- its command line is the recorded one, and a multiprocessing worker's (spawned, or forked by a fork server);
- its server is gone: the recorded server no longer runs (same pid, same start time), or neither the
  worker's parent nor that parent's parent (a fork server's) is that server.

Every other record is stale (its process ended or is someone else's) and is removed.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

WORKERS_DIR = ".validation-workers"
# in the command line of every multiprocessing worker: a spawned one's, or the fork server's it was forked from
WORKER_MARKS = ("--multiprocessing-fork", "multiprocessing.forkserver")


def record_worker(workspace: Path, server_pid: int | None = None) -> None:
    """Record the calling process, a pool worker, and its server: ``server_pid`` (a worker forked by the
    server's fork server), else its parent."""
    me = psutil.Process()
    parent = me.parent() if server_pid is None else _runs(server_pid, None)
    record = {"pid": me.pid, "create_time": me.create_time(), "cmdline": me.cmdline(),
              "server_pid": parent.pid if parent else None,
              "server_create_time": parent.create_time() if parent else None}
    directory = Path(workspace) / WORKERS_DIR
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        descriptor = os.open(directory / str(me.pid), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as f:
            json.dump(record, f)
    except OSError:  # a worker that cannot record itself still validates; it still follows its parent
        log.exception("could not record validation worker %s under %s", me.pid, directory)


def _runs(pid: int | None, create_time: float | None) -> psutil.Process | None:
    """The process ``pid`` if it runs and started at ``create_time`` (None: whenever); None otherwise."""
    if pid is None:
        return None
    try:
        process = psutil.Process(pid)
        if create_time in (None, process.create_time()) and process.status() != psutil.STATUS_ZOMBIE:
            return process
    except psutil.Error:
        pass
    return None


def _parent_and_grandparent(process: psutil.Process) -> set[int]:
    """The pids of ``process``'s parent and of its parent's parent (a fork server's worker's server)."""
    parent = process.parent()
    grandparent = parent.parent() if parent is not None else None
    return {p.pid for p in (parent, grandparent) if p is not None}


def end_leftovers(workspace: Path, *, grace_s: float = 5.0) -> list[int]:
    """End the recorded workers whose server is gone (see the module docstring); the pids ended."""
    directory = Path(workspace) / WORKERS_DIR
    ended: list[int] = []
    for path in sorted(directory.glob("*")) if directory.is_dir() else []:
        try:
            record = json.loads(path.read_text())
            worker = _runs(record["pid"], record["create_time"])
            if worker is not None and worker.cmdline() != record["cmdline"]:
                worker = None  # the same pid and start time under another command line: not ours
        except (OSError, ValueError, KeyError, TypeError, psutil.Error):
            worker = None
        if worker is None:  # gone, or not ours: a stale record
            path.unlink(missing_ok=True)
            continue
        if not any(mark in word for word in record["cmdline"] for mark in WORKER_MARKS):
            continue  # a record we did not write: leave the process alone
        server = _runs(record.get("server_pid"), record.get("server_create_time"))
        try:
            if server is not None and server.pid in _parent_and_grandparent(worker):
                continue  # a live server's worker (several servers may share a workspace)
            worker.kill()
            try:
                worker.wait(timeout=grace_s)
            except psutil.TimeoutExpired:  # an orphan's reaper is not us: a zombie has ended all the same
                if worker.status() != psutil.STATUS_ZOMBIE:
                    raise
        except psutil.NoSuchProcess:
            pass
        except psutil.Error:
            log.exception("could not end validation worker %s left by a previous server", record["pid"])
            continue
        log.warning("ended validation worker %s left by a previous server (pid %s)", record["pid"],
                    record.get("server_pid"))
        ended.append(record["pid"])
        path.unlink(missing_ok=True)
    return ended
