"""What the console says, checked by its values: step lines name the steps their means cover, the
plain progress line off a terminal, the config's changes at start (``train.print_config``), each
worker warning once, ``--help``'s defaults, and a sweep's table and winner.

Run: ``pytest tests/unit/test_console.py -q`` (no process, no MLflow store).
"""

from __future__ import annotations

import contextlib
import io

import pytest
import yaml

from trainer.cli.help import print_help
from trainer.cli.sweep import SweepParentRun, fixed_keys
from trainer.config.compose import compose_dict
from trainer.config.schema import RunConfig
from trainer.config.tracking_schema import default_tracking_uri
from trainer.launch.console import (CONFIG_ARTIFACT, _OneWarningEach, config_changes, config_changes_artifact,
                                    config_text, show_config)
from trainer.run.metrics import Progress, format_eta, format_metrics
from trainer.tracking.tracker import NullTracker

METRICS = {"loss": 3.25, "grad_norm": 1.5, "tokens_per_s": 1234.4, "step_time_s": 0.2, "lr": 1e-3,
           "peak_memory_mb": 15.2}


def _cfg(*overrides: str) -> RunConfig:
    return RunConfig.model_validate(compose_dict(list(overrides)))


def test_a_step_line_names_the_steps_its_means_cover():
    assert format_metrics(20, 25, METRICS, first=11) == (
        "step 20/25 | mean of steps 11-20: loss 3.2500, grad_norm 1.500, 1,234 tok/s, 200 ms/step | lr 1.00e-03 "
        "| peak 15 MiB")
    # a window of one step: its own values, no label
    assert format_metrics(3, 25, METRICS, first=3).startswith("step 3/25 | loss 3.2500, grad_norm")


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_off_a_terminal_a_plain_progress_line_comes_every_so_many_seconds(capsys):
    clock = _Clock()
    progress = Progress(live=False, clock=clock)
    progress.start(total=10, every_s=30)
    times = [5.0, 1.0, 2.0, 1.0, 1.0]  # seconds of steps 1..5; 128 tokens each
    for step, (seconds, loss) in enumerate(zip(times, [5.0, 4.0, 3.0, 2.0, 1.0]), start=1):
        clock.now += 20
        if step == 4:
            progress.log_step(4, METRICS, first=1)  # a step line: counts as a line, no progress line for it
        progress.advance(step, loss=loss, tokens_per_s=128 / seconds, tokens=128, step_time_s=seconds)
    lines = capsys.readouterr().out.splitlines()
    # step 2 (40 s after start), then steps 3-4 had a step line at 4; step 5 is 20 s after it: nothing
    assert lines[0] == "progress: 2/10 steps (20%), eta 8s | mean of steps 1-2: loss 4.5000, 43 tok/s"
    assert lines[1].startswith("step 4/10 | mean of steps 1-4:")
    assert len(lines) == 2
    # eta: the steps left times the mean step so far, the first (start-up) left out: 8 x 1 s
    assert format_eta(8) == "8s" and format_eta(725) == "12m05s" and format_eta(11220) == "3h07m"


def test_every_step_with_zero_and_never_on_a_terminal(capsys):
    plain = Progress(live=False, clock=_Clock())
    plain.start(total=3, every_s=0)
    for step in (1, 2, 3):
        plain.advance(step, loss=2.0, tokens_per_s=100.0, tokens=100, step_time_s=1.0)
    out = capsys.readouterr().out.splitlines()
    assert out == ["progress: 1/3 steps (33%), eta 2s | step 1: loss 2.0000, 100 tok/s",
                   "progress: 2/3 steps (66%), eta 1s | step 2: loss 2.0000, 100 tok/s"]  # the last step: the summary's
    live = Progress(live=True, clock=_Clock())
    live.start(total=3, every_s=0)
    for step in (1, 2, 3):
        live.advance(step, loss=2.0, tokens_per_s=100.0, tokens=100, step_time_s=1.0)
    live.stop()
    assert "progress:" not in capsys.readouterr().out  # the terminal keeps its bar


def test_the_config_shown_is_what_differs_from_the_defaults_secrets_masked():
    assert config_changes(_cfg()) == {}  # the CLI's own tags (preset) are not a change
    cfg = _cfg("+parallel=fsdp", "mesh=[2]", "train.steps=25", "optim.lr=1e-3", "tracking=none",
               "+tracking.tags.api_token=tok-1", "model=mlp", "model.hidden_features=64")
    changes = config_changes(cfg)
    assert changes == {"model": {"arch": "mlp", "hidden_features": 64}, "optim": {"lr": 0.001},
                       "tracking": {"backend": "none", "tags": {"api_token": "***"}}, "train": {"steps": 25},
                       "mesh": [2], "parallel": {"dims": ["dp"], "data_parallel": {"dim": "dp", "mode": "fsdp"}}}
    assert config_text(changes).splitlines() == [
        "config (differs from the defaults; --help lists them):", "  model: {arch: mlp, hidden_features: 64}",
        "  optim: {lr: 0.001}", "  tracking: {backend: none, tags: {api_token: '***'}}", "  train: {steps: 25}",
        "  mesh: [2]", "  parallel: {dims: [dp], data_parallel: {dim: dp, mode: fsdp}}"]


class _Recorder(NullTracker):
    def __init__(self) -> None:
        self.texts: dict[str, str] = {}

    def log_artifact_text(self, text: str, name: str) -> None:
        self.texts[name] = text


@pytest.mark.parametrize("shown", [True, False])
def test_train_print_config_prints_the_changes_which_are_logged_either_way(capsys, shown):
    cfg = _cfg("train.steps=7", f"train.print_config={str(shown).lower()}")
    tracker = _Recorder()
    show_config(cfg)
    for name, text in config_changes_artifact(cfg).items():  # what the launcher's run record logs
        tracker.log_artifact_text(text, name)
    out = capsys.readouterr().out
    expected = {"train": {"steps": 7}} if shown else {"train": {"steps": 7, "print_config": False}}
    assert yaml.safe_load(tracker.texts[CONFIG_ARTIFACT]) == expected
    if shown:
        assert out.splitlines() == ["config (differs from the defaults; --help lists them):", "  train: {steps: 7}"]
    else:
        assert out == ""


def test_a_warning_every_rank_raises_is_shown_once():
    out = io.StringIO()
    stream = _OneWarningEach(out)
    warning = "/x/_fsdp_state.py:331: UserWarning: FSDP2-wrapped module (Net) returned a view tensor.\n"
    for rank in (1, 0, 2):
        stream.write(f"[rank{rank}]: {warning}")
        stream.write(f"[rank{rank}]:   output = self._register_pre_backward_hook(output)\n")
        stream.write(f"[rank{rank}]: worker rank {rank} says something else\n")
    stream.write("[rank0]: /y.py:1: UserWarning: another one\n")
    assert out.getvalue().splitlines() == [
        f"[rank1]: {warning.strip()}", "[rank1]:   output = self._register_pre_backward_hook(output)",
        "[rank1]: worker rank 1 says something else", "[rank0]: worker rank 0 says something else",
        "[rank2]: worker rank 2 says something else", "[rank0]: /y.py:1: UserWarning: another one"]
    assert stream.repeats == 2


def test_help_shows_every_keys_default():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_help()
    lines = {line.split(":")[0].strip(): line for line in out.getvalue().splitlines() if ": " in line}
    assert lines["train.steps"].endswith("(default: 100) [>= 1, <= 100000000]")
    assert "(default: 0.003) [> 0]" in lines["optim.lr"] and "(default: [0.9, 0.95])" in lines["optim.betas"]
    assert "(default: null)" in lines["mesh"]
    assert f"(default: {default_tracking_uri()})" in lines["tracking.tracking_uri"]  # this user's store
    assert "(default: true)" in lines["train.print_config"] and "(default: 30" in lines["train.progress_every_s"]
    assert "(default: {})" in lines["tracking.tags"] and "(default: logs)" in lines["launch.log_dir"]
    assert "(required)" in lines["parallel.dims"]
    assert "(default: 64)" in lines["model.dim"] and "(default: stdlib)" in lines["data.root"]


def _sweep(jobs: list[tuple[float | None, float | None, str | None]], maximize: bool = False) -> SweepParentRun:
    sweep = SweepParentRun()
    sweep._maximize = maximize
    sweep._tracking_uri, sweep._experiment_id = "sqlite:///mlflow.db", "1"
    for number, (loss, peak, run_id) in enumerate(jobs):
        sweep._jobs.append({"job": number, "swept": [f"optim.lr={number + 1}e-3"],
                            "status": "COMPLETED" if loss else "FAILED",
                            "run_id": run_id, "final_loss": loss, "peak_memory_mb": peak})
    return sweep


def test_a_sweep_ends_with_a_table_and_the_winner():
    sweep = _sweep([(5.5, 14.2, "a" * 32), (None, None, None), (5.25, 14.6, "b" * 32), (float("nan"), 3.0, "c" * 32)])
    lines = sweep.table().splitlines()
    assert lines[0] == "sweep: 4 jobs, 3 completed"
    assert lines[2].split() == ["0", "5.5000", "14", "a" * 32, "optim.lr=1e-3"]
    assert lines[3].split() == ["1", "failed", "-", "-", "optim.lr=2e-3"]
    assert lines[4].split() == ["2", "5.2500", "15", "b" * 32, "optim.lr=3e-3"]
    assert lines[-1] == ("sweep: best job 2 (optim.lr=3e-3): final loss 5.2500, the lowest of 4; run "
                         f"http://127.0.0.1:5000/#/experiments/1/runs/{'b' * 32}?workflowType=machine_learning")
    # Optuna asked to maximize what the jobs return: the highest wins
    assert _sweep([(5.5, 1.0, None), (5.25, 1.0, None)], maximize=True).winner()["job"] == 0
    assert _sweep([(None, None, None)]).winner() is None


def test_a_jobs_own_overrides_are_the_swept_ones():
    assert fixed_keys(["optim.lr=1e-3,3e-3", "train.steps=2", "+parallel=dp", "mesh=[2],[4]",
                       "optim.warmup_steps=interval(1,4)", "++tracking.system_metrics=false"]) == {
        "train.steps", "parallel", "tracking.system_metrics"}
    sweep = SweepParentRun()
    sweep._fixed = {"train.steps", "parallel", "tracking.system_metrics"}
    assert sweep._own(["optim.lr=0.001", "train.steps=2", "+parallel=dp", "++tracking.system_metrics=False",
                       "tracking.tracking_uri=http://u:pw@h"]) == ["optim.lr=0.001",
                                                                   "tracking.tracking_uri=http://***@h"]


def test_a_single_run_passes_the_sweep_callback_by(capsys):
    """Hydra calls the job callbacks in a single run too, whose config has no job number."""
    from omegaconf import OmegaConf

    sweep = SweepParentRun()
    sweep.on_job_start(OmegaConf.create({"hydra": {"job": {"num": "???"}, "overrides": {"task": []}}}))
    sweep.on_job_end(OmegaConf.create({}), job_return=None)
    assert capsys.readouterr().out == "" and sweep._jobs == []


def test_config_changes_with_placements_are_yaml():
    """Placements are objects (Shard(1)), not YAML: the changes show them as the config writes them."""
    cfg = RunConfig.model_validate(compose_dict(["+examples=unordered_rank_ids"]))
    text = config_text(config_changes(cfg))
    assert ("  parallel: {dims: [x, y], placements: {w0: {x: Shard(1)}, w1: {x: Shard(0), y: Shard(1)}}}"
            in text.splitlines())
    assert yaml.safe_load(yaml.safe_dump(config_changes(cfg)))["mesh"] == [[2, 4, 5], [0, 1, 3]]
