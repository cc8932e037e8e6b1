"""``python -m trainer`` says at once that it started: its first line comes before Hydra, pydantic or
torch is imported (seconds of imports, tens of seconds on a busy host, used to pass in silence).
Python's ``-X importtime`` writes a line to stderr as each import ends, in order with the
trainer's own stderr, so the lines before the trainer's first one are the imports it waited for.

    python -m pytest -q tests/e2e/test_cli_first_line.py
"""

from __future__ import annotations

import os
import subprocess
import sys

from timing import Deadline
from trainer.__main__ import FIRST_LINE

HEAVY = ("torch", "hydra", "omegaconf", "pydantic", "mlflow", "numpy", "parallel")


def test_first_line_comes_before_the_heavy_imports(tmp_path):
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "trainer", "validate_only=true"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    before: list[str] = []
    deadline = Deadline(120)
    try:
        for line in proc.stderr:  # each line is an event: no polling
            if line.rstrip("\n") == FIRST_LINE or deadline.expired():
                break
            before.append(line)
        else:
            raise AssertionError("the trainer ended without its first line:\n" + "".join(before))
    finally:
        proc.kill()
        proc.wait()
    imported = {line.rsplit("|", 1)[-1].strip() for line in before if line.startswith("import time:")}
    assert imported and "trainer" in imported, before  # the importtime lines came, the package itself among them
    assert not {name for name in imported if name.split(".")[0] in HEAVY}, sorted(imported)
