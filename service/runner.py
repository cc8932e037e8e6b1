"""Start, watch and stop one job's processes: detached from the server, found again after a restart.

A job runs as ``python -m service.supervise [--nice N] <workdir>/exit_code -- python -m trainer.launch
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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.tracking.credentials import TRACKING_URI_ENV, has_credentials

JOB_CONFIG_NAME = "job.json"
# beside job.json: the plan resolved at submission, which the launcher reads instead of resolving it again
# (trainer.launch.elastic.PLAN_FILE; not imported from there: the server does not import torch's launcher)
PLAN_NAME = "resolved_plan.json"
LOG_NAME = "job.log"
EXIT_CODE_NAME = "exit_code"


@dataclass
class Started:
    pid: int
    start_time: int
    process: subprocess.Popen


# The environment a job starts with: these names of the server's own, nothing else; exact names, no
# prefixes (a prefix such as TORCH* lets in whatever variable the host happens to have, e.g. one that
# points torch at a file to load). Never MESHFLOW_* (users' tokens, the database URL) or any other
# secret the server was given; the tracking store's credentials are added by name (scheduler.launch_of).
# This host's, not the job's: a Ray node or a job pod has its own.
HOST_ENV_NAMES = frozenset({"PATH", "HOME", "USER", "LOGNAME", "SHELL", "TMPDIR", "TEMP", "TMP", "VIRTUAL_ENV"})
ENV_NAMES = HOST_ENV_NAMES | frozenset({
    "PYTHONPATH", "LD_LIBRARY_PATH", "CXX", "CC", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "PYTHONHASHSEED",
    "MESHFLOW_CACHE_DIR",  # where the trainer keeps its calibration
    # threads of the CPU math libraries
    "OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "KMP_AFFINITY",
    "KMP_BLOCKTIME",
    # devices and collectives: which GPUs, which network interface, how much to say
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_HOME", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES",
    "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_IB_HCA", "NCCL_P2P_DISABLE", "NCCL_NET_GDR_LEVEL",
    "GLOO_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT", "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
    # nothing downloaded
    "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE",
})
FILE_MODE, DIR_MODE = 0o600, 0o700


def job_environment(extra: Mapping[str, str] | None = None, source: Mapping[str, str] | None = None, *,
                    tracking_uri: str | None = None) -> dict[str, str]:
    """The allow-listed part of ``source`` (default: this process's environment) and ``extra``
    (the service's ``job_env`` setting), with unbuffered Python output; and ``$MLFLOW_TRACKING_URI``,
    the tracking store with its credentials, when ``tracking_uri`` has any (the job's config names the
    store without them: trainer.tracking.credentials)."""
    source = os.environ if source is None else source
    env = {k: v for k, v in source.items() if k in ENV_NAMES}
    if tracking_uri is not None and has_credentials(tracking_uri):
        env[TRACKING_URI_ENV] = tracking_uri
    return {**env, **(extra or {}), "PYTHONUNBUFFERED": "1"}


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to a file only its owner reads (mode 600, whatever the umask)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    os.fchmod(fd, FILE_MODE)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def write_job_config(workdir: Path, config: dict[str, Any], resolved_plan: dict[str, Any] | None = None) -> Path:
    """``<workdir>/job.json``: the resolved, validated config (``RunConfig.model_dump(mode="json")``), and its
    plan as resolved at submission (``ResolvedPlan.to_dict()``) in ``resolved_plan.json`` beside it; without
    one, no plan file is left there (the launcher resolves it)."""
    path = workdir / JOB_CONFIG_NAME
    write_private(path, json.dumps(config, indent=2))
    if resolved_plan is not None:
        write_private(workdir / PLAN_NAME, json.dumps(resolved_plan))
    else:
        (workdir / PLAN_NAME).unlink(missing_ok=True)
    return path


def trainer_command(workdir: Path) -> list[str]:
    return [sys.executable, "-m", "trainer.launch", str(workdir / JOB_CONFIG_NAME)]


def start_job_process(workdir: Path, config: dict[str, Any], extra_env: dict[str, str] | None = None,
                      *, niceness: int = 0, resolved_plan: dict[str, Any] | None = None) -> Started:
    """Write the config (and its resolved plan: :func:`write_job_config`) and start the job detached, with the
    allow-listed environment and a umask that keeps everything it writes private (files 600, dirs 700),
    ``niceness`` below the server's CPU priority; return its pid and start time."""
    workdir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    workdir.chmod(DIR_MODE)
    write_job_config(workdir, config, resolved_plan)
    (workdir / EXIT_CODE_NAME).unlink(missing_ok=True)
    command = [sys.executable, "-m", "service.supervise", *(["--nice", str(niceness)] if niceness else []),
               str(workdir / EXIT_CODE_NAME), "--", *trainer_command(workdir)]
    fd = os.open(workdir / LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND, FILE_MODE)
    with os.fdopen(fd, "ab") as log_file:
        process = subprocess.Popen(command, cwd=workdir, stdin=subprocess.DEVNULL, stdout=log_file,
                                   stderr=subprocess.STDOUT, start_new_session=True, env=job_environment(extra_env),
                                   close_fds=True, umask=0o077)
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
