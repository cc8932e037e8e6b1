"""Every prediction or none: LoRA priced on every layout, and a prediction that fails is an error
that names what failed, never a peak of 0 GiB that "fits".

    python -m pytest tests/unit/test_every_prediction.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from parallel.placements import PlacementSpec
from parallel.sharding.adapters import adapter_placements
from trainer.config.compose import compose_dict
from trainer.models import build_model
from trainer.planner import report as report_module
from trainer.planner.forecast.plan_file import dry_run_report, summary_lines
from trainer.planner.numbers import plan_numbers
from trainer.validate.checks import validate_with_plan

REPO = Path(__file__).resolve().parents[2]
LORA = "model.lora.rank=16"


def _plan(*overrides: str):
    return validate_with_plan(compose_dict(list(overrides)))


def test_adapters_are_placed_as_the_tp_styles_shard_them():
    """Column-parallel wq: lora_B Shard(0) (its output features), lora_A whole; row-parallel wo: lora_A
    Shard(1) (its input features), lora_B whole (parallel.sharding.adapters)."""
    cfg, plan = _plan("+parallel=tp", "mesh=[2]", LORA)
    placed = adapter_placements(build_model(cfg.model, device="meta"), plan.placements)
    assert placed["layers.0.attn.wq.lora_B.weight"] == {"tp": PlacementSpec("shard", dim=0)}
    assert placed["layers.0.attn.wo.lora_A.weight"] == {"tp": PlacementSpec("shard", dim=1)}
    assert "layers.0.attn.wq.lora_A.weight" not in placed and "layers.0.attn.wo.lora_B.weight" not in placed
    assert len(placed) == 4 * 7  # 4 layers x (wq, wk, wv, wo, w1, w3, w2): one sharded adapter each


def test_a_tp_rank_holds_its_share_of_the_adapters():
    """gpt_debug's default (dim 64, kv 32, ffn 172, 4 layers), rank 16 on every projection, tp [2]; per
    layer, by hand: wq A 16x64 + B 64x16 / 2 = 1536; wk, wv A 1024 + B 32x16 / 2 = 1280 each; wo A 16x64 / 2
    + B 1024 = 1536; w1, w3 A 1024 + B 172x16 / 2 = 2400 each; w2 A 16x172 / 2 + B 1024 = 2400: 12,832."""
    with_lora, without = (plan_numbers(*_plan("+parallel=tp", "mesh=[2]", *extra)) for extra in ([LORA], []))
    assert with_lora.per_pp_rank[0].params - without.per_pp_rank[0].params == 4 * 12_832
    assert with_lora.per_pp_rank[0].grad_bytes == 4 * 12_832 * 4  # only the adapters train


@pytest.mark.parametrize("layout", [["+parallel=tp", "mesh=[2]"], ["+parallel=2d", "mesh=[2,2]"],
                                    ["+parallel=3d", "mesh=[2,2,2]"], ["+parallel=tp_sp", "mesh=[2]"]])
def test_lora_is_priced_on_every_tp_layout(layout):
    """A dry run of LoRA on a GPU profile: a peak and a step time, of the magnitude of the same layout
    without adapters (the frozen base drops its gradients and AdamW state; the adapters add little)."""
    summaries = {}
    for extra in ([LORA], []):
        cfg, plan = _plan(*layout, *extra, "hardware=h100_sxm", "dry_run=true", "tracking.pictures=false")
        _, summaries[bool(extra)] = dry_run_report(cfg, plan, pictures_dir=None)
    lora, base = summaries[True], summaries[False]
    assert lora["errors"] == [] and lora["fits"] is True
    assert 0.5 < lora["peak_memory_gib_per_device"] / base["peak_memory_gib_per_device"] < 1.5
    assert 0.5 < lora["step_time_s"] / base["step_time_s"] < 2.0


def test_a_failed_memory_prediction_is_an_error_not_a_fit(monkeypatch):
    """The meta pass raising: plan.json has no peak and no verdict, the error names what failed, and the
    console says NOT predicted (not 0.00 GiB ... fits)."""
    def broken(*_args, **_kwargs):
        raise RuntimeError("Attempting to broadcast a dimension of length 64")

    monkeypatch.setattr(report_module, "predict_memory", broken)
    cfg, plan = _plan("+parallel=tp", "mesh=[2]", "hardware=h100_sxm", "dry_run=true")
    text, summary = dry_run_report(cfg, plan, pictures_dir=None)
    assert summary["peak_memory_gib_per_device"] is None and summary["fits"] is None
    assert summary["memory_lower_bound_gib"] > 0
    assert summary["errors"] == ["memory: activations not predicted (RuntimeError: Attempting to broadcast a "
                                 "dimension of length 64)"]
    lines = "\n".join(summary_lines(summary))
    assert "peak memory NOT predicted" in lines and "prediction FAILED: memory" in lines and ": fits" not in lines
    assert "NOT checked: the peak is not predicted" in text


def test_a_dry_run_whose_prediction_fails_exits_1_naming_it(tmp_path):
    """Paddle's per-stage 3-D example: each stage's view shards only its own weight, so the meta pass's
    local shapes do not chain across the boundary (a limit of the planner, not of the layout, which
    trains: tests/dist/test_examples.py). The dry run prints the report and exits 1 naming the failure."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "trainer", "+examples=stages_dp_x_tp", "dry_run=true",
                           "tracking=none"],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "the dry run's prediction failed" in done.stderr and "activations not predicted (RuntimeError" in done.stderr
    assert "peak memory NOT predicted" in done.stdout and "GiB: fits" not in done.stdout
