"""trainer.planner.cost.model: work per unit, communication per axis, bubble and checkpointing, on a hand-made
calibration."""

from __future__ import annotations

import pytest

from trainer.config.compose import compose_dict
from trainer.models import build_model
from trainer.planner.cost.calibration import Calibration, Fit
from trainer.planner.cost.comm import comm_ops, unit_params
from trainer.planner.cost.model import predict_step_time, unit_costs
from trainer.validate.checks import validate_with_plan

CAL = Calibration(host="h", device="cpu:test", workers=4, matmul={"fp32": Fit(1e-5, 1e10), "bf16": Fit(1e-5, 2e10)},
                  elementwise=Fit(2e-6, 5e9),
                  collectives={op: {2: Fit(1e-4, 1e9), 4: Fit(2e-4, 1e9)}
                               for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv")})


def _plan(*overrides):
    return validate_with_plan(compose_dict(["dry_run=true", "train.global_batch_size=8", *overrides]))


def test_doubling_tp_halves_a_blocks_matmul_flops():
    cfg1, plan1 = _plan("+parallel=tp", "mesh=[1]")
    cfg2, plan2 = _plan("+parallel=tp", "mesh=[2]")
    one = unit_costs(cfg1, plan1, 2)["layers.0"]
    two = unit_costs(cfg2, plan2, 2)["layers.0"]
    assert two.forward.matmul_flops == pytest.approx(one.forward.matmul_flops / 2)
    assert two.backward.matmul_flops == pytest.approx(one.backward.matmul_flops / 2)
    # 7 projections and attention's two matmuls forward; backward twice each (input and weight gradients)
    assert (one.forward.matmul_calls, one.backward.matmul_calls) == (9, 16)
    # the head is column-parallel under loss parallel (the default): half its matmul on each of 2 ranks; off, whole
    head = {key: unit_costs(cfg, plan, 2)["output"].forward.matmul_flops for key, (cfg, plan) in (
        ("one", (cfg1, plan1)), ("two", (cfg2, plan2)),
        ("off", _plan("+parallel=tp", "mesh=[2]", "parallel.tensor_parallel.loss_parallel=false")))}
    assert head["two"] == head["one"] / 2 and head["off"] == head["one"]


def test_a_linear_layers_flops_are_2mkn():
    cfg, plan = _plan()
    out = unit_costs(cfg, plan, 2)["output"]
    tokens = 2 * cfg.train.seq_len
    assert out.forward.matmul_flops == 2 * tokens * cfg.model.dim * cfg.model.vocab_size
    assert out.backward.matmul_flops == 2 * out.forward.matmul_flops


def test_pipeline_adds_the_bubble():
    cfg, plan = _plan("+parallel=pp", "mesh=[2]", "parallel.pipeline.microbatches=2")
    t = predict_step_time(cfg, plan, CAL)
    bubble = 1 / 3  # (p-1)/(m+p-1) for p = m = 2
    assert t.bubble_s == pytest.approx(t.compute_s * bubble / (1 - bubble))
    assert t.total_s == pytest.approx(t.compute_s + t.bubble_s + sum(t.comm_s.values()) + t.optimizer_s)
    assert set(t.comm_s) == {"pp"}


def test_shared_cores_fill_the_bubble_and_even_out_the_stages():
    from dataclasses import replace

    from trainer.planner.cost.model import stage_span

    cfg, plan = _plan("+parallel=pp", "mesh=[2]", "parallel.pipeline.microbatches=2")
    own = predict_step_time(cfg, plan, replace(CAL, workers=2, cores=0))
    # 2 workers on 1 core: 4/3 runnable on average, more than the core: the bubble costs nothing, and
    # the lighter stage's rank gives the core to the busier one: the span is the two ranks' mean work
    one_core = predict_step_time(cfg, plan, replace(CAL, workers=2, cores=1))
    assert one_core.bubble_s == pytest.approx(0.0, abs=1e-12)
    assert own.compute_s / 2 < one_core.compute_s < own.compute_s
    # 8 workers on 6 cores: 16/3 runnable; the span is compute / (1 - 1/3) * 6 / 8
    six = predict_step_time(cfg, plan, replace(CAL, workers=8, cores=6))
    assert six.compute_s + six.bubble_s == pytest.approx(six.compute_s * 1.5 * 6 / 8)
    # a device per worker: the busiest stage; shared cores: the mean, while its ranks can use them
    shared = replace(CAL, workers=8, cores=2)
    assert stage_span([3.0, 1.0], replace(CAL, workers=8, cores=0)) == 3.0
    assert stage_span([3.0, 1.0], shared) == pytest.approx(2.0)  # 4 ranks a stage, 2 cores
    assert stage_span([3.0], shared) == 3.0  # no pipeline
    # pp8: one rank a stage uses at most one core of the two, a quarter of it while all 8 run
    assert stage_span([8.0] + [0.0] * 7, shared) == pytest.approx(8.0 * 2 / 8)


def test_full_checkpointing_adds_one_forward_per_block():
    cfg, plan = _plan("+parallel=fsdp", "mesh=[2]")
    cfg_ac, plan_ac = _plan("+parallel=fsdp", "mesh=[2]", "+parallel.activation_checkpointing=full")
    costs = unit_costs(cfg, plan, cfg.micro_batch_size)
    extra = sum(costs[b].forward.seconds(CAL, "fp32") for b in plan.blocks)
    assert predict_step_time(cfg_ac, plan_ac, CAL).compute_s == pytest.approx(
        predict_step_time(cfg, plan, CAL).compute_s + extra)


def test_fsdp_sends_one_and_a_half_times_ddps_gradient_bytes_per_block():
    cfg_ddp, plan_ddp = _plan("+parallel=dp", "mesh=[2]")
    cfg_fsdp, plan_fsdp = _plan("+parallel=fsdp", "mesh=[2]")
    params = unit_params(plan_fsdp, build_model(cfg_fsdp.model, device="meta"))
    units = list(plan_fsdp.units)
    ddp = comm_ops(cfg_ddp, plan_ddp, units, params, 8)
    fsdp = comm_ops(cfg_fsdp, plan_fsdp, units, params, 8)
    total = sum(n for n, *_ in params.values())
    assert [(op.op, op.nbytes, op.count) for op in ddp] == [("all_reduce", 4 * total, 1)]
    assert sum(op.sent_bytes for op in ddp) == pytest.approx(4 * total)  # 2 (g-1)/g = 1 for g = 2
    block = params["layers.0"][0] * 4
    gathers = [op for op in fsdp if op.op == "all_gather" and op.nbytes == block]
    assert len(gathers) == len(plan_fsdp.blocks) and all(op.count == 2 for op in gathers)  # forward and backward
    # per block: two all-gathers and a reduce-scatter, each sending half: 1.5x ddp's all-reduce of it
    block_sent = sum(op.sent_bytes for op in fsdp if op.nbytes == block)
    assert block_sent == pytest.approx(1.5 * block * len(plan_fsdp.blocks))


def test_tp_all_reduces_activations_four_times_per_block_and_microbatch():
    """Four per block; loss parallel adds one for the vocabulary-parallel embedding (its lookups summed in
    forward) and one for the column-parallel head (its input gradient summed in backward)."""
    cfg, plan = _plan("+parallel=tp", "mesh=[2]")
    params = unit_params(plan, build_model(cfg.model, device="meta"))
    blocks, outside = comm_ops(cfg, plan, list(plan.units), params, cfg.micro_batch_size)
    for op in (blocks, outside):
        assert (op.axis, op.op, op.group_size) == ("tp", "all_reduce", 2)
        assert op.nbytes == 8 * cfg.train.seq_len * cfg.model.dim * 4
    assert blocks.count == 4 * cfg.model.n_layers
    assert outside.count == 2  # tok_embeddings, output
    # a pp rank holding only blocks and the head: the head's one
    (_, head) = comm_ops(cfg, plan, [*plan.blocks, "norm", "output"], params, cfg.micro_batch_size)
    assert head.count == 1
    t = predict_step_time(cfg, plan, CAL)
    assert t.comm_s["tp"] == pytest.approx((blocks.count + outside.count) * (1e-4 + blocks.nbytes / 1e9))


def test_dtensor_dispatch_is_paid_per_placed_parameter_and_pass():
    from dataclasses import replace

    from trainer.planner.cost.model import placed_params

    cfg, plan = _plan("+parallel=tp", "mesh=[2]")
    placed = placed_params(plan)
    assert sum(placed.values()) > 0 and all(u in plan.units for u in placed)
    base = predict_step_time(cfg, plan, CAL)
    slow = predict_step_time(cfg, plan, replace(CAL, dtensor_linear_s=1e-3, optimizer_dtensor_tensor_s=0.0))
    assert slow.compute_s - base.compute_s == pytest.approx(1e-3 * sum(placed.values()))
    # one device: no DTensors, no dispatch
    cfg1, plan1 = _plan()
    assert placed_params(plan1) == {}


def test_reference_step_ratios_scale_each_family_to_the_share_of_its_degree():
    import math
    from dataclasses import replace

    from trainer.planner.cost.reference import layout_degrees, layout_efficiency

    cal = replace(CAL, workers=8, step_efficiency={"ddp": 1.5, "fsdp": 1.4, "tp": 2.0})
    cfg, plan = _plan("+parallel=3d", "mesh=[2,2,2]")  # dp2(fsdp) x pp2 x tp2
    assert layout_degrees(plan) == {"fsdp": 2, "tp": 2}
    # each family pays its ratio to the share log(degree) / log(8) of the reference's degree; pp none
    assert layout_efficiency(plan, cal) == pytest.approx(1.4 ** (1 / 3) * 2.0 ** (1 / 3))
    raw = predict_step_time(cfg, plan, CAL)  # no reference steps: nothing unitemized
    scaled = predict_step_time(cfg, plan, cal)
    assert raw.overhead_s == 0.0 and scaled.compute_s == pytest.approx(raw.compute_s)
    assert scaled.total_s == pytest.approx(raw.total_s * 1.4 ** (1 / 3) * 2.0 ** (1 / 3))
    assert scaled.overhead_s == pytest.approx(scaled.total_s - raw.total_s)
    # a layout using a family over all the reference's workers pays its whole ratio, no more beyond them
    _, dp8 = _plan("+parallel=dp", "mesh=[8]")
    assert layout_degrees(dp8) == {"ddp": 8} and layout_efficiency(dp8, cal) == pytest.approx(1.5)
    _, dp16 = _plan("+parallel=dp", "mesh=[16]", "train.global_batch_size=16")
    assert layout_efficiency(dp16, cal) == pytest.approx(1.5)
    _, pp2 = _plan("+parallel=pp", "mesh=[2]")
    assert layout_degrees(pp2) == {} and layout_efficiency(pp2, cal) == 1.0
    # a family the probe could not lay out (no ratio) costs nothing extra
    assert layout_efficiency(plan, replace(cal, step_efficiency={"tp": 2.0})) == pytest.approx(2.0 ** (1 / 3))
    assert math.isclose(layout_efficiency(plan, replace(cal, workers=1)), 1.0)


def test_a_pipeline_pays_a_cost_per_schedule_action_and_per_tp_all_reduce_of_its_stages():
    from dataclasses import replace

    from trainer.planner.cost.reference import pipeline_overhead_s, pipelined_tp_collectives, schedule_actions

    cal = replace(CAL, workers=8, schedule_action_s=0.01, pipelined_tp_collective_s=0.002)
    cfg, plan = _plan("+parallel=pp", "mesh=[2]", "parallel.pipeline.microbatches=4")
    assert schedule_actions(plan) == 8 and pipelined_tp_collectives(plan) == 0  # 4 forwards, 4 backwards
    raw = predict_step_time(cfg, plan, CAL)
    paid = predict_step_time(cfg, plan, cal)
    assert paid.total_s == pytest.approx(raw.total_s + 0.08) and paid.overhead_s == pytest.approx(0.08)
    assert paid.compute_s == raw.compute_s and paid.bubble_s == raw.bubble_s
    # with tp in the stages, each of the busiest stage's all-reduces too (4 per block and micro-batch;
    # 3d's pp2 holds 2 of the 4 blocks on a stage); accumulation runs the schedule again
    cfg3, plan3 = _plan("+parallel=3d", "mesh=[2,2,2]")
    blocks = max(sum(u in plan3.blocks for u in plan3.pipeline.stage_units[s]) for s in range(2))
    m = plan3.pipeline.num_microbatches
    assert pipelined_tp_collectives(plan3) == 4 * blocks * m
    assert pipeline_overhead_s(plan3, cal) == pytest.approx(2 * m * 0.01 + 4 * blocks * m * 0.002)
    assert pipeline_overhead_s(plan3, cal, grad_accum=2) == pytest.approx(2 * pipeline_overhead_s(plan3, cal))
    # interleaving doubles the actions and halves the blocks each one runs
    _, v2 = _plan("+parallel=3d", "mesh=[2,2,2]", "parallel.pipeline.schedule=Interleaved1F1B",
                  "parallel.pipeline.stages_per_rank=2")
    assert schedule_actions(v2) == 2 * schedule_actions(plan3)
    assert pipelined_tp_collectives(v2) == pipelined_tp_collectives(plan3)
    # a split backward (input and weight gradients) is three actions per micro-batch and stage
    _, zbv = _plan("+parallel=pp", "mesh=[2]", "parallel.pipeline.schedule=ZBV", "parallel.pipeline.stages_per_rank=2",
                   "parallel.pipeline.microbatches=4")
    assert schedule_actions(zbv) == 3 * 4 * 2
    # no pipeline: no actions, and tp's all-reduces pay only tp's ratio
    _, tp = _plan("+parallel=tp", "mesh=[2]")
    assert schedule_actions(tp) == 0 and pipeline_overhead_s(tp, cal) == 0.0


def test_the_lower_bound_stays_below_the_scaled_prediction():
    from dataclasses import replace

    from trainer.planner.cost.model import lower_bound_s

    cal = replace(CAL, workers=4, step_efficiency={"ddp": 1.5, "fsdp": 1.4, "tp": 2.0},
                  schedule_action_s=0.01, pipelined_tp_collective_s=0.002)
    for overrides in (["+parallel=dp", "mesh=[4]"], ["+parallel=tp", "mesh=[2]"], ["+parallel=3d", "mesh=[2,2,2]"]):
        cfg, plan = _plan(*overrides)
        model = build_model(cfg.model, device="meta")
        params = unit_params(plan, model)
        costs = unit_costs(cfg, plan, cfg.micro_batch_size, model=model)
        flops = sum(c.forward.matmul_flops + c.backward.matmul_flops for c in costs.values()) / cfg.micro_batch_size
        predicted = predict_step_time(cfg, plan, cal, costs=costs, model=model).total_s
        assert 0 < lower_bound_s(cfg, plan, cal, params, flops) <= predicted
