"""The validation pool's workers leave with the server that spawned them, even when it is killed
with SIGKILL and cannot stop them (issue: each one held torch and hundreds of MB, reparented)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

SERVER = textwrap.dedent("""
    import sys
    from service.settings import Settings
    from service.validation import Validator

    validator = Validator(Settings(workspace=sys.argv[1]), workers=2)
    validator.start()
    validator.wait_warm()
    print(" ".join(map(str, validator.worker_pids())), flush=True)
    sys.stdin.read()  # until killed
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited; only its entry waits for a reaper
        return f.read().split(")")[-1].split()[0] != "Z"


def test_workers_leave_when_the_server_is_killed(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # Each worker looks for its parent once a second; a generous bound for a loaded machine.
    for _ in range(600):
        if not any(_alive(p) for p in pids):
            break
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), pids
