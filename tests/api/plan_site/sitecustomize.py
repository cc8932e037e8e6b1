"""Counting in every process of a control-plane job (tests/api/test_job_plan.py puts this folder on PYTHONPATH).

Python imports ``sitecustomize`` at the start of every interpreter: the server, its validation pool's workers,
the job's supervisor, its launcher and its workers' fork server (whose forked workers inherit the counting).
With ``$MESHFLOW_TEST_PLAN_COUNTS`` set, each counts its plan resolutions and meta-model builds as
tests/dist/plan_counts.py does, and writes its command line to ``<that folder>.cmdlines/<pid>`` so the test
tells the job's launcher from the rest. Without the variable it does nothing.
"""

import os
import sys
from pathlib import Path

_FOLDER = os.environ.get("MESHFLOW_TEST_PLAN_COUNTS")


def _note_cmdline() -> None:
    cmdlines = Path(f"{_FOLDER}.cmdlines")
    cmdlines.mkdir(exist_ok=True)
    command = Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    (cmdlines / str(os.getpid())).write_text(command)


if _FOLDER:
    _note_cmdline()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dist"))
    import plan_counts  # noqa: E402,F401 - counts from here on (it installs itself when the variable is set)
