"""A submitted Slurm job: its state as Slurm reports it, its output followed, its end as an exit code.

    job_id = submit(script)                      # sbatch --parsable
    state = job_state(job_id)                    # scontrol show job (sacct once scontrol forgot it)
    code = follow(job_id, output, out=sys.stdout)  # prints the output as it grows; the job's exit code
    cancel(job_id)                               # scancel

Slurm's states, grouped the way the CLI and the control plane act on them: :data:`WAITING` (the job will
run, or runs again after a requeue), :data:`RUNNING`, and the ends, each with the exit code the CLI
exits with (:func:`exit_code`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from trainer.launch.outcome import EXIT_SIGTERM  # a cancelled job exits as a stopped local run does

WAITING = frozenset({"PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "CONFIGURING", "SUSPENDED", "RESV_DEL_HOLD",
                     "SPECIAL_EXIT", "STOPPED", "RESIZING", "SIGNALING", "STAGE_OUT", "POWER_UP_NODE"})
RUNNING = frozenset({"RUNNING", "COMPLETING"})
# how a job ended -> what it means for a run (CANCELLED is a stop, as a local run's SIGTERM)
ENDED = {"COMPLETED": "completed", "FAILED": "failed", "CANCELLED": "cancelled", "TIMEOUT": "timed out",
         "PREEMPTED": "preempted", "NODE_FAIL": "lost a node", "OUT_OF_MEMORY": "ran out of memory",
         "BOOT_FAIL": "could not boot its nodes", "DEADLINE": "missed its deadline"}


class SlurmError(RuntimeError):
    """A Slurm command failed or is missing; the message names the command and what it said."""


@dataclass(frozen=True)
class SlurmState:
    """One look at a job: its state, Slurm's reason, its exit code once it ended, restarts (requeues) so far."""

    state: str
    reason: str | None = None
    exit_code: int | None = None
    restarts: int = 0
    nodes: str | None = None

    @property
    def ended(self) -> bool:
        return self.state not in WAITING | RUNNING

    def describe(self, job_id: str) -> str:
        """The console's line for it: ``slurm job 12: PENDING (Resources)``."""
        why = f" ({self.reason})" if self.reason and self.reason != "None" else ""
        where = f" on {self.nodes}" if self.state == "RUNNING" and self.nodes else ""
        again = f", restart {self.restarts}" if self.restarts else ""
        return f"slurm job {job_id}: {self.state}{where}{why}{again}"


def slurm_command(name: str) -> str:
    """The path of Slurm's client command ``name``; a :class:`SlurmError` saying how to install it when missing."""
    path = shutil.which(name)
    if path is None:
        raise SlurmError(f"launch.executor: slurm: {name} is not on PATH (Slurm's client commands are needed where "
                         "python -m trainer runs); install them (Debian: apt-get install slurm-client) or use "
                         "launch.executor=local")
    return path


def _run(*words: str, timeout: float = 60, cwd: Path | None = None,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([slurm_command(words[0]), *words[1:]], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=env)


def submit(script: Path, *, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    """``sbatch --parsable script`` (in ``cwd`` with ``env``, else this process's): the job id (without the
    cluster name a federation adds)."""
    done = _run("sbatch", "--parsable", str(script), cwd=cwd, env=env)
    if done.returncode != 0:
        said = done.stderr.strip() or done.stdout.strip()
        raise SlurmError(f"sbatch {script} failed (exit {done.returncode}): {said}")
    return done.stdout.strip().split(";")[0]


def cancel(job_id: str, *, signal: str | None = None) -> None:
    """``scancel`` the job (``signal``: send that signal instead, e.g. ``USR1`` to the batch shell)."""
    words = ["scancel", *([f"--signal={signal}", "--batch"] if signal else []), job_id]
    done = _run(*words)
    if done.returncode != 0:
        raise SlurmError(f"{' '.join(words)} failed (exit {done.returncode}): {done.stderr.strip()}")


def job_state(job_id: str) -> SlurmState | None:
    """The job's state from ``scontrol show job``, else from accounting (``sacct``, once the controller has
    forgotten an ended job); None when neither knows it."""
    done = _run("scontrol", "show", "job", "--oneliner", job_id)
    if done.returncode == 0 and done.stdout.strip():
        fields = dict(re.findall(r"(\w+)=(\S*)", done.stdout))
        return SlurmState(state=fields.get("JobState", "UNKNOWN"), reason=fields.get("Reason"),
                          exit_code=_exit_code(fields.get("ExitCode")), restarts=int(fields.get("Restarts", 0) or 0),
                          nodes=fields.get("NodeList") or None)
    if shutil.which("sacct") is None:
        return None
    done = _run("sacct", "--noheader", "--allocations", "--parsable2", "--jobs", job_id,
                "--format", "State,ExitCode,Reason")
    rows = [line.split("|") for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []
    if not rows:
        return None
    state, code, reason = (rows[-1] + ["", "", ""])[:3]
    return SlurmState(state=state.split()[0], reason=reason or None, exit_code=_exit_code(code))


def _exit_code(field: str | None) -> int | None:
    """Slurm's ``ExitCode=<code>:<signal>`` as a shell's exit code (128 + the signal when one ended it)."""
    if not field or ":" not in field:
        return None
    code, signal = (int(part) for part in field.split(":")[:2])
    return 128 + signal if signal else code


def exit_code(state: SlurmState) -> int:
    """The code the CLI exits with for an ended job: the job's own on COMPLETED / FAILED; 143 when it was
    cancelled (as a stopped local run); 1 for every other end (timed out, preempted, a node failed)."""
    if state.state == "CANCELLED":
        return EXIT_SIGTERM
    if state.state in ("COMPLETED", "FAILED"):
        return state.exit_code if state.exit_code else (0 if state.state == "COMPLETED" else 1)
    return 1


class OutputTail:
    """The new text of a file that grows (Slurm's output file; it appears when the job starts)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def read(self) -> str:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return ""
        cut = data.rfind(b"\n") + 1  # whole lines only: a line being written comes whole with the next read
        self.offset += cut
        return data[:cut].decode(errors="replace")

    def rest(self) -> str:
        """Everything not read yet, a last line without its newline too."""
        text = self.read()
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return text
        self.offset += len(data)
        return text + data.decode(errors="replace")


def follow(job_id: str, output: Path, *, out: TextIO = sys.stdout, poll_s: float = 1.0) -> SlurmState:
    """Print the job's output as it grows and each change of its state, until it has ended (a requeued job
    is followed through its next allocation: the output file is appended to); return its last state."""
    tail, shown = OutputTail(output), None
    while True:
        state = job_state(job_id)
        if state is None:  # purged before we saw its end (MinJobAge), and no accounting to ask
            state = SlurmState(state="UNKNOWN", reason="Slurm no longer knows the job and keeps no accounting")
        text = tail.read()
        if text:
            out.write(text)
            out.flush()
        line = state.describe(job_id)
        if line != shown:
            print(line, file=out, flush=True)
            shown = line
        if state.ended:
            time.sleep(poll_s)  # the last lines reach a shared file system after the state changes
            out.write(tail.rest())
            out.flush()
            return state
        time.sleep(poll_s)
