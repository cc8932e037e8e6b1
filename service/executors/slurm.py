"""Jobs as Slurm jobs: each job is one sbatch job, its script written from the job's resolved config.

    MESHFLOW_EXECUTOR=slurm python -m api          # on a host with Slurm's client commands (sbatch, squeue ...)

The script is the one ``python -m trainer ... launch.executor=slurm`` writes (:mod:`trainer.launch.slurm`):
one ``python -m trainer.launch job.json`` per node of the allocation (``launch.nnodes``), the job's own
``launch.slurm`` section for the partition, time limit and the rest, the warning before the time limit
checkpointing and requeueing it. Here it runs in the job's directory (``--chdir``) and Slurm writes the
job's output straight into its ``job.log``, which the control plane streams; that directory (the
workspace) must be on a file system the nodes share. The ref kept in the job row is Slurm's job id; the
job is named ``meshflow-<job id>``, so a job submitted just before a crash is found again by that name.
A job sent over REST may not add ``#SBATCH`` lines (``launch.slurm.extra``): they could point its output
or working directory outside its workdir.
States both ways: pending and running (a requeued job too) are alive; an ended job's exit code is
:func:`trainer.launch.slurm_job.exit_code`'s, and its ``reason`` names Slurm's state and reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import ClassVar

from service import runner
from service.executors.base import Executor, JobLaunch, JobStatus
from service.settings import Settings
from trainer.config.schema import RunConfig
from trainer.launch.slurm import render_script
from trainer.launch.slurm_job import ENDED, cancel, exit_code, job_state, slurm_command, submit

SCRIPT_NAME = "job.sbatch"
CLIENT_ENV = ("SLURM_CONF",)  # where the client commands find the cluster, when not in /etc/slurm


def job_name(job_id: str) -> str:
    return f"meshflow-{job_id}"


class SlurmExecutor(Executor):
    """Start, watch and stop jobs through Slurm's client commands on this host."""

    name: ClassVar[str] = "slurm"

    @classmethod
    def from_settings(cls, settings: Settings) -> SlurmExecutor:
        return cls()

    def start(self, launch: JobLaunch) -> str:
        cfg = RunConfig.model_validate(launch.config)
        if cfg.launch.slurm.extra:  # e.g. --output=/anywhere or --chdir: out of the job's workspace
            raise ValueError(f"launch.slurm.extra={cfg.launch.slurm.extra}: a control-plane job cannot add sbatch "
                             "options (they may name paths outside its workdir); leave it out, e.g. "
                             "launch.slurm.extra=[], and use launch.slurm's own keys (partition, time, ...)")
        workdir = launch.workdir
        workdir.mkdir(mode=runner.DIR_MODE, parents=True, exist_ok=True)
        runner.write_job_config(workdir, launch.config, launch.resolved_plan)
        named = cfg.launch.slurm.model_copy(update={"job_name": job_name(launch.job_id)})
        cfg = cfg.model_copy(update={"launch": cfg.launch.model_copy(update={"slurm": named})})
        script = workdir / SCRIPT_NAME
        script.write_text(render_script(cfg, folder=workdir, workdir=workdir, python=sys.executable,
                                        config_file=runner.JOB_CONFIG_NAME, output_file=runner.LOG_NAME))
        env = {**runner.job_environment(launch.env),
               **{name: os.environ[name] for name in CLIENT_ENV if name in os.environ}}
        return submit(script, cwd=workdir, env=env)

    def poll(self, ref: str, launch: JobLaunch) -> JobStatus:
        state = job_state(ref)
        if state is None:
            return JobStatus(alive=False, reason=f"slurm job {ref}: Slurm no longer knows it (no accounting kept)")
        if not state.ended:
            return JobStatus(alive=True)
        code = exit_code(state)
        if state.state == "COMPLETED" and code == 0:
            return JobStatus(alive=False, exit_code=0)
        why = f" ({state.reason})" if state.reason and state.reason != "None" else ""
        return JobStatus(alive=False, exit_code=code,
                         reason=f"slurm job {ref} {ENDED.get(state.state, state.state)}: {state.state}{why}")

    def stop(self, ref: str, *, force: bool = False) -> None:
        """``scancel``: Slurm sends every process of the job SIGTERM, then SIGKILL after its KillWait."""
        cancel(ref)

    def adopt(self, launch: JobLaunch) -> str | None:
        words = [slurm_command("squeue"), "--noheader", "--format=%i", f"--name={job_name(launch.job_id)}"]
        done = subprocess.run(words, capture_output=True, text=True, timeout=60)
        ids = done.stdout.split() if done.returncode == 0 else []
        return ids[0] if ids else None
