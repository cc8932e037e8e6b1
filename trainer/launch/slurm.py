"""A run as a Slurm job: the sbatch script written from the config, submitted, and followed to its end.

    python -m trainer +parallel=fsdp mesh=[2] launch.executor=slurm launch.slurm.partition=debug
    python -m trainer +parallel=fsdp mesh=[2] launch.executor=slurm dry_run=true   # prints the script only

The job runs one task per node (``srun --ntasks-per-node=1``): on each, ``python -m trainer.launch`` starts
that node's workers through torch's elastic launcher, as a local run does, node ranks from ``SLURM_NODEID``
and the rendezvous on the first node of the allocation (``scontrol show hostnames``). The resolved config
and plan travel as files beside the script (``job.sbatch``, ``config.json``, ``resolved_plan.json``) in a
folder under ``launch.log_dir``, where Slurm writes the job's output (``slurm-<job id>.out``) too. The job
inherits this command's environment (sbatch's ``--export=ALL``) and working directory (``--chdir``), so
relative paths and the MLflow store are the ones a local run would use.

Before the time limit or at a preemption's notice Slurm sends the batch shell ``USR1``
(``launch.slurm.signal_before_end_s``); the script passes it on to the launchers, the run saves a
checkpoint and exits with :data:`EXIT_REQUEUE`, and the script requeues the job, which resumes from that
checkpoint (``--resume auto`` on a restart).
"""

from __future__ import annotations

import os
import shlex
import sys
import time
import uuid
from pathlib import Path

from trainer.config.schema import RunConfig
from trainer.run.stop_request import EXIT_REQUEUE, REQUEUE_DIR_ENV, RUN_ID_FILE, STOP_FILE
from trainer.tracking.run_info import run_name

SCRIPT_FILE, CONFIG_FILE = "job.sbatch", "config.json"
OUTPUT_PATTERN = "slurm-%j.out"  # Slurm puts the job id in place of %j


def job_dir(cfg: RunConfig) -> Path:
    """A fresh folder for one submission: ``<launch.log_dir>/<run name>-slurm-<time>-<random>``, absolute
    (the script names its files by absolute path: the nodes may start elsewhere)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return (Path(cfg.launch.log_dir or "logs") / f"{run_name(cfg)}-slurm-{stamp}-{uuid.uuid4().hex[:4]}").resolve()


def output_path(folder: Path, job_id: str) -> Path:
    """Where Slurm writes the job's output (both streams) for job ``job_id``."""
    return folder / OUTPUT_PATTERN.replace("%j", job_id)


def sbatch_options(cfg: RunConfig, *, folder: Path, workdir: Path, output_file: str = OUTPUT_PATTERN) -> list[str]:
    """The script's ``#SBATCH`` options, in order: the allocation, then the limits, then where it runs and writes."""
    s, nnodes = cfg.launch.slurm, cfg.launch.nnodes
    options = [f"--job-name={s.job_name or run_name(cfg)}", f"--nodes={nnodes}", "--ntasks-per-node=1"]
    chosen = [("--cpus-per-task", s.cpus_per_task), ("--gpus-per-node", s.gpus_per_node), ("--mem", s.mem),
              ("--time", s.time), ("--partition", s.partition), ("--account", s.account), ("--qos", s.qos)]
    options += [f"{flag}={value}" for flag, value in chosen if value is not None]
    options += [f"--chdir={workdir}", f"--output={folder / output_file}", "--open-mode=append"]
    if s.signal_before_end_s:
        options.append(f"--signal=B:USR1@{s.signal_before_end_s}")  # B: the batch shell, which passes it on
    options.append("--requeue" if s.requeue else "--no-requeue")
    return options + list(s.extra)


def launcher_command(cfg: RunConfig, *, config_path: Path, python: str = sys.executable) -> str:
    """The shell words ``srun`` runs on every node: this node's launcher of its workers."""
    words = [python, "-m", "trainer.launch", str(config_path), "--node-rank-env", "SLURM_NODEID"]
    command = " ".join(shlex.quote(w) for w in words) + ' --rdzv-id "slurm-$SLURM_JOB_ID"'
    if cfg.launch.nnodes > 1:  # one node keeps its loopback rendezvous; several meet on the first one
        command += f' --rdzv-endpoint "$head_node:{cfg.launch.slurm.rdzv_port}"'
    return command + ' "${resume[@]}"'


def render_script(cfg: RunConfig, *, folder: Path, workdir: Path, python: str = sys.executable,
                  config_file: str = CONFIG_FILE, output_file: str = OUTPUT_PATTERN) -> str:
    """The sbatch script of ``cfg``'s run, its config at ``folder/config_file``, started in ``workdir``, its
    output appended to ``folder/output_file`` (the control plane: ``job.json`` and ``job.log``)."""
    script, quoted = folder / SCRIPT_FILE, shlex.quote(str(folder))
    stop, run_id = f'"${REQUEUE_DIR_ENV}/{STOP_FILE}"', f'"${REQUEUE_DIR_ENV}/{RUN_ID_FILE}"'
    lines = ["#!/bin/bash",
             f"# meshflow run {run_name(cfg)}, written by python -m trainer; submit it again with: "
             f"sbatch {shlex.quote(str(script))}"]
    lines += [f"#SBATCH {option}"
              for option in sbatch_options(cfg, folder=folder, workdir=workdir, output_file=output_file)]
    lines += [
        "",
        "set -u",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"export {REQUEUE_DIR_ENV}={quoted}  # the run stops after a step with a checkpoint once {STOP_FILE} is there",
        f"rm -f {stop}",
        "trap 'echo \"meshflow: Slurm warns of the end of job $SLURM_JOB_ID: saving a checkpoint\"; "
        f"touch {stop}' USR1",
        "resume=()  # a requeued job resumes from the checkpoint its last allocation saved, in the same MLflow run",
        'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then',
        "    resume=(--resume auto)",
        f'    if [ -s {run_id} ]; then resume+=(--run-id "$(cat {run_id})"); fi',
        "fi",
        'echo "meshflow: slurm job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NUM_NODES node(s), '
        'first $head_node"',
        "srun --ntasks-per-node=1 --kill-on-bad-exit=1 "
        f"{launcher_command(cfg, config_path=folder / config_file, python=python)} &",
        "launcher=$!",
        "# wait returns early when the trap runs: wait again until srun has ended",
        'while true; do wait "$launcher"; code=$?; kill -0 "$launcher" 2>/dev/null || break; done',
        f'if [ "$code" -eq {EXIT_REQUEUE} ]; then',
        '    echo "meshflow: checkpoint saved; requeueing job $SLURM_JOB_ID to resume from it"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"


def write_job(cfg: RunConfig, folder: Path, *, plan=None, workdir: Path | None = None) -> Path:
    """Write the script, the resolved config and (when there is one) the resolved plan into ``folder``;
    return the script's path. ``plan``: a :class:`parallel.plan.serial.ResolvedPlan`."""
    from trainer.launch.elastic import PLAN_FILE  # start-up: the elastic launcher's module, for its file name

    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(cfg.model_dump_json())
    if plan is not None:
        plan.write(folder / PLAN_FILE)
    script = folder / SCRIPT_FILE
    script.write_text(render_script(cfg, folder=folder, workdir=(workdir or Path.cwd()).resolve()))
    script.chmod(0o755)
    return script


def dry_run_script(cfg: RunConfig, folder: Path) -> str:
    """``dry_run=true launch.executor=slurm``: the script written (not submitted) under ``folder``, and the
    text to print: the script and the command that would submit it."""
    script = write_job(cfg.model_copy(update={"dry_run": False}), folder.resolve())  # the job trains
    return (f"\nslurm: the job this run would submit ({script}):\n\n{script.read_text()}\n"
            f"submit it with: sbatch {script}")


def environment_note() -> str:
    """Which Slurm the commands talk to: ``$SLURM_CONF`` when it is set (a test's own cluster)."""
    conf = os.environ.get("SLURM_CONF")
    return f" (SLURM_CONF={conf})" if conf else ""


def _wait_until_ended(job_id: str, timeout_s: float = 120) -> str:
    """Slurm's state of a cancelled job once it has ended (its processes killed), or after ``timeout_s``."""
    # start-up: the job's client (scontrol, sbatch) loads only when a job is submitted, not for a dry run's script
    from trainer.launch.slurm_job import job_state

    deadline = time.monotonic() + timeout_s
    while True:
        state = job_state(job_id)
        if state is None or state.ended or time.monotonic() > deadline:
            return state.state if state else "UNKNOWN"
        time.sleep(0.5)


def submit_and_follow(cfg: RunConfig, *, plan=None):
    """``launch.executor=slurm``: write the job beside the run's logs, submit it, print its id, follow its
    output and state to the end; the :class:`~trainer.launch.outcome.LaunchOutcome` carries the job's exit
    code. Ctrl-C or SIGTERM cancels the job (``scancel``), as they stop a local run."""
    # start-up: the job's client and the tracker's signal handling load only when a job is submitted
    # (a dry run prints the script without them)
    from trainer.launch.outcome import EXIT_CONFIG, EXIT_SIGINT, EXIT_SIGTERM, LaunchOutcome
    from trainer.launch.slurm_job import SlurmError, cancel, exit_code, follow, submit
    from trainer.tracking.tracker import Terminated, install_signal_handlers

    began = time.monotonic()
    folder = job_dir(cfg)
    try:
        script = write_job(cfg, folder, plan=plan)
        job_id = submit(script)
    except SlurmError as err:
        print(err, file=sys.stderr)
        return LaunchOutcome(EXIT_CONFIG)
    output = output_path(folder, job_id)
    print(f"slurm job {job_id} submitted{environment_note()}: script {script}, output {output}", flush=True)
    with install_signal_handlers():
        try:
            state = follow(job_id, output)
        except (KeyboardInterrupt, Terminated) as stop:
            cancel(job_id)
            ended = _wait_until_ended(job_id)  # as a local run waits for its workers to stop
            print(f"slurm job {job_id} cancelled (scancel): {ended}", file=sys.stderr, flush=True)
            return LaunchOutcome(EXIT_SIGINT if isinstance(stop, KeyboardInterrupt) else EXIT_SIGTERM,
                                 wall_s=time.monotonic() - began)
    code = exit_code(state)
    if state.state != "COMPLETED" or code:
        from trainer.launch.slurm_job import ENDED  # start-up: as above

        print(f"slurm job {job_id} {ENDED.get(state.state, state.state)} (exit code {code}); its output: {output}",
              file=sys.stderr, flush=True)
    return LaunchOutcome(code, wall_s=time.monotonic() - began, details={"slurm_job_id": job_id,
                                                                          "slurm_state": state.state})
