"""Run a command a message printed, as a user types it: ``NAME=value ... program args`` (the
assignments set for that command only), the program found on PATH or beside this Python (the
venv's own console scripts when its bin/ is not on PATH)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from timing import scaled


def run_typed(command: str, *, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """``command`` run as typed in a shell; its output captured as text."""
    words = shlex.split(command)
    env = dict(os.environ)
    while words and "=" in words[0] and words[0].split("=", 1)[0].isidentifier():
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    program, *args = words
    found = shutil.which(program) or str(Path(sys.executable).parent / program)
    return subprocess.run([found, *args], env=env, capture_output=True, text=True, timeout=scaled(timeout_s))
