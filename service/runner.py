"""Start, watch and stop one job's processes: detached from the server, found again after a restart.

A job runs as ``python -m service.supervise <workdir>/exit_code -- python -m trainer.launch
<workdir>/job.json`` in a new session (its own process group, pgid = pid), cwd = its workdir,
stdout and stderr to ``<workdir>/job.log``. ``job.json`` is the config the server resolved and
validated at submit, exactly as stored: the job reads it back into the same pydantic model and
launches, with no second composition or validation. The pid and the process start time (field
22 of ``/proc/<pid>/stat``) identify the process; a recycled pid has another start time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

JOB_CONFIG_NAME = "job.json"
LOG_NAME = "job.log"
EXIT_CODE_NAME = "exit_code"


@dataclass
class Started:
    pid: int
    start_time: int
    process: subprocess.Popen


def write_job_config(workdir: Path, config: dict[str, Any]) -> Path:
    """``<workdir>/job.json``: the resolved, validated config (``RunConfig.model_dump(mode="json")``)."""
    path = workdir / JOB_CONFIG_NAME
    path.write_text(json.dumps(config, indent=2))
    return path


def trainer_command(workdir: Path) -> list[str]:
    return [sys.executable, "-m", "trainer.launch", str(workdir / JOB_CONFIG_NAME)]


def start_job_process(workdir: Path, config: dict[str, Any]) -> Started:
    """Write the config and start the job detached; return its pid and start time."""
    workdir.mkdir(parents=True, exist_ok=True)
    write_job_config(workdir, config)
    (workdir / EXIT_CODE_NAME).unlink(missing_ok=True)
    command = [sys.executable, "-m", "service.supervise", str(workdir / EXIT_CODE_NAME), "--", *trainer_command(workdir)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(workdir / LOG_NAME, "ab") as log_file:
        process = subprocess.Popen(command, cwd=workdir, stdin=subprocess.DEVNULL, stdout=log_file,
                                   stderr=subprocess.STDOUT, start_new_session=True, env=env, close_fds=True)
    return Started(process.pid, process_start_time(process.pid) or 0, process)


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (state first), or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return stat[stat.rindex(")") + 2:].split()  # the command name may contain spaces and parens


def process_start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks after boot), or None if there is no such process."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None  # fields[0] is field 3 (state)


def is_same_process_alive(pid: int, start_time: int | None) -> bool:
    """Whether ``pid`` is still the process we started (same start time) and not a zombie."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return start_time is None or int(fields[19]) == start_time


def find_job_process(workdir: Path) -> int | None:
    """The process-group leader running in ``workdir``: a job started just before a crash, pid unrecorded."""
    target = os.path.realpath(workdir)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            if os.readlink(entry / "cwd") == target and os.getpgid(pid) == pid and is_same_process_alive(pid, None):
                return pid
        except (OSError, ProcessLookupError):
            continue
    return None


def signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to the job's process group; False if the group no longer exists."""
    if pgid <= 1 or pgid == os.getpgrp():  # never init's group or our own, whatever the store says
        return False
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # pgid recycled by someone else's process: not ours to signal
        return False


def read_exit_code(workdir: Path) -> int | None:
    try:
        return int((workdir / EXIT_CODE_NAME).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def log_tail(workdir: Path, lines: int) -> str:
    """The last ``lines`` lines of the job's log (the error summary of a failed job)."""
    try:
        with open(workdir / LOG_NAME, errors="replace") as f:
            return "".join(deque(f, maxlen=lines)).strip()
    except FileNotFoundError:
        return ""
