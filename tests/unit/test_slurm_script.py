"""The sbatch script ``launch.executor=slurm`` writes, line by line, and Slurm's states read back
(no Slurm needed here: tests/e2e/test_slurm.py runs the jobs on a real one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from parallel.errors import ConfigError
from trainer.launch.slurm import render_script, sbatch_options, write_job
from trainer.launch.slurm_job import SlurmState, _exit_code, exit_code

FOLDER, WORKDIR = Path("/shared/runs/logs/job"), Path("/shared/runs")


def test_two_nodes_with_every_option_give_these_exact_lines(compose):
    cfg = compose("+parallel=fsdp", "mesh=[4]", "launch.executor=slurm", "launch.nnodes=2",
                  "launch.slurm.partition=debug", "launch.slurm.time=00:30:00", "launch.slurm.account=proj7",
                  "launch.slurm.qos=high", "launch.slurm.cpus_per_task=8", "launch.slurm.gpus_per_node=2",
                  "launch.slurm.mem=64G", "launch.slurm.signal_before_end_s=300", "launch.slurm.rdzv_port=29400",
                  "launch.slurm.extra=['--exclusive','--constraint=h100']", "tracking.run_name=big")
    lines = render_script(cfg, folder=FOLDER, workdir=WORKDIR, python="/venv/bin/python").splitlines()
    assert lines[:18] == [
        "#!/bin/bash",
        "# meshflow run big, written by python -m trainer; submit it again with: "
        "sbatch /shared/runs/logs/job/job.sbatch",
        "#SBATCH --job-name=big",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --gpus-per-node=2",
        "#SBATCH --mem=64G",
        "#SBATCH --time=00:30:00",
        "#SBATCH --partition=debug",
        "#SBATCH --account=proj7",
        "#SBATCH --qos=high",
        "#SBATCH --chdir=/shared/runs",
        "#SBATCH --output=/shared/runs/logs/job/slurm-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --signal=B:USR1@300",
        "#SBATCH --requeue",
        "#SBATCH --exclusive",
    ]
    assert lines[18] == "#SBATCH --constraint=h100"
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in lines
    assert ('srun --ntasks-per-node=1 --kill-on-bad-exit=1 /venv/bin/python -m trainer.launch '
            '/shared/runs/logs/job/config.json --node-rank-env SLURM_NODEID --rdzv-id "slurm-$SLURM_JOB_ID" '
            '--rdzv-endpoint "$head_node:29400" "${resume[@]}" &') in lines
    assert lines[19:31] == [
        "",
        "set -u",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export MESHFLOW_REQUEUE_DIR=/shared/runs/logs/job  # the run stops after a step with a checkpoint once stop "
        "is there",
        'rm -f "$MESHFLOW_REQUEUE_DIR/stop"',
        """trap 'echo "meshflow: Slurm warns of the end of job $SLURM_JOB_ID: saving a checkpoint"; """
        """touch "$MESHFLOW_REQUEUE_DIR/stop"' USR1""",
        "resume=()  # a requeued job resumes from the checkpoint its last allocation saved, in the same MLflow run",
        'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then',
        "    resume=(--resume auto)",
        '    if [ -s "$MESHFLOW_REQUEUE_DIR/mlflow_run_id" ]; then resume+=(--run-id "$(cat '
        '"$MESHFLOW_REQUEUE_DIR/mlflow_run_id")"); fi',
        "fi",
        'echo "meshflow: slurm job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NUM_NODES node(s), '
        'first $head_node"',
    ]
    assert lines[-5:] == ['if [ "$code" -eq 75 ]; then',
                          '    echo "meshflow: checkpoint saved; requeueing job $SLURM_JOB_ID to resume from it"',
                          '    scontrol requeue "$SLURM_JOB_ID"', "fi", 'exit "$code"']


def test_one_node_by_default_asks_only_what_it_needs_and_keeps_its_loopback_rendezvous(compose):
    cfg = compose("+parallel=fsdp", "mesh=[2]", "launch.executor=slurm", "launch.slurm.signal_before_end_s=0",
                  "launch.slurm.requeue=false")
    assert sbatch_options(cfg, folder=FOLDER, workdir=WORKDIR) == [
        "--job-name=fsdp-2", "--nodes=1", "--ntasks-per-node=1", "--chdir=/shared/runs",
        "--output=/shared/runs/logs/job/slurm-%j.out", "--open-mode=append", "--no-requeue"]
    script = render_script(cfg, folder=FOLDER, workdir=WORKDIR, python="python3")
    assert "--rdzv-endpoint" not in script
    assert ("srun --ntasks-per-node=1 --kill-on-bad-exit=1 python3 -m trainer.launch /shared/runs/logs/job/config.json "
            '--node-rank-env SLURM_NODEID --rdzv-id "slurm-$SLURM_JOB_ID" "${resume[@]}" &') in script


def test_the_job_folder_holds_the_script_and_the_config_the_nodes_launch(compose, tmp_path):
    from trainer.config.schema import RunConfig

    cfg = compose("+parallel=fsdp", "mesh=[2]", "launch.executor=slurm", "train.steps=7")
    script = write_job(cfg, tmp_path / "job", workdir=tmp_path)
    assert script == tmp_path / "job" / "job.sbatch" and script.stat().st_mode & 0o111
    assert RunConfig.model_validate_json((tmp_path / "job" / "config.json").read_text()) == cfg
    assert f"#SBATCH --chdir={tmp_path}" in script.read_text()


@pytest.mark.parametrize("override, path", [
    ("launch.slurm.time=half-an-hour", "launch.slurm.time"),
    ("launch.slurm.partition='debug; rm -rf /'", "launch.slurm.partition"),
    ("launch.slurm.extra=[exclusive]", "launch.slurm.extra"),
    ("launch.node_rank=1", "launch.node_rank"),
])
def test_a_bad_slurm_setting_is_named(compose, override, path):
    args = ["+parallel=fsdp", "mesh=[4]", "launch.executor=slurm", "launch.nnodes=2", override]
    with pytest.raises(ConfigError) as err:
        compose(*args)
    assert path in [issue.path for issue in err.value.issues], err.value


def test_several_nodes_on_slurm_need_no_rendezvous_endpoint(compose):
    assert compose("+parallel=fsdp", "mesh=[4]", "launch.executor=slurm", "launch.nnodes=2").launch.nnodes == 2


@pytest.mark.parametrize("state, code, want", [
    ("COMPLETED", "0:0", 0), ("FAILED", "1:0", 1), ("FAILED", "0:9", 137), ("CANCELLED", "0:15", 143),
    ("TIMEOUT", "0:0", 1), ("PREEMPTED", "0:0", 1), ("NODE_FAIL", "0:0", 1), ("FAILED", "2:0", 2),
])
def test_an_ended_job_exits_with_its_code(state, code, want):
    assert exit_code(SlurmState(state=state, exit_code=_exit_code(code))) == want


def test_waiting_and_running_states_are_not_ends():
    assert not SlurmState("PENDING").ended and not SlurmState("REQUEUED").ended
    assert not SlurmState("RUNNING").ended and not SlurmState("COMPLETING").ended
    assert SlurmState("TIMEOUT").ended and SlurmState("NODE_FAIL").ended
    assert SlurmState("PENDING", reason="Resources").describe("12") == "slurm job 12: PENDING (Resources)"
    running = SlurmState("RUNNING", nodes="n[1-2]", restarts=1)
    assert running.describe("12") == "slurm job 12: RUNNING on n[1-2], restart 1"


def test_the_control_plane_refuses_extra_sbatch_lines_before_writing_anything(compose, tmp_path):
    from service.executors.base import JobLaunch
    from service.executors.slurm import SlurmExecutor

    cfg = compose("+parallel=fsdp", "mesh=[2]", "launch.slurm.extra=['--output=/etc/cron.d/x']")
    launch = JobLaunch(job_id="7", workdir=tmp_path / "jobs" / "7", config=cfg.model_dump(mode="json"), world_size=2)
    with pytest.raises(ValueError, match=r"launch.slurm.extra=\['--output=/etc/cron.d/x'\]: a control-plane job"):
        SlurmExecutor().start(launch)
    assert not (tmp_path / "jobs").exists()
