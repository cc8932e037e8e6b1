"""The dry run's predicted step: ``meshflow-plan/plan.json`` and its console lines, on a hardware
profile and on this host; a dry run of a config a launch would refuse exits 2.

    python -m pytest tests/unit/test_plan_file.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config.compose import compose_dict
from trainer.planner.forecast.plan_file import dry_run_report
from trainer.validate.checks import validate_with_plan

REPO = Path(__file__).resolve().parents[2]
KEYS = {"step_time_s", "tokens_per_s_per_device", "model_flops_utilization", "peak_memory_gib_per_device", "axes",
        "hardware", "nnodes", "devices", "memory_budget_gib", "fits"}


def test_a_profile_plan_writes_the_prediction_and_prints_the_same(tmp_path):
    cfg, plan = validate_with_plan(compose_dict(["dry_run=true", "hardware=h100_sxm", "launch.nnodes=2", "+parallel=3d",
                                                 "mesh=[4,2,2]", "model=gpt_small", "train.global_batch_size=64",
                                                 "train.seq_len=512", "train.precision=bf16"]))
    text, summary = dry_run_report(cfg, plan, pictures_dir=tmp_path)
    written = json.loads((tmp_path / "plan.json").read_text())
    assert KEYS <= set(written) and written == json.loads(json.dumps(summary))
    tokens = 64 * 512
    assert written["tokens_per_s_per_device"] * 16 * written["step_time_s"] == pytest.approx(tokens)
    assert 0 < written["model_flops_utilization"] < 1 and written["fits"] and written["devices"] == 16
    # dp x pp x tp = 4 x 2 x 2 on 2 nodes of 8: tp and pp stay inside a node, dp's groups span both
    assert written["axes"]["tp"]["link"] == "intra" and written["axes"]["pp"]["link"] == "intra"
    assert written["axes"]["dp"]["link"] == "hierarchical" and written["axes"]["dp"]["nodes"] == 2
    for axis, a in written["axes"].items():
        assert a["sent_bytes_per_step"] > 0 and 0 <= a["exposed_s"] <= a["seconds"] + 1e-12, axis
    assert f"{written['tokens_per_s_per_device']:,.0f} tokens/s per device" in text
    assert f"plan: {tmp_path / 'plan.json'}" in text


def test_this_host_without_a_calibration_says_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHFLOW_CACHE_DIR", str(tmp_path / "cache"))
    cfg, plan = validate_with_plan(compose_dict(["dry_run=true", "+parallel=dp", "mesh=[2]"]))
    text, summary = dry_run_report(cfg, plan, pictures_dir=None)
    assert summary["step_time_s"] is None and summary["model_flops_utilization"] is None
    assert "python -m trainer.calibrate mesh=[2]" in summary["note"] and summary["note"] in text
    assert summary["peak_memory_gib_per_device"] > 0 and summary["hardware"] == "this_host"


def _cli(tmp_path, *overrides):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "trainer", "dry_run=true", "tracking=none", *overrides],
                          cwd=tmp_path, env=env, capture_output=True, text=True)


def test_a_dry_run_that_would_be_refused_exits_2_and_the_printed_fix_exits_0(tmp_path):
    """24 layers of 175B's width (44B) over 8 A100s of 40 GB do not fit: the report is printed, the
    exit code says so; the fix the message prints, typed as printed, asks for 0. (A quarter of the
    model's layers: the prediction traces each layer, and the verdict is the same.)"""
    overrides = ["hardware=a100_40g", "model=gpt_175b", "model.n_layers=24", "+parallel=fsdp", "mesh=[8]",
                 "train.seq_len=2048",
                 "train.global_batch_size=8"]
    refused = _cli(tmp_path, *overrides)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "predicted on hardware a100_40g" in refused.stdout and "does NOT fit" in refused.stdout
    assert "this config would be refused at launch" in refused.stderr
    fix = "dry_run_exit_zero=true"
    assert f"add {fix} to exit 0" in refused.stderr
    report = _cli(tmp_path, *overrides, fix)
    assert report.returncode == 0, report.stderr[-2000:]
    plan = json.loads((tmp_path / "meshflow-plan" / "plan.json").read_text())
    # The budget: 40 GiB as CUDA shows it (0.9897 of it: trainer.planner.memory.budget.VISIBLE_SHARE)
    assert not plan["fits"]
    assert plan["peak_memory_gib_per_device"] > plan["memory_budget_gib"] == pytest.approx(40 * 0.9897)
    assert plan["memory_verdict"] == "does not fit"
    from trainer.planner.memory.budget import PUBLISHED_MEMORY_ERROR

    assert plan["peak_memory_gib_per_device"] > plan["memory_margin"]["refused_above_gib"] == pytest.approx(
        40 * 0.9897 * (1 + PUBLISHED_MEMORY_ERROR))


def test_a_dry_run_within_the_measured_error_warns_with_the_margin_and_exits_0(tmp_path):
    """The same 44B layout with a budget its predicted peak exceeds by less than the prediction's measured
    error on the published rows: not refused; the report names the margin (docs/planning.md, Memory)."""
    from trainer.planner.memory.budget import PUBLISHED_MEMORY_ERROR, PUBLISHED_MEMORY_ROWS

    overrides = ["hardware=a100_40g", "model=gpt_175b", "model.n_layers=24", "+parallel=fsdp", "mesh=[8]",
                 "train.seq_len=2048", "train.global_batch_size=8", "launch.memory_budget_gb=140"]
    run = _cli(tmp_path, *overrides)
    assert run.returncode == 0, run.stderr[-2000:]
    plan = json.loads((tmp_path / "meshflow-plan" / "plan.json").read_text())
    peak = plan["peak_memory_gib_per_device"]
    assert 140 < peak <= 140 * (1 + PUBLISHED_MEMORY_ERROR) and not plan["fits"]
    assert plan["memory_verdict"] == "may not fit" and plan["memory_margin"]["refused_above_gib"] == pytest.approx(
        140 * (1 + PUBLISHED_MEMORY_ERROR))
    warning = (f"warning: memory may not fit: predicted {peak:.2f} GiB, budget 140.00 GiB (launch.memory_budget_gb), "
               f"measured error {PUBLISHED_MEMORY_ERROR:.0%} on {PUBLISHED_MEMORY_ROWS} published rows")
    assert warning in run.stdout and plan["memory_margin"]["warning"].startswith(warning)
    assert "this config would be refused" not in run.stderr
