"""Runs on a real Slurm (``launch.executor=slurm``): the tests start munged, slurmctld and slurmd on this
host (tests/slurm_cluster.py; Debian's packages installed when missing), submit with the CLI as a user
would, and stop every daemon at the end, leaving no process behind.

    python -m pytest -q -m slow tests/e2e/test_slurm.py
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm_cluster import SlurmCluster, start_slurm
from timing import Deadline, scaled

COMMON = ["train.steps=4", "train.global_batch_size=8", "train.seq_len=32", "data.max_bytes=100000",
          "train.log_every=1", "tracking.pictures=false"]
SLURM_PROCESSES = ("munged", "slurmctld", "slurmd", "slurmstepd")


def _living(names: tuple[str, ...] = (), *, job: str | None = None) -> list[str]:
    """``pid name command`` of every process (not a zombie) whose name is one of ``names``, or (``job``) that
    runs in that Slurm job: its environment has ``SLURM_JOB_ID=<job>`` (the launcher, its fork server, the
    workers)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (proc / "environ").read_bytes().split(b"\0") if job else []
        except OSError:
            continue
        name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
        if state != "Z" and (name in names or f"SLURM_JOB_ID={job}".encode() in environ):
            found.append(f"{proc.name} {name} {cmdline[:120]}")
    return found


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> SlurmCluster:
    cluster = start_slurm(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.stop()
    deadline = Deadline(30)
    while _living(SLURM_PROCESSES) and not deadline.expired():  # slurmstepd ends after slurmd
        time.sleep(0.5)
    assert not _living(SLURM_PROCESSES), _living(SLURM_PROCESSES)


def _cli(args: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer", *args], cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1",
                                                                                   **env},
                          capture_output=True, text=True, timeout=scaled(timeout))


def _losses(uri: str) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("meshflow").experiment_id])
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}


def _job_id(output: str) -> str:
    match = re.search(r"slurm job (\d+) submitted", output)
    assert match, output[-3000:]
    return match.group(1)


@pytest.mark.slow
def test_a_two_process_job_completes_with_a_local_runs_losses(slurm, tmp_path):
    local_dir, slurm_dir = tmp_path / "local", tmp_path / "slurm"
    local_dir.mkdir(), slurm_dir.mkdir()
    local_uri, slurm_uri = f"sqlite:///{local_dir}/mlflow.db", f"sqlite:///{slurm_dir}/mlflow.db"
    local = _cli([*COMMON, f"tracking.tracking_uri={local_uri}"], cwd=local_dir, env={})
    assert local.returncode == 0, local.stderr[-2000:]

    done = _cli(["+parallel=fsdp", "mesh=[2]", "launch.executor=slurm", *COMMON, f"tracking.tracking_uri={slurm_uri}"],
                cwd=slurm_dir, env=slurm.env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    job = _job_id(done.stdout)
    assert f"slurm job {job}: COMPLETED" in done.stdout
    assert "[rank0]: step 4/4" in done.stdout and "done: steps 1..4" in done.stdout  # followed as a local run
    (script,) = (slurm_dir / "logs").glob("fsdp-2-slurm-*/job.sbatch")  # beside the run's logs
    assert (script.parent / f"slurm-{job}.out").read_text().count("step 4/4") == 1
    state = slurm.run("scontrol", "show", "job", "--oneliner", job).stdout
    assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state and f"Command={script}" in state
    want, got = _losses(local_uri), _losses(slurm_uri)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    assert max(abs(got[s] - want[s]) / abs(want[s]) for s in want) <= 1e-5, (got, want)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["scancel", "sigterm to the command"])
def test_a_cancelled_job_stops_its_workers_and_the_command_exits_143(slurm, tmp_path, how):
    """Cancelled from elsewhere (``scancel``), or the command stopped as a local run is (SIGTERM: it cancels
    the job itself): the job ends CANCELLED, none of its processes are left, the command exits 143."""
    args = ["+parallel=fsdp", "mesh=[2]", "launch.executor=slurm", *[a for a in COMMON if "steps" not in a],
            "train.steps=100000", "train.checkpoint.save_final=false", "tracking=none"]
    proc = subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=tmp_path, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **slurm.env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    seen: list[str] = []
    try:
        job = _follow_until(proc, "step 2/100000", seen)
        if how == "scancel":
            slurm.run("scancel", job)
        else:
            proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=scaled(120))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, "".join(seen[-20:]) + rest[-2000:]
    said = (f"slurm job {job}: CANCELLED", f"slurm job {job} cancelled (exit code 143)") if how == "scancel" else \
        (f"slurm job {job} cancelled (scancel): CANCELLED",)
    assert all(line in rest for line in said), rest
    assert "JobState=CANCELLED" in slurm.run("scontrol", "show", "job", "--oneliner", job).stdout
    deadline = Deadline(60)
    while _living(job=job) and not deadline.expired():  # Slurm kills the job's processes, the workers with them
        time.sleep(0.5)
    assert not _living(job=job), _living(job=job)


def _follow_until(proc: subprocess.Popen, text: str, seen: list[str], timeout: float = 300) -> str:
    """Read the command's output into ``seen`` until a line holds ``text``; the job id it printed."""
    deadline, job = Deadline(timeout), None
    while not deadline.expired():
        line = proc.stdout.readline()
        seen.append(line)
        job = job or (re.search(r"slurm job (\d+) submitted", line) or [None, None])[1]
        if text in line or not line:
            break
    assert job and text in seen[-1], "".join(seen[-40:])
    return job


@pytest.mark.slow
def test_a_warned_job_checkpoints_is_requeued_and_resumes_with_an_uninterrupted_runs_losses(slurm, tmp_path):
    """Slurm's warning (USR1 to the batch shell, as --signal=B:USR1@<s> sends it before the time limit or at a
    preemption) mid-run: the run saves a checkpoint after the step it is at, the job requeues itself and
    resumes from that checkpoint in the same MLflow run; every step's loss equals an uninterrupted run's on
    the same mesh (a local one: the Slurm job's workers are the same processes)."""
    steps = 60
    args = ["+parallel=fsdp", "mesh=[2]", *[a for a in COMMON if "steps" not in a], f"train.steps={steps}"]
    whole_dir, job_dir = tmp_path / "whole", tmp_path / "job"
    whole_dir.mkdir(), job_dir.mkdir()
    whole_uri, job_uri = f"sqlite:///{whole_dir}/mlflow.db", f"sqlite:///{job_dir}/mlflow.db"
    whole = _cli([*args, f"tracking.tracking_uri={whole_uri}"], cwd=whole_dir, env={})
    assert whole.returncode == 0, whole.stderr[-2000:]

    proc = subprocess.Popen([sys.executable, "-m", "trainer", "launch.executor=slurm", *args,
                             f"tracking.tracking_uri={job_uri}"], cwd=job_dir, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **slurm.env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    seen: list[str] = []
    try:
        job = _follow_until(proc, f"step 3/{steps}", seen)
        slurm.run("scancel", "--signal=USR1", "--batch", job)  # what --signal=B:USR1@<s> does at its time
        rest, _ = proc.communicate(timeout=scaled(400))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(seen) + rest
    assert proc.returncode == 0, out[-4000:]
    stopped = int(re.search(r"stopped after step (\d+) as asked", out).group(1))
    assert 3 <= stopped < steps, out[-4000:]
    assert f"meshflow: Slurm warns of the end of job {job}: saving a checkpoint" in out
    assert f"meshflow: checkpoint saved; requeueing job {job} to resume from it" in out
    assert f"resumed from checkpoints/step_{stopped:08d} at step {stopped}" in out, out[-4000:]
    assert f"slurm job {job}: COMPLETED" in out and f"done: steps {stopped + 1}..{steps}" in out
    state = slurm.run("scontrol", "show", "job", "--oneliner", job).stdout
    assert "JobState=COMPLETED" in state and "Restarts=1" in state, state
    want, got = _losses(whole_uri), _losses(job_uri)  # one MLflow run: the requeued job continued it
    assert sorted(got) == sorted(want) == list(range(1, steps + 1)), sorted(got)
    assert max(abs(got[s] - want[s]) / abs(want[s]) for s in want) <= 1e-5, (got, want)


@pytest.mark.slow
def test_a_job_nearing_its_time_limit_checkpoints_before_it_and_is_requeued(slurm, tmp_path):
    """``launch.slurm.time=2`` (minutes) with the warning 100 s before: Slurm itself sends USR1 (within its
    minute of resolution), the run saves a checkpoint after the step it is at and the job requeues itself,
    so the time limit takes nothing (the test cancels it then: a run of 100000 steps would go on)."""
    args = ["+parallel=fsdp", "mesh=[2]", "launch.executor=slurm", "launch.slurm.time=2",
            "launch.slurm.signal_before_end_s=100", *[a for a in COMMON if "steps" not in a], "train.steps=100000",
            "tracking=none"]
    proc = subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=tmp_path, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **slurm.env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    seen: list[str] = []
    try:
        job = _follow_until(proc, "meshflow: checkpoint saved; requeueing job", seen, timeout=400)
        slurm.run("scancel", job)
        rest, _ = proc.communicate(timeout=scaled(120))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(seen) + rest
    assert f"meshflow: Slurm warns of the end of job {job}: saving a checkpoint" in out, out[-3000:]
    stopped = int(re.search(r"stopped after step (\d+) as asked", out).group(1))
    assert (tmp_path / "checkpoints" / f"step_{stopped:08d}").is_dir()
    assert "TIMEOUT" not in slurm.run("scontrol", "show", "job", "--oneliner", job).stdout
