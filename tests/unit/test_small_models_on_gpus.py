"""Small models on GPU profiles are priced by the kernels' fixed costs, once each: a smaller model is
never predicted slower than a larger one of the same family and layout.

Before, gpt_debug (214K parameters) was predicted 8x slower per step than gpt_small (25.6M) on one
H100 (0.823 s against 0.102 s): the GEMM size curve's fixed cost was counted in FLOPs at the fp32 rate
and stretched again by the wave quantisation, 1-3 ms for a GEMM a GPU runs in ~20 us.

    python -m pytest tests/unit/test_small_models_on_gpus.py -q
"""

from __future__ import annotations

import pytest

from trainer.config.compose import compose_dict
from trainer.planner.forecast.plan_file import dry_run_report
from trainer.validate.checks import validate_with_plan


def _predict(*overrides: str) -> dict:
    cfg, plan = validate_with_plan(compose_dict([*overrides, "hardware=h100_sxm", "launch.nnodes=1", "dry_run=true",
                                                 "tracking.pictures=false"]))
    return dry_run_report(cfg, plan, pictures_dir=None)[1]


@pytest.mark.parametrize("layout", [[], ["+parallel=fsdp", "mesh=[8]"]])
def test_a_smaller_model_is_predicted_faster(layout):
    debug, small = _predict("model=gpt_debug", *layout), _predict("model=gpt_small", *layout)
    assert debug["step_time_s"] < small["step_time_s"]
    # gpt_debug's step is its kernels' fixed cost: ~1,050 ops of one micro-batch (all of the batch on one
    # device), each at least achieved.kernel_us = 11.1 us, so between ~8 and ~25 ms; not 0.8 s
    if not layout:
        assert 5e-3 < debug["step_time_s"] < 25e-3


def test_the_planning_docs_gpu_example_has_a_sane_utilisation():
    """docs/planning.md's one-node example: gpt_small in bf16 over fsdp [8], 256 x 512 tokens a step.
    A 25.6M model's GEMMs are small (1-2 GFLOP), so well below a large model's 40-50%, but not 0.0%."""
    plan = _predict("+parallel=fsdp", "mesh=[8]", "model=gpt_small", "train.global_batch_size=256", "train.seq_len=512",
                    "train.precision=bf16")
    assert 0.05 < plan["model_flops_utilization"] < 0.5
    assert plan["tokens_per_s_per_device"] > 100_000
