"""Context parallelism priced as it runs, against hand-computed values: memory per cp rank (the fused
ring keeps q, k, v, the output and a log-sum-exp per query, on a GPU profile as on CPU), the ring's
K/V bytes and the share of its hops the attention blocks leave exposed, the data-parallel traffic
with cp, and utilisation counting every cp rank's tokens.

    python -m pytest tests/unit/test_cp_pricing.py -q
"""

from __future__ import annotations

import pytest
import torch

from parallel.context import ring_alone
from trainer.config.compose import compose_dict
from trainer.planner.cost.comm import comm_ops, ring_exposed_s, unit_params
from trainer.planner.cost.device import predict_on_profile
from trainer.planner.cost.overlap import _ring_step_s
from trainer.planner.cost.speed import DeviceSpeed
from trainer.planner.cost.links import collective_seconds, group_link
from trainer.planner.memory.predict import predict_memory
from trainer.validate.checks import validate_with_plan

# gpt_small: dim 512, 8 layers, 8 heads of 64 (8 kv heads), ffn 1376; 64 rows of 512 tokens a step.
SMALL = ["model=gpt_small", "train.seq_len=512", "train.global_batch_size=64", "train.precision=bf16", "dry_run=true",
         "hardware=h100_sxm"]


def _plan(*overrides):
    return validate_with_plan(compose_dict([*SMALL, *overrides]))


def test_the_ring_saves_what_flash_attention_saves_for_its_own_tokens():
    """q, k, v and the output in bf16 and an fp32 log-sum-exp per query and head: for 2 rows, 8 heads
    of 64, 128 local tokens: 4 x 2*8*128*64*2 + 2*8*128*4 = 532,480 bytes, whatever the ring size."""
    for blocks in (2, 3, 8):
        q, k, v = (torch.empty(2, 8, 128, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        saved: dict[int, int] = {}

        def pack(t):
            saved[id(t.untyped_storage())] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            ring_alone(q.clone(), k.clone(), v.clone(), blocks=blocks, causal=True)
        assert sum(saved.values()) == 4 * 2 * 8 * 128 * 64 * 2 + 2 * 8 * 128 * 4


def test_a_cp_ranks_activations_are_its_share_of_the_rows_on_a_gpu_profile():
    """fsdp x cp [4, 2]: 16 rows a data-parallel group, each cp rank 256 of their 512 tokens, i.e.
    the tokens of fsdp [8]'s 8 whole rows: the same activations (within the rank's own positions'
    few bytes); cp 4 of 16 rows a group (fsdp x cp [2, 4], 32 a step): half of them."""
    no_cp = predict_memory(*_plan("+parallel=fsdp", "mesh=[8]"))[0]
    cp2 = predict_memory(*_plan("+parallel=fsdp_cp", "mesh=[4,2]"))[0]
    cp4 = predict_memory(*_plan("+parallel=fsdp_cp", "mesh=[2,4]", "train.global_batch_size=32"))[0]
    assert cp2.activations == pytest.approx(no_cp.activations, rel=0.01)
    assert cp4.activations == pytest.approx(cp2.activations / 2, rel=0.01)


def test_kv_bytes_per_hop_and_hops_per_step():
    """cp [2] x fsdp [4]: 16 rows of 256 local tokens, 8 kv heads of 64, bf16: a K/V block of
    2*16*256*8*64*2 = 8 MiB; per block pass 1 hop forward and 1 backward (cp - 1 each), its fp32
    gradients 2 hops (cp): over 8 blocks, 16 K/V hops and 16 gradient hops of 16 MiB."""
    cfg, plan = _plan("+parallel=fsdp_cp", "mesh=[4,2]")
    from trainer.models import build_model

    params = unit_params(plan, build_model(cfg.model, device="meta"))
    ops = {op.role: op for op in comm_ops(cfg, plan, list(plan.units), params, 16) if op.role}
    assert (ops["kv"].nbytes, ops["kv"].count) == (8 * 2**20, 16)
    assert (ops["kv_grad"].nbytes, ops["kv_grad"].count) == (16 * 2**20, 16)


def test_the_exposed_share_of_a_ring_by_hand():
    # cp 4, hops of 1 s, gradient hops of 2 s, a block's attention 0.5 s forward and 1.25 s backward:
    # forward 3 x (1 - 0.5); backward: the first step's K/V hop hides, the two middle steps' K/V and
    # gradient hops 2 x (3 - 1.25), the last step's gradient hop (2 - 1.25), then the hop home 2.
    assert ring_exposed_s(4, 1.0, 2.0, 0.5, 1.25) == (pytest.approx(1.5), pytest.approx(0 + 3.5 + 0.75 + 2))
    # Blocks long enough hide everything but the gradients' hop home.
    assert ring_exposed_s(4, 1.0, 2.0, 5.0, 5.0) == (0.0, 2.0)


def test_a_rings_exposed_seconds_on_the_profile():
    """The dry run's exposed cp seconds are, per block pass, ring_exposed_s of the hops on NVLink
    against a ring step's flash attention: 4 b h T^2 d / 2 FLOPs (T = 256 local tokens, b = 16 rows)
    at the profile's achieved attention rates, backward 2.5 times forward."""
    cfg, plan = _plan("+parallel=fsdp_cp", "mesh=[4,2]")
    step = predict_on_profile(cfg, plan, cfg.hardware)
    speed = DeviceSpeed.of(cfg.hardware, "bf16")
    flops = 4 * 16 * 8 * 256 * 256 * 64 / 2
    forward_s, backward_s = flops / speed.attention_flops[0], 2.5 * flops / speed.attention_flops[1]
    assert _ring_step_s(cfg, plan, 16, speed) == (pytest.approx(forward_s), pytest.approx(backward_s))
    link = group_link(plan.mesh.shape, plan.mesh.dim_names, ["cp"], 8)
    hop = collective_seconds(cfg.hardware, "send_recv", link, 8 * 2**20)
    grad_hop = collective_seconds(cfg.hardware, "send_recv", link, 16 * 2**20)
    forward, backward = ring_exposed_s(2, hop, grad_hop, forward_s, backward_s)
    assert step.exposed_s["cp"] == pytest.approx(8 * (forward + backward))
    assert step.exposed_s["cp"] < step.comm_s["cp"]


def test_fsdp_over_dp_x_cp_is_prefetched_as_fsdp_alone():
    """The same 8 ranks' parameter shards and the same tokens per rank: what FSDP leaves exposed over
    dp x cp is what it leaves over dp [8] (its last reduce-scatter), and AdamW runs on 1/8 of the model."""
    cp_cfg, cp = _plan("+parallel=fsdp_cp", "mesh=[4,2]")
    dp_cfg, dp = _plan("+parallel=fsdp", "mesh=[8]")
    with_cp = predict_on_profile(cp_cfg, cp, cp_cfg.hardware)
    without = predict_on_profile(dp_cfg, dp, dp_cfg.hardware)
    assert with_cp.exposed_s["dp,cp"] == pytest.approx(without.exposed_s["dp"])
    assert with_cp.exposed_s["dp,cp"] < with_cp.comm_s["dp,cp"] / 5
    assert with_cp.optimizer_s == pytest.approx(without.optimizer_s)


@pytest.mark.parametrize("preset,mesh", [("fsdp_cp", "[4,2]"), ("fsdp_cp", "[2,4]"), ("cp", "[16]")])
def test_model_flops_count_every_cp_ranks_tokens(preset, mesh):
    """6 N per token plus attention's 12 l h s, as one device counts them, whatever the cp size (cp 16
    prices the ring's received blocks as one call); utilisation is the tokens/s it reports."""
    one_cfg, one = _plan()
    cfg, plan = _plan(f"+parallel={preset}", f"mesh={mesh}", "launch.nnodes=2" if mesh == "[16]" else "launch.nnodes=1")
    c = one_cfg.model
    params = c.n_layers * (4 * c.dim * c.dim + 3 * c.dim * c.ffn_hidden_dim) + c.vocab_size * c.dim
    tokens = 64 * 512
    expected = 6 * params * tokens + 12 * c.n_layers * c.dim * 512 * tokens
    assert predict_on_profile(one_cfg, one, one_cfg.hardware).model_flops == pytest.approx(expected, rel=1e-6)
    step = predict_on_profile(cfg, plan, cfg.hardware)
    assert step.model_flops == pytest.approx(expected, rel=1e-6)
    per_token = expected / tokens
    assert step.model_flops_utilization == pytest.approx(
        step.tokens_per_s / plan.mesh.world_size * per_token / cfg.hardware.peak_flops("bf16"), rel=1e-6)


def test_a_merged_rings_pass_prices_the_steps_it_leaves_out(monkeypatch):
    """Past cp 8 the time model's pass runs the received blocks as one call and adds the other steps'
    launches and merges: within 5% of the pass that runs all 16 blocks (32 tokens each: launch-bound;
    measured: forward +0.01%, backward +2.8%, the merged block's gradient sums priced at its length)."""
    import trainer.planner.cost.device as device
    import trainer.planner.memory.meta_pass as meta_pass

    cfg, plan = _plan("+parallel=cp", "mesh=[16]", "launch.nnodes=2")
    speed = DeviceSpeed.of(cfg.hardware, "bf16")
    merged = device.device_unit_costs(cfg, plan, 64, speed)
    monkeypatch.setattr(meta_pass, "RING_BLOCKS_PRICED", 64)
    monkeypatch.setattr(device, "RING_BLOCKS_PRICED", 64)
    every = device.device_unit_costs(cfg, plan, 64, speed)
    for phase in ("forward_s", "backward_s"):
        a, b = (sum(getattr(c, phase) for c in costs.values()) for costs in (merged, every))
        assert b <= a <= 1.05 * b
    assert sum(c.model_flops for c in merged.values()) == pytest.approx(sum(c.model_flops for c in every.values()))


def test_hsdp_with_cp_is_prefetched_too():
    """hsdp [2, 2] x cp [2]: the shard collectives ride dp_shard x cp (joined), prefetched as FSDP's;
    only the last reduce-scatter and the replicate axis's all-reduce tail are exposed."""
    cfg, plan = _plan("+parallel=hsdp", "mesh=[2,2,2]", "parallel.dims=[dp_replicate,dp_shard,cp]",
                      "+parallel.context_parallel={dim: cp}")
    step = predict_on_profile(cfg, plan, cfg.hardware)
    key = "dp_replicate,dp_shard,cp"
    assert step.exposed_s[key] < step.comm_s["dp_shard,cp"] / 5
    assert "dp_shard,cp" not in step.exposed_s
