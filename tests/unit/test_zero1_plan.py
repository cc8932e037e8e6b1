"""The planner knows ``data_parallel.mode: zero1``: AdamW's state 1 / dp of the parameters', parameters and
gradients whole (as ddp's); its traffic ddp's all-reduce plus one all-gather of the updated parameters; the
dry run prices it and the auto-planner ranks it.

    python -m pytest tests/unit/test_zero1_plan.py -q
"""

from __future__ import annotations

import pytest

from parallel.plan.resolve import resolve_plan
from trainer.config.compose import compose_dict
from trainer.models import build_model
from trainer.planner.numbers import plan_numbers
from trainer.validate.checks import validate_config, validate_with_plan


def _rows(*overrides: str):
    cfg = validate_config(compose_dict(["model=gpt_debug", *overrides]))
    model = build_model(cfg.model, device="meta")
    numbers = plan_numbers(cfg, resolve_plan(cfg.parallel, cfg.mesh, model), model=model)
    return numbers, sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("dp", [2, 4])
def test_zero1_holds_ddps_weights_and_gradients_and_a_dp_share_of_adamw(dp):
    (zero1,), count = _rows("+parallel=zero1", f"mesh=[{dp}]")[0].per_pp_rank, _rows("mesh=[1]")[1]
    (ddp,), _ = _rows("+parallel=dp", f"mesh=[{dp}]")[0].per_pp_rank, None
    assert zero1.param_bytes == ddp.param_bytes == 4 * count
    assert zero1.grad_bytes == ddp.grad_bytes == 4 * count
    assert ddp.optim_bytes == 8 * count
    assert zero1.optim_bytes == 8 * count / dp


def test_zero1_beside_tp_and_pp_shards_only_adamw_over_dp():
    """3d [2, 2, 2] with mode zero1: each pp rank's weights and gradients are its tp-local stage, whole over dp
    (fsdp's are halved), AdamW 2 x weights / dp."""
    mode = "parallel.data_parallel.mode"
    zero1, _ = _rows("+parallel=3d", "mesh=[2,2,2]", f"{mode}=zero1")
    fsdp, _ = _rows("+parallel=3d", "mesh=[2,2,2]", f"{mode}=fsdp")
    for z, f in zip(zero1.per_pp_rank, fsdp.per_pp_rank, strict=True):
        assert z.param_bytes == pytest.approx(2 * f.param_bytes) and z.grad_bytes == z.param_bytes
        assert z.optim_bytes == pytest.approx(2 * z.param_bytes / 2) == pytest.approx(f.optim_bytes)


def test_zero1_sends_ddps_all_reduce_and_one_all_gather():
    """Per rank and step over dp (n = 4): ddp 2 (n-1)/n of the weights, zero1 3 (n-1)/n, zero2 2 (n-1)/n."""
    zero1, _ = _rows("+parallel=zero1", "mesh=[4]")
    ddp, _ = _rows("+parallel=dp", "mesh=[4]")
    zero2, _ = _rows("+parallel=zero2", "mesh=[4]")
    assert zero1.comm["dp"] == pytest.approx(1.5 * ddp.comm["dp"]) and ddp.comm["dp"] == pytest.approx(zero2.comm["dp"])


def test_the_dry_run_prices_zero1_below_ddp_by_the_adamw_it_sheds():
    from trainer.planner.report import plan_report

    reports = {}
    for preset in ("zero1", "dp"):
        cfg, plan = validate_with_plan(compose_dict(["model=gpt_debug", f"+parallel={preset}", "mesh=[2]",
                                                     "dry_run=true"]))
        (reports[preset],) = plan_report(cfg, plan)["memory"]
    zero1, ddp = reports["zero1"], reports["dp"]
    assert zero1["optim_bytes"] == ddp["optim_bytes"] / 2
    assert (zero1["param_bytes"], zero1["grad_bytes"]) == (ddp["param_bytes"], ddp["grad_bytes"])
    assert zero1["peak_bytes"] == pytest.approx(ddp["peak_bytes"] - ddp["optim_bytes"] / 2)


def test_the_auto_planner_ranks_zero1_among_the_default_modes():
    from parallel.config import AutoPlanConfig
    from tests.unit.test_auto_plan import CAL, NARROW
    from trainer.planner.auto.plan import plan_layouts

    assert "zero1" in AutoPlanConfig().data_parallel_modes
    narrow = [o for o in NARROW if "data_parallel_modes" not in o]
    raw = compose_dict(["+parallel=auto", "dry_run=true", "mesh=[2]", *narrow,
                        "+parallel.auto.data_parallel_modes=[ddp,zero1]"])
    labels = sorted(c.label for c in plan_layouts(raw, calibration=CAL).candidates)
    assert labels == ["dp2(ddp)", "dp2(zero1)", "pp2(1F1B, m2)", "tp2"]


def test_zero1_is_priced_one_all_reduce_a_step_under_accumulation():
    """grad_accum 4: ddp all-reduces every pass, zero1 once (its last pass) plus its all-gather."""
    from trainer.planner.cost.comm import _dp_ops

    counts = {}
    for preset in ("zero1", "dp"):
        cfg, plan = validate_with_plan(compose_dict(["model=gpt_debug", f"+parallel={preset}", "mesh=[2]",
                                                     "train.grad_accum=4", "dry_run=true"]))
        ops = _dp_ops(plan.param_data_parallel, plan, list(plan.units), {u: (10.0, 0, 0.0) for u in plan.units},
                      4, passes=cfg.train.grad_accum)
        counts[preset] = sorted((op.op, op.count) for op in ops)
    assert counts == {"zero1": [("all_gather", 1), ("all_reduce", 1)], "dp": [("all_reduce", 4)]}
