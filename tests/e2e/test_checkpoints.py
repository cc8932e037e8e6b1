"""Checkpoints across meshes and faults, through the CLI as a user runs it.

Losses are read back from MLflow (full precision) and compared with a one-device,
uninterrupted run computed in-process: by loss parity every mesh gives those losses.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli, worker_pids
from trainer.run.metrics import NullProgress
from trainer.tracking.tracker import NullTracker
from timing import Deadline, scaled

BASE = ["train.steps=6", "train.global_batch_size=16", "train.seq_len=32", "train.log_every=1",
        "data.max_bytes=100000", "optim.warmup_steps=2"]


def _losses(uri: str, run_name: str) -> dict[int, float]:
    """step -> loss of the named run; when a step was logged twice (a restart), the last value."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("meshflow").experiment_id],
                              filter_string=f"attributes.run_name = '{run_name}'")
    assert len(runs) == 1, [r.info.run_name for r in runs]
    history = sorted(client.get_metric_history(runs[0].info.run_id, "loss"), key=lambda m: m.timestamp)
    return {m.step: m.value for m in history}


def _logged_steps(uri: str, run_name: str) -> list[int]:
    """Every step the named run's ``loss`` history holds, as often as it holds it."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("meshflow").experiment_id],
                                filter_string=f"attributes.run_name = '{run_name}'")
    return [m.step for m in client.get_metric_history(run.info.run_id, "loss")]


def _cli(tmp_path: Path, uri: str, name: str, *args: str, timeout: float = 600) -> str:
    out = run_cli([*BASE, *args, f"tracking.tracking_uri={uri}", f"tracking.run_name={name}"], cwd=tmp_path,
                  timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def reference():
    """Losses of the uninterrupted one-device run, steps 1..6."""
    from trainer.config.compose import compose_dict
    from trainer.run.loop import train
    from trainer.validate.checks import validate_config

    cfg = validate_config(compose_dict([*BASE, "tracking=none", "train.checkpoint.save_final=false"]))
    return train(cfg, tracker=NullTracker(), progress=NullProgress()).losses


def _assert_continues(got: dict[int, float], reference: list[float], steps: range) -> None:
    assert sorted(got) == list(steps), got
    for step in steps:
        assert got[step] == pytest.approx(reference[step - 1], rel=1e-5), (step, got[step], reference[step - 1])


@pytest.mark.slow
def test_resume_reshards_across_meshes(tmp_path, reference):
    """[2,2,2] -> [4,1,2] -> [1] in a chain; and a pp schedule change and fsdp -> ddp from the first save."""
    from trainer.config.compose import compose_dict
    from trainer.run.loop import train
    from trainer.validate.checks import validate_config

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    a, b = tmp_path / "a", tmp_path / "b"
    _cli(tmp_path, uri, "3d", "+parallel=3d", "mesh=[2,2,2]", f"train.checkpoint.dir={a}", "train.checkpoint.every=2")
    _assert_continues(_losses(uri, "3d"), reference, range(1, 7))

    _cli(tmp_path, uri, "412", "+parallel=3d", "mesh=[4,1,2]", "parallel.pipeline.boundaries=[]",
         f"train.checkpoint.resume={a}/step_00000002", f"train.checkpoint.dir={b}", "train.checkpoint.every=2")
    _assert_continues(_losses(uri, "412"), reference, range(3, 7))

    c = tmp_path / "c"
    cfg = validate_config(compose_dict([*BASE, "tracking=none", f"train.checkpoint.resume={b}/step_00000004",
                                        f"train.checkpoint.dir={c}", "train.checkpoint.save_final=true"]))
    one = train(cfg, tracker=NullTracker(), progress=NullProgress())
    assert one.first_step == 4
    assert one.losses == pytest.approx(reference[4:], rel=1e-5)

    # Exported full weights of the 3d run and of the chain that ended on one device agree.
    from safetensors.torch import load_file

    from trainer.export.weights import export_checkpoint

    export_checkpoint(a / "step_00000006", tmp_path / "a.safetensors")
    export_checkpoint(c / "step_00000006", tmp_path / "c.safetensors")
    wa, wc = load_file(str(tmp_path / "a.safetensors")), load_file(str(tmp_path / "c.safetensors"))
    assert wa.keys() == wc.keys() and len(wa) == 39
    for name in wa:
        assert torch.allclose(wa[name], wc[name], rtol=1e-4, atol=1e-6), name

    # Interleaved: two stages per rank (a schedule change, and one checkpoint over several stage modules).
    _cli(tmp_path, uri, "interleaved", "+parallel=pp", "mesh=[2]", "parallel.pipeline.schedule=Interleaved1F1B",
         "parallel.pipeline.stages_per_rank=2", f"train.checkpoint.resume={a}/step_00000002",
         f"train.checkpoint.dir={tmp_path / 'd'}", "train.checkpoint.every=2")
    _assert_continues(_losses(uri, "interleaved"), reference, range(3, 7))
    _cli(tmp_path, uri, "gpipe", "+parallel=pp", "mesh=[2]", "parallel.pipeline.schedule=GPipe",
         f"train.checkpoint.resume={tmp_path / 'd'}/step_00000004")
    _assert_continues(_losses(uri, "gpipe"), reference, range(5, 7))
    _cli(tmp_path, uri, "ddp", "+parallel=dp", "mesh=[2]", f"train.checkpoint.resume={a}/step_00000004")
    _assert_continues(_losses(uri, "ddp"), reference, range(5, 7))


@pytest.mark.slow
def test_per_stage_layouts_train_and_move_to_a_uniform_layout_and_back(tmp_path, reference):
    """``+parallel=pp_stages`` (stage 0 fsdp on ranks 0-1, stage 1 Megatron tp on ranks 2-3): one
    device's losses; its step-2 checkpoint resumes on dp x tp [2, 2], whose step-4 checkpoint
    resumes on the per-stage layouts again, each continuing the one-device run."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    staged, uniform = tmp_path / "staged", tmp_path / "uniform"
    _cli(tmp_path, uri, "staged", "+parallel=pp_stages", f"train.checkpoint.dir={staged}", "train.checkpoint.every=2")
    _assert_continues(_losses(uri, "staged"), reference, range(1, 7))
    _cli(tmp_path, uri, "uniform", "+parallel=2d", "mesh=[2,2]", f"train.checkpoint.resume={staged}/step_00000002",
         f"train.checkpoint.dir={uniform}", "train.checkpoint.every=2")
    _assert_continues(_losses(uri, "uniform"), reference, range(3, 7))
    _cli(tmp_path, uri, "staged_again", "+parallel=pp_stages", f"train.checkpoint.resume={uniform}/step_00000004")
    _assert_continues(_losses(uri, "staged_again"), reference, range(5, 7))


@pytest.mark.slow
def test_a_stage_with_its_own_cp_axis_checkpoints_and_resumes_on_a_uniform_layout(tmp_path, reference):
    """``+parallel=pp_stages_cp`` (stage 0 fsdp x tp on ranks 0-3, stage 1 cp on ranks 4-7; 8 workers): one
    device's losses, and its step-4 checkpoint resumes on fsdp x tp [2, 2], continuing the one-device run."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    staged = tmp_path / "staged_cp"
    _cli(tmp_path, uri, "staged_cp", "+parallel=pp_stages_cp", f"train.checkpoint.dir={staged}",
         "train.checkpoint.every=4")
    _assert_continues(_losses(uri, "staged_cp"), reference, range(1, 7))
    _cli(tmp_path, uri, "uniform", "+parallel=2d", "mesh=[2,2]", f"train.checkpoint.resume={staged}/step_00000004")
    _assert_continues(_losses(uri, "uniform"), reference, range(5, 7))


@pytest.mark.slow
def test_killed_worker_is_restarted_and_the_run_continues_exactly(tmp_path):
    """max_restarts=1: SIGKILL a worker mid-run; the elastic agent restarts the workers, they resume
    from the newest checkpoint, and every step's loss equals the uninterrupted run's."""
    from trainer.config.compose import compose_dict
    from trainer.run.loop import train
    from trainer.validate.checks import validate_config

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    args = ["train.steps=16", "train.global_batch_size=8", "train.seq_len=32", "train.log_every=1",
            "data.max_bytes=100000", f"train.checkpoint.dir={tmp_path / 'ck'}", "train.checkpoint.every=4"]
    proc = subprocess.Popen([sys.executable, "-m", "trainer", "+parallel=fsdp", "mesh=[2]", "launch.max_restarts=1",
                             *args, f"tracking.tracking_uri={uri}", "tracking.run_name=restart"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    ranks = worker_pids(proc, lines, until="step 6/")
    os.kill(ranks[1], signal.SIGKILL)
    output = "".join(lines) + proc.communicate(timeout=scaled(300))[0]
    assert proc.returncode == 0, output
    assert "resumed from" in output and "step_00000004" in output, output
    reference = train(validate_config(compose_dict([*args, "tracking=none", f"train.checkpoint.dir={tmp_path / 'x'}"])),
                      tracker=NullTracker(), progress=NullProgress()).losses
    _assert_continues(_losses(uri, "restart"), reference, range(1, 17))
    # the restarted attempt replayed steps 5-6 from step 4's checkpoint: rank 0 logs through the launcher's
    # client (trainer.tracking.relay), which writes each step of a metric once
    assert sorted(_logged_steps(uri, "restart")) == list(range(1, 17))


@pytest.mark.slow
def test_rank_killed_mid_save_leaves_previous_checkpoint_loadable(tmp_path):
    """SIGKILL a rank while a save is being written: the unfinished save is never a checkpoint,
    and the previous one still loads (here: exported to a full-weights file)."""
    from trainer.checkpoint.dcp import latest_checkpoint
    from trainer.export.weights import export_checkpoint

    ckpt = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-m", "trainer", "+parallel=fsdp", "mesh=[2]", "model=gpt_small",
                             "tracking=none", "train.steps=50", "train.global_batch_size=2", "train.seq_len=16",
                             "data.max_bytes=100000", f"train.checkpoint.dir={ckpt}", "train.checkpoint.every=1",
                             "train.checkpoint.keep=2"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    ranks = worker_pids(proc, lines, until="checkpoint ")
    deadline = Deadline(120)
    while not any(p.name.startswith(".tmp-step") for p in ckpt.iterdir()):
        assert not deadline.expired() and proc.poll() is None, "".join(lines)
        time.sleep(0.005)
    os.kill(ranks[1], signal.SIGKILL)
    proc.communicate(timeout=scaled(300))
    assert proc.returncode != 0
    survivor = latest_checkpoint(ckpt)
    assert survivor is not None
    info = export_checkpoint(survivor, tmp_path / "model.safetensors")
    assert info["tensors"] == 75  # gpt_small: 8 layers x 9 + embeddings, norm, output
