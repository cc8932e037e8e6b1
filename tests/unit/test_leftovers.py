"""A restarted server ends the validation workers a killed one left running, and nothing else
(service.leftovers): not another live server's workers, not an unrelated process under a forged record.

    python -m pytest tests/unit/test_leftovers.py -q
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from service.leftovers import WORKERS_DIR, end_leftovers

# A server whose pool worker (spawned, or forked by the server's fork server as service.fork_server's
# are) records itself, as service.validation's do, but does not follow its server: the worker a
# server's death leaves running (a watcher that could not run, say).
_SERVER = textwrap.dedent("""
    import multiprocessing, os, sys
    from concurrent.futures import ProcessPoolExecutor
    from service.leftovers import record_worker

    if __name__ == "__main__":
        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context(sys.argv[2]), initializer=record_worker,
                                   initargs=(sys.argv[1], os.getpid()))
        print(pool.submit(os.getpid).result(), flush=True)
        sys.stdin.read()  # until killed
""")


@pytest.fixture(params=["spawn", "forkserver"])
def start_method(request) -> str:
    return request.param


def _server(workspace, start_method: str) -> tuple[subprocess.Popen, int]:
    script = workspace.parent / f"server_{start_method}.py"  # a fork server's child imports __main__ from a file
    script.write_text(_SERVER)
    proc = subprocess.Popen([sys.executable, str(script), str(workspace), start_method], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def processes():
    started: list[subprocess.Popen | int] = []
    yield started
    for proc in started:  # whatever a failed test left: by pid, only what this test started
        try:
            (proc if isinstance(proc, subprocess.Popen) else psutil.Process(proc)).kill()
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass


def test_a_restarted_server_ends_the_workers_a_killed_one_left(tmp_path, processes, start_method):
    dead, orphan = _server(tmp_path, start_method)
    live, kept = _server(tmp_path, start_method)  # another server on the same workspace, still running
    processes += [dead, live, orphan, kept]
    # An unrelated process, orphaned too, under a record that claims it is a worker of the dead server.
    sleeper = subprocess.Popen(["sleep", "600"])
    processes.append(sleeper)
    forged = json.loads((tmp_path / WORKERS_DIR / str(orphan)).read_text())
    forged.update(pid=sleeper.pid, create_time=psutil.Process(sleeper.pid).create_time())
    (tmp_path / WORKERS_DIR / str(sleeper.pid)).write_text(json.dumps(forged))
    (tmp_path / WORKERS_DIR / "999999999").write_text(json.dumps({**forged, "pid": 999999999}))  # long gone

    dead.send_signal(signal.SIGKILL)
    dead.wait()
    time.sleep(0.1)
    assert _alive(orphan) and psutil.Process(orphan).ppid() != dead.pid  # left running, reparented

    assert end_leftovers(tmp_path) == [orphan]
    assert not _alive(orphan)
    assert _alive(kept) and _alive(sleeper.pid)  # a live server's worker; a process that is not ours
    assert sorted(p.name for p in (tmp_path / WORKERS_DIR).iterdir()) == [str(kept)]
    assert end_leftovers(tmp_path) == []  # nothing left to end, the live worker still kept
    assert _alive(kept)
