"""The launcher as a user meets it: a dying worker, a stopped job, no orphans; launches in threads of
one process each return their own outcome."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import worker_pids
from tests.typed import run_typed
from trainer.run.metrics import NullProgress
from trainer.tracking.tracker import NullTracker
from timing import Deadline, scaled

LONG_DP = ["+parallel=dp", "mesh=[2]", "train.steps=100000", "train.global_batch_size=4", "train.seq_len=32",
           "train.log_every=1", "data.max_bytes=100000"]


def _children(pid: int) -> set[int]:
    """All descendants of pid, from /proc."""
    parent_of = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent_of[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parent_of.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def _start(tmp_path: Path, uri: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainer", *LONG_DP, f"tracking.tracking_uri={uri}"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _wait_for_workers(proc: subprocess.Popen, n: int) -> dict[int, int]:
    """{rank: pid} once the workers have logged step 3; they are the launcher's children."""
    ranks = worker_pids(proc, [], until="step 3/", timeout=180)
    assert len(ranks) == n and set(ranks.values()) <= _children(proc.pid)
    return ranks


def _left_behind(pids: set[int]) -> set[int]:
    """Those of ``pids`` still alive once they had up to 5 s (scaled) to finish exiting: the
    launcher's end is not their last instruction, and a busy host runs them late."""
    deadline = Deadline(5)
    while _alive(pids) and not deadline.expired():
        time.sleep(0.1)
    return _alive(pids)


def _run_status(uri: str) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("meshflow").experiment_id])
    assert len(runs) == 1
    return runs[0].info.status


@pytest.mark.slow
def test_sigkill_of_a_worker_names_rank_fails_run_and_leaves_no_process(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    proc = _start(tmp_path, uri)
    ranks = _wait_for_workers(proc, 2)
    everything = _children(proc.pid)
    os.kill(ranks[1], signal.SIGKILL)
    output = proc.communicate(timeout=scaled(120))[0]
    assert proc.returncode == 1, output
    assert f"worker rank 1 (pid {ranks[1]}) was killed by signal SIGKILL" in output
    assert _run_status(uri) == "FAILED"
    assert not _left_behind(everything), f"left behind: {_left_behind(everything)}"


@pytest.mark.slow
def test_sigterm_stops_every_worker_and_kills_the_run(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    proc = _start(tmp_path, uri)
    _wait_for_workers(proc, 2)
    everything = _children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=scaled(120))[0]
    assert proc.returncode == 143, output
    assert _run_status(uri) == "KILLED"
    assert not _left_behind(everything), f"left behind: {_left_behind(everything)}"


@pytest.mark.slow
def test_a_run_the_store_refuses_stops_the_workers_with_the_stores_reason(tmp_path):
    """The MLflow run is made while the workers start (trainer.tracking.opening): when the store refuses it
    (a deleted experiment), rank 0's writes fail on it, every worker stops, and the launcher exits 1 with the
    store's reason and its fix, not a worker's traceback alone."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    client.delete_experiment(client.create_experiment("gone"))
    proc = subprocess.Popen([sys.executable, "-m", "trainer", *LONG_DP, f"tracking.tracking_uri={uri}",
                             "tracking.experiment=gone"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    output = proc.communicate(timeout=scaled(300))[0]
    assert proc.returncode == 1, output
    gone = client.get_experiment_by_name("gone").experiment_id
    fix = f"MLFLOW_TRACKING_URI={uri} mlflow experiments restore --experiment-id {gone}"
    assert (f"training failed: tracking.experiment: MLflow experiment 'gone' is deleted in '{uri}'; restore it "
            f"(`{fix}`) or choose another name") in output, output
    assert client.search_runs([gone]) == []
    typed = run_typed(fix)  # the printed fix, typed as printed, restores it
    assert typed.returncode == 0, typed.stderr
    assert client.get_experiment(gone).lifecycle_stage == "active"


ONE_DEVICE = ("tracking=none", "tracking.pictures=false", "train.checkpoint.save_final=false",
              "train.global_batch_size=4",
              "train.seq_len=32", "train.log_every=1", "data.max_bytes=200000")


def test_launches_in_threads_of_one_process_each_return_their_own_outcome(compose, tmp_path):
    """Two one-device launches at once in threads of one process (as a sweep's or the control plane's
    could): each returns its own exit code, losses and step times, the losses its config's alone, and
    each job log holds its own run's step lines."""
    from trainer.launch.launcher import launch
    from trainer.run.loop import train

    configs = {steps: compose(*ONE_DEVICE, f"train.steps={steps}", f"launch.log_dir={tmp_path / f'steps{steps}'}")
               for steps in (2, 3)}
    alone = {steps: train(cfg, tracker=NullTracker(), progress=NullProgress()).losses for steps, cfg in configs.items()}
    together, started = {}, threading.Barrier(len(configs))

    def launch_one(steps: int) -> None:
        started.wait()
        together[steps] = launch(configs[steps])

    threads = [threading.Thread(target=launch_one, args=(steps,)) for steps in configs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=scaled(300))
    assert {steps: (o.exit_code, len(o.step_times), o.run_id) for steps, o in together.items()} == {
        2: (0, 2, None), 3: (0, 3, None)}
    assert {steps: o.losses for steps, o in together.items()} == alone
    assert float(together[3]) == alone[3][-1]  # what a sweep's job returns to its sweeper
    for steps in configs:
        (log,) = (tmp_path / f"steps{steps}").glob("*_local/attempt_0/0/stdout.log")
        counted = {line.split()[1] for line in log.read_text().splitlines() if line.startswith("step ")}
        assert counted == {f"{n}/{steps}" for n in range(1, steps + 1)}, log.read_text()
