"""trainer.planner.cost.device: a step priced on a hardware profile, with no GPU and no process group.

    python -m pytest tests/unit/test_device_cost.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from trainer.config.compose import compose_dict
from trainer.planner.cost.device import (
    _Pricer,
    lower_bound_on_profile,
    predict_on_profile,
)
from trainer.planner.cost.comm import unit_params
from trainer.planner.cost.links import collective_seconds, group_link
from trainer.planner.cost.speed import DeviceSpeed, wave_efficiency
from trainer.validate.checks import validate_with_plan

SMALL = ["model=gpt_small", "train.seq_len=512", "train.global_batch_size=64", "train.precision=bf16", "dry_run=true"]


def _plan(*overrides):
    return validate_with_plan(compose_dict([*SMALL, *overrides]))


def test_wave_quantisation_takes_the_best_tile():
    assert wave_efficiency(1, 128, 128 * 132, 132) == 1.0  # 132 tiles of 128 x 128: one full wave
    # 129 x 129: four 128-tiles or six 64 x 128 tiles; the busier one fills 6 of 132 SMs in one wave
    assert wave_efficiency(1, 129, 129, 132) == pytest.approx(6 / 132)
    assert wave_efficiency(1, 8192, 8192, 132) > 0.95


def test_a_small_gemm_costs_its_fixed_time_once_in_any_precision():
    """A decoder's tiny GEMM (2048 x 64 x 64: 16.8 MFLOP) in fp32 on an H100: its FLOPs' time at the fp32
    rate stretched by its waves, plus the size curve's fixed time (a time: the same in fp32 as in bf16),
    not the fixed time stretched by the waves and by the fp32 rate (283 us / 0.24 = 1.2 ms before)."""
    cfg, _ = _plan("hardware=h100_sxm")
    fp32, bf16 = DeviceSpeed.of(cfg.hardware, "fp32"), DeviceSpeed.of(cfg.hardware, "bf16")
    assert fp32.matmul_fixed_s == bf16.matmul_fixed_s == pytest.approx(15e9 / (989.5e12 * 0.79))
    flops, wave = 2 * 2048 * 64 * 64, wave_efficiency(1, 2048, 64, 132)
    assert wave == pytest.approx(32 / 132)  # the best tile: 32 of 64 x 128 on 132 SMs, one wave
    by_hand = flops / (67e12 * 0.79 * wave) + 15e9 / (989.5e12 * 0.79)  # 1.3 us + 19.2 us
    assert fp32.matmul_s(flops, 0.0, lambda sms: wave) == pytest.approx(by_hand)
    assert 20e-6 < by_hand < 25e-6
    # a GEMM too small for its fixed time still pays the kernel floor, not more
    assert bf16.matmul_s(1.0, 0.0, lambda sms: 1.0) == pytest.approx(max(bf16.matmul_fixed_s, 11.1e-6))


def test_the_optimizer_step_costs_its_bytes_or_one_kernel_per_foreach_op():
    cfg, _ = _plan("hardware=h100_sxm")
    speed = DeviceSpeed.of(cfg.hardware, "bf16")
    assert speed.optimizer_s(1e9) == pytest.approx(1e9 * 92 / (3350e9 * 0.88))  # 31 ms: memory-bound
    assert speed.optimizer_s(1e3) == pytest.approx(10 * 11.1e-6)  # a tiny model: 10 foreach kernels


def test_a_matmul_costs_its_roofline_and_an_elementwise_op_its_bytes():
    cfg, _ = _plan("hardware=h100_sxm")
    speed = DeviceSpeed.of(cfg.hardware, "bf16")
    costs: dict = {}
    from collections import defaultdict

    from trainer.planner.cost.device import DeviceCost

    costs = defaultdict(DeviceCost)
    a = torch.empty(4096, 4096, device="meta", dtype=torch.bfloat16)
    with _Pricer(costs, speed, lambda: ("u", "forward")):
        torch.mm(a, a)
        a.add(a)
    flops = 2 * 4096**3
    wave = wave_efficiency(1, 4096, 4096, cfg.hardware.sm_count)
    # the size curve's fixed time: 15 GFLOP at the bf16 GEMM rate the sweep measured it at (19.2 us on an H100)
    fixed = cfg.hardware.achieved.matmul_half_gflop * 1e9 / speed.matmul_flops
    assert fixed == pytest.approx(15e9 / (989.5e12 * 0.79))
    mm = max(flops / (speed.matmul_flops * wave) + fixed, 3 * 4096**2 * 2 / speed.memory_bytes)
    add = 3 * 4096**2 * 2 / speed.memory_bytes
    assert costs["u"].forward_s == pytest.approx(mm + add)
    assert costs["u"].forward_flops == flops
    assert speed.matmul_flops == pytest.approx(cfg.hardware.peak_flops("bf16") * cfg.hardware.achieved.matmul)


def test_tp_inside_a_node_is_cheaper_than_across_nodes():
    """16 ranks: tp innermost on 2 nodes of 8 rides NVLink; tp outermost on 8 nodes of 2 crosses the
    network at every step, and on 2 nodes of 8 half of it does (hierarchical)."""
    inner_cfg, inner = _plan("hardware=h100_sxm", "launch.nnodes=2", "mesh=[2,8]", "+parallel=2d")
    outer_cfg, outer = _plan("hardware=h100_sxm", "launch.nnodes=8", "mesh=[8,2]", "+parallel=2d",
                             "parallel.dims=[tp,dp]")
    half_cfg, half = _plan("hardware=h100_sxm", "launch.nnodes=2", "mesh=[8,2]", "+parallel=2d",
                           "parallel.dims=[tp,dp]")
    assert group_link(inner.mesh.shape, inner.mesh.dim_names, ["tp"], 8).kind == "intra"
    assert group_link(outer.mesh.shape, outer.mesh.dim_names, ["tp"], 2).kind == "inter"
    assert group_link(half.mesh.shape, half.mesh.dim_names, ["tp"], 8).kind == "hierarchical"
    between = predict_on_profile(half_cfg, half, half_cfg.hardware)
    fast = predict_on_profile(inner_cfg, inner, inner_cfg.hardware)
    slow = predict_on_profile(outer_cfg, outer, outer_cfg.hardware)
    assert slow.exposed_s["tp"] > between.exposed_s["tp"] > fast.exposed_s["tp"] > 0
    assert slow.exposed_s["tp"] > 3 * fast.exposed_s["tp"]
    assert slow.compute_s == pytest.approx(fast.compute_s)  # the same work per rank


def test_fsdp_hides_its_collectives_behind_compute_and_a_pipeline_only_behind_its_fill_and_drain():
    cfg, plan = _plan("hardware=h100_sxm", "launch.nnodes=2", "mesh=[16]", "+parallel=fsdp")
    step = predict_on_profile(cfg, plan, cfg.hardware)
    assert 0 < step.exposed_s["dp"] < step.comm_s["dp"]
    piped_cfg, piped = _plan("hardware=h100_sxm", "launch.nnodes=2", "mesh=[4,2,2]", "+parallel=3d")
    piped_step = predict_on_profile(piped_cfg, piped, piped_cfg.hardware)
    # pp rank 0 reduces its stage's gradients after the step's last backward: all of it waits
    from trainer.models import build_model
    from trainer.planner.cost.comm import comm_ops
    from trainer.planner.cost.reference import rank_units

    params = unit_params(piped, build_model(piped_cfg.model, device="meta"))
    link = group_link(piped.mesh.shape, piped.mesh.dim_names, ["dp"], 8)
    first = [op for op in comm_ops(piped_cfg, piped, rank_units(piped)[0], params, piped_cfg.micro_batch_size)
             if op.axis == "dp"]
    reduce = sum(collective_seconds(piped_cfg.hardware, op.op, link, op.nbytes) * op.count for op in first
                 if op.op == "reduce_scatter")
    assert reduce <= piped_step.exposed_s["dp"] < piped_step.comm_s["dp"]
    assert piped_step.bubble_s > 0
    # The fill and drain wait for 2 (pp - 1) sends; the rest hide behind other micro-batches
    assert 0 < piped_step.exposed_s["pp"] < piped_step.comm_s["pp"]


@pytest.mark.parametrize("preset,mesh", [("fsdp", "[16]"), ("2d", "[2,8]"), ("3d", "[4,2,2]"), ("dp", "[16]")])
def test_the_lower_bound_never_exceeds_the_prediction(preset, mesh):
    assert_the_bound_is_under_the_prediction(*_plan("hardware=a100_80g", "launch.nnodes=2", f"mesh={mesh}",
                                                    f"+parallel={preset}"))


def assert_the_bound_is_under_the_prediction(cfg, plan) -> None:
    """The planner prunes by :func:`lower_bound_on_profile`: it must never exceed the prediction."""
    from parallel.plan.spec import ParallelPlan
    from trainer.models import build_model
    from trainer.planner.cost.model import unit_costs

    model = build_model(cfg.model, device="meta")
    one = ParallelPlan(units=plan.units, blocks=plan.blocks)
    flops = sum(c.forward.matmul_flops + c.backward.matmul_flops for c in unit_costs(cfg, one, 1, model=model).values())
    bound = lower_bound_on_profile(cfg, plan, cfg.hardware, unit_params(plan, model), flops)
    step = predict_on_profile(cfg, plan, cfg.hardware, model=model)
    assert 0 < bound <= step.total_s


def test_model_flops_count_every_rank_once():
    """The step's model FLOPs are the same whatever the layout: 6 N per token plus attention's
    12 l h s, the count utilisation is quoted in (causal or not, recomputation excluded)."""
    one_cfg, one = _plan("hardware=h100_sxm")
    tp_cfg, tp = _plan("hardware=h100_sxm", "mesh=[4,2]", "+parallel=2d")
    a = predict_on_profile(one_cfg, one, one_cfg.hardware).model_flops
    b = predict_on_profile(tp_cfg, tp, tp_cfg.hardware).model_flops
    assert b == pytest.approx(a, rel=1e-6)
    c = one_cfg.model
    params = c.n_layers * (4 * c.dim * c.dim + 3 * c.dim * c.ffn_hidden_dim) + c.vocab_size * c.dim  # matmul weights
    tokens = one_cfg.train.global_batch_size * one_cfg.train.seq_len
    attention = 12 * c.n_layers * c.dim * one_cfg.train.seq_len * tokens
    assert a == pytest.approx(6 * params * tokens + attention, rel=1e-6)


def test_collectives_on_links_follow_the_ring():
    cfg, _ = _plan("hardware=h100_sxm")
    link = group_link((8,), ("tp",), ["tp"], 8)
    nbytes = 2**30
    seconds = collective_seconds(cfg.hardware, "all_reduce", link, nbytes)
    ring = 2 * 7 / 8 * nbytes / (cfg.hardware.intra_node.bandwidth_gb_s * 1e9)
    assert ring <= seconds <= ring * 1.05 + 2 * 7 * cfg.hardware.intra_node.latency_us * 1e-6 + 1e-6
    assert math.isfinite(seconds)
