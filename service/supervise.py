"""``python -m service.supervise [--nice N] <exit-code-file> -- <command...>``: run a job's command, record its exit
code.

The control plane starts every job through this tiny supervisor (stdlib only, ~30 ms) so that
a job's exit status outlives the control plane: a restarted server is not the parent of a job
started before the restart and cannot ``waitpid`` it, but it can read the file written here.

The supervisor shares the job's process group: the service signals the group, the trainer gets
SIGTERM and ends its MLflow run KILLED, the supervisor ignores SIGTERM/SIGINT and waits for it.

``--nice N`` lowers the job's CPU priority by N before anything else runs (the supervisor's own,
which the trainer and its workers inherit): the control plane on the same host stays responsive
while a job's processes start and train (see ``MESHFLOW_JOB_NICE``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def write_exit_code(path: Path, code: int) -> None:
    """Write atomically: a reader sees no file or the whole number."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{code}\n")
    os.replace(tmp, path)


USAGE = "usage: python -m service.supervise [--nice N] <exit-code-file> -- <command...>"


def main(argv: list[str]) -> int:
    niceness = 0
    if argv[:1] == ["--nice"]:
        try:
            niceness = int(argv[1])
        except (IndexError, ValueError):
            print(USAGE, file=sys.stderr)
            return 2
        argv = argv[2:]
    if len(argv) < 3 or argv[1] != "--":
        print(USAGE, file=sys.stderr)
        return 2
    exit_file, command = Path(argv[0]), argv[2:]
    if niceness:
        lower_priority(niceness)  # before the job's first process: every process of the job inherits it
    # The whole process group receives the service's SIGTERM; the child handles it, we wait.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    child = subprocess.Popen(command, restore_signals=True, preexec_fn=_default_signals)
    code = child.wait()
    code = 128 - code if code < 0 else code  # death by signal N -> 128 + N, as a shell reports it
    write_exit_code(exit_file, code)
    return code


def lower_priority(niceness: int) -> None:
    """Run this process, and the children it starts, ``niceness`` steps below its CPU priority.

    With autogroups (Linux's default for desktops and many servers: ``/proc/sys/kernel/
    sched_autogroup_enabled``), a nice value weighs only against processes of the same session,
    and the job has a session of its own: so when this process leads its session, the session's
    autogroup gets the same nice value, which is what weighs against the server's session.
    """
    os.nice(niceness)
    if os.getsid(0) != os.getpid():  # not our own session: its autogroup is not only the job's
        return
    try:
        Path("/proc/self/autogroup").write_text(f"{niceness}\n")
    except OSError:  # no autogroups (kernel option off, or not Linux): the nice value alone counts
        pass


def _default_signals() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
