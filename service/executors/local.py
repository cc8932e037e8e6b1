"""The default executor: a job is a detached process group on the control plane's own host.

The job runs as ``python -m service.supervise <workdir>/exit_code -- python -m trainer.launch
<workdir>/job.json`` (see :mod:`service.runner`); its ref is ``"<pid>:<start time>"``, the
process-group leader's pid and its start time (a recycled pid has another one). The exit code
comes from the ``exit_code`` file the supervisor writes, so a job started by an earlier server
(not our child, no ``waitpid``) still ends with its real code.
"""

from __future__ import annotations

import signal
import subprocess
from typing import ClassVar

from service import runner
from service.executors.base import Executor, JobLaunch, JobStatus
from service.settings import Settings

VANISHED = "process vanished while the control plane was down"


def make_ref(pid: int, start_time: int | None) -> str:
    return f"{pid}:{start_time or 0}"


def parse_ref(ref: str) -> tuple[int, int | None]:
    """``(pid, start time)`` of a local ref; a start time of 0 means "unknown" (any process with that pid)."""
    pid, _, start = ref.partition(":")
    return int(pid), (int(start) or None) if start else None


class LocalExecutor(Executor):
    """Jobs as process groups on this host, supervised by :mod:`service.supervise`."""

    name: ClassVar[str] = "local"

    def __init__(self, *, niceness: int = 0) -> None:
        self.niceness = niceness  # how far below the server's CPU priority jobs run
        self._children: dict[str, subprocess.Popen] = {}  # ref -> the Popen of a job this server started

    @classmethod
    def from_settings(cls, settings: Settings) -> LocalExecutor:
        return cls(niceness=settings.job_nice)  # the job environment comes with each JobLaunch

    def start(self, launch: JobLaunch) -> str:
        started = runner.start_job_process(launch.workdir, launch.config, launch.env, niceness=self.niceness,
                                           resolved_plan=launch.resolved_plan)
        ref = make_ref(started.pid, started.start_time)
        self._children[ref] = started.process
        return ref

    def poll(self, ref: str, launch: JobLaunch) -> JobStatus:
        pid, start_time = parse_ref(ref)
        child = self._children.get(ref)
        if child is not None:
            code = child.poll()
            alive = code is None
            if code is not None and code < 0:
                code = 128 - code
        else:  # started by an earlier server: /proc says whether it still runs
            alive, code = runner.is_same_process_alive(pid, start_time), None
        if alive:
            return JobStatus(alive=True)
        self._children.pop(ref, None)
        recorded = runner.read_exit_code(launch.workdir)
        code = recorded if recorded is not None else code
        # Workers the supervisor left behind (it was SIGKILLed) go with their group.
        runner.signal_group(pid, signal.SIGKILL)
        return JobStatus(alive=False, exit_code=code, reason=None if code is not None else VANISHED)

    def stop(self, ref: str, *, force: bool = False) -> None:
        pid, start_time = parse_ref(ref)
        if self._children.get(ref) is not None or runner.is_same_process_alive(pid, start_time):
            runner.signal_group(pid, signal.SIGKILL if force else signal.SIGTERM)

    def adopt(self, launch: JobLaunch) -> str | None:
        pid = runner.find_job_process(launch.workdir)
        return make_ref(pid, runner.process_start_time(pid)) if pid is not None else None
