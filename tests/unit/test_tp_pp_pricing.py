"""Tensor and pipeline parallelism priced on a hardware profile, against hand-computed values:
tp's all-reduces, sequence parallelism's all-gather / reduce-scatter pairs, the 1F1B and
interleaved bubbles, and the data-parallel gathers and reduces of a pipelined stage.

    python -m pytest tests/unit/test_tp_pp_pricing.py -q
"""

from __future__ import annotations

import math

import pytest

from trainer.config.compose import compose_dict
from trainer.models import build_model
from trainer.planner.cost.comm import comm_ops, unit_params
from trainer.planner.cost.device import predict_on_profile
from trainer.planner.cost.overlap import pipelined_dp_exposed
from trainer.planner.cost.reference import rank_units
from trainer.validate.checks import validate_with_plan

# gpt_small: 8 blocks of dim 512; one node of 8 H100s.
BASE = ["model=gpt_small", "train.seq_len=512", "train.global_batch_size=64", "train.precision=bf16",
        "dry_run=true", "hardware=h100_sxm"]


def _plan(*overrides):
    return validate_with_plan(compose_dict([*BASE, *overrides]))


def _ring(cfg, op: str, g: int, nbytes: float) -> float:
    """NCCL's ring on NVLink by hand: 2(g-1) steps for all_reduce, g-1 for the others."""
    link = cfg.hardware.intra_node
    steps = 2 * (g - 1) if op == "all_reduce" else g - 1
    return steps * link.latency_us * 1e-6 + steps / g * nbytes / (link.bandwidth_gb_s * 1e9)


def _tp_ops(cfg, plan, role=""):
    """pp rank 0's collectives over tp: the blocks' (``role=""``) or loss parallel's embedding and head's ("vocab")."""
    params = unit_params(plan, build_model(cfg.model, device="meta"))
    return [op for op in comm_ops(cfg, plan, rank_units(plan)[0], params, cfg.micro_batch_size)
            if op.axis == "tp" and op.role == role]


def test_tp_all_reduces_are_priced_on_nvlink_and_exposed():
    """tp 4 x dp 2: four all-reduces of the micro-batch's activations per block (8 blocks), each on
    the critical path: the engine's tensor-parallel styles are synchronous (no async TP)."""
    cfg, plan = _plan("+parallel=2d", "mesh=[2,4]")
    (op,) = _tp_ops(cfg, plan)
    micro = cfg.micro_batch_size  # 64 sequences over dp 2: 32
    act = micro * 512 * 512 * 2  # sequences x tokens x dim x bf16
    assert (op.op, op.group_size, op.nbytes, op.count) == ("all_reduce", 4, act, 4 * 8)
    # loss parallel: the embedding's lookups summed in forward, the head's input gradient in backward
    (vocab,) = _tp_ops(cfg, plan, role="vocab")
    assert (vocab.op, vocab.group_size, vocab.nbytes, vocab.count) == ("all_reduce", 4, act, 2)
    step = predict_on_profile(cfg, plan, cfg.hardware)
    assert step.exposed_s["tp"] == pytest.approx(34 * _ring(cfg, "all_reduce", 4, act))
    assert step.comm_s["tp"] == pytest.approx(step.exposed_s["tp"])


def test_sequence_parallel_runs_a_gather_and_a_scatter_for_each_all_reduce():
    """With sequence parallelism each all-reduce becomes a reduce-scatter and an all-gather (four of
    each per block), plus the run's output gather and its input scatter's gathered gradient: on a
    ring the same bytes as the all-reduces, in twice the calls (twice the latency). Backward gathers
    each norm's output again (two per block: the projections keep only its shard)."""
    cfg, plan = _plan("+parallel=2d", "mesh=[2,4]", "parallel.tensor_parallel.sequence_parallel=true")
    ops = {op.op: op for op in _tp_ops(cfg, plan)}
    act = cfg.micro_batch_size * 512 * 512 * 2
    assert set(ops) == {"all_gather", "reduce_scatter"}
    assert (ops["all_gather"].nbytes, ops["all_gather"].count) == (act, 4 * 8 + 2 + 2 * 8)
    assert (ops["reduce_scatter"].nbytes, ops["reduce_scatter"].count) == (act, 4 * 8)
    step = predict_on_profile(cfg, plan, cfg.hardware)
    hand = (50 * _ring(cfg, "all_gather", 4, act) + 32 * _ring(cfg, "reduce_scatter", 4, act)
            + 2 * _ring(cfg, "all_reduce", 4, act))  # loss parallel's embedding and head, as without sp
    assert step.exposed_s["tp"] == pytest.approx(hand)
    plain_cfg, plain = _plan("+parallel=2d", "mesh=[2,4]")
    plain_tp = predict_on_profile(plain_cfg, plain, plain_cfg.hardware).exposed_s["tp"]
    # 32 all-reduces of 6 ring steps cost 32 gathers and 32 scatters of 3: the run's two gathers and
    # backward's 16 remain
    assert step.exposed_s["tp"] - plain_tp == pytest.approx(18 * _ring(cfg, "all_gather", 4, act), rel=1e-6)


def test_sequence_parallel_gathers_each_norms_output_again_in_backward():
    """tp 4 x pp 2, 1F1B over 4 micro-batches, 2 accumulation passes (micro-batch 64 / 8 = 8 sequences):
    pp rank 0 holds blocks 0-3, each with 2 sequence-parallel norms, so its backward gathers 4 x 2 x 4 x 2
    = 64 norm outputs again, beside the 4 x 4 x 8 = 128 gathers and 128 scatters of the blocks' tp
    collectives and the run's 2 x 8 edge gathers; each a micro-batch's activations, 8 x 512 x 512 bf16."""
    cfg, plan = _plan("+parallel=3d", "mesh=[1,2,4]", "parallel.tensor_parallel.sequence_parallel=true",
                      "parallel.pipeline.microbatches=4", "train.grad_accum=2")
    assert rank_units(plan)[0] == ["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3"]
    act = 8 * 512 * 512 * 2
    ops = {op.op: op for op in _tp_ops(cfg, plan)}
    assert (ops["all_gather"].nbytes, ops["all_gather"].count) == (act, 128 + 16 + 64)
    assert (ops["reduce_scatter"].nbytes, ops["reduce_scatter"].count) == (act, 128)
    # the embedding's forward sum, once per micro-batch (rank 1: the head's)
    (vocab,) = _tp_ops(cfg, plan, role="vocab")
    assert (vocab.op, vocab.nbytes, vocab.count) == ("all_reduce", act, 4 * 2)
    hand = (208 * _ring(cfg, "all_gather", 4, act) + 128 * _ring(cfg, "reduce_scatter", 4, act)
            + 8 * _ring(cfg, "all_reduce", 4, act))
    assert predict_on_profile(cfg, plan, cfg.hardware).exposed_s["tp"] == pytest.approx(hand)  # rank 1's the same


def test_full_checkpointing_runs_a_blocks_tp_collectives_again():
    cfg, plan = _plan("+parallel=2d", "mesh=[2,4]", "parallel.activation_checkpointing=full")
    (op,) = _tp_ops(cfg, plan)
    assert op.count == 6 * 8  # the recomputed forward's two all-reduces per block


@pytest.mark.parametrize("schedule,v", [("1F1B", 1), ("Interleaved1F1B", 2)])
def test_the_bubble_takes_the_chunks_each_rank_holds(schedule, v):
    """pp 4 with m = 8 micro-batches: 1F1B's bubble (p-1)/(m+p-1) = 3/11; interleaved with v = 2
    chunks per rank (p-1)/(v m+p-1) = 3/19, each rank holding v stages' units."""
    cfg, plan = _plan("+parallel=pp", "mesh=[4]", f"parallel.pipeline.schedule={schedule}",
                      "parallel.pipeline.microbatches=8", f"parallel.pipeline.stages_per_rank={v}")
    held = rank_units(plan)
    assert [len(plan.pipeline.stages_of(r)) for r in range(4)] == [v] * 4
    assert sorted(u for units in held for u in units) == sorted(plan.units)
    bubble = 3 / (v * 8 + 3)
    step = predict_on_profile(cfg, plan, cfg.hardware)
    # The fill and drain pass the other ranks at their own pace: the bubble is b / (1 - b) of their mean
    from trainer.planner.cost.device import device_unit_costs
    from trainer.planner.cost.speed import DeviceSpeed

    costs = device_unit_costs(cfg, plan, cfg.micro_batch_size, DeviceSpeed.of(cfg.hardware, "bf16"))
    busy = sorted(8 * sum(costs[u].forward_s + costs[u].backward_s for u in units if u in costs) for units in held)
    assert step.compute_s == pytest.approx(busy[-1])
    assert step.bubble_s == pytest.approx(bubble / (1 - bubble) * sum(busy[:-1]) / 3)
    assert step.bubble_s < step.compute_s * bubble / (1 - bubble)  # the head's rank is the busiest


def test_the_bubble_of_unequal_stages_passes_each_rank_at_its_pace():
    """1F1B over p = 3 ranks, m = 4: stages of 1, 1 and 2 s per micro-batch take (m-1) t_max + sum t_r
    = 3 x 2 + 4 = 10 s, busiest 8 s: 2 s of bubble, (p-1)/m = 1/2 of the other ranks' mean (4 s)."""
    from trainer.planner.cost.overlap import pipeline_bubble_s

    b = 2 / (4 + 2)
    assert pipeline_bubble_s([4.0, 4.0, 8.0], b) == pytest.approx(2.0)
    assert pipeline_bubble_s([8.0, 8.0, 8.0], b) == pytest.approx(8.0 * b / (1 - b))  # equal: the theory
    assert pipeline_bubble_s([8.0], 0.0) == 0.0


def test_a_pipelined_stages_reduce_hides_only_behind_the_drain():
    """Two ranks, one chunk each: rank 0 reduces after the last backward of all (exposed: 2.0 s);
    rank 1 finishes one backward (0.8 s) earlier, so 2.5 - 0.8 = 1.7 s of its reduce shows, less
    than rank 0's. The fill: rank 0's first forward (0.4 s) ends when its gathers do (1.0 s), rank
    1's starts then and ends at 1.4 s, against 0.8 s without gathers: 0.6 s more."""
    ranks = [(1.0, 0.3, 2.0), (1.0, 0.3, 2.5)]  # (gathers, largest gather, reduces)
    per_micro = [(0.4, 0.8), (0.4, 0.8)]  # (forward, backward) of one micro-batch
    assert pipelined_dp_exposed(ranks, per_micro, chunks=1) == pytest.approx(2.0 + 0.6)
    assert pipelined_dp_exposed(ranks, None, chunks=1) == pytest.approx(2.0)  # the lower bound: rank 0's reduce
    # Interleaved, two chunks: the drain's slack is one chunk's backward (0.4 s): rank 1 shows 2.1 s;
    # the fill runs chunks of 0.2 s: rank 0's ends at 1.0 s (its gathers), rank 1's at 1.2 s, against 0.4 s
    assert pipelined_dp_exposed(ranks, per_micro, chunks=2) == pytest.approx(2.1 + (1.2 - 0.4))
    # Gathers shorter than the first forward hide but for the first one
    assert pipelined_dp_exposed([(0.1, 0.1, 0.0)], [(0.4, 0.8)], chunks=1) == pytest.approx(0.1)


def test_a_3d_steps_dp_wait_is_what_the_pipeline_leaves_exposed():
    """dp 4 x pp 2 x tp 2 over two nodes: the dp axis's exposed seconds are
    :func:`pipelined_dp_exposed` of the ranks' collectives and passes, less than all of them."""
    cfg, plan = _plan("+parallel=3d", "launch.nnodes=2", "mesh=[4,2,2]")
    step = predict_on_profile(cfg, plan, cfg.hardware)
    assert 0 < step.exposed_s["dp"] < step.comm_s["dp"]
    assert math.isfinite(step.total_s)


def _shares(*overrides) -> dict[tuple[str, str], set[float]]:
    """``{(phase, op): shares seen}`` of the ops the blocks dispatch in a meta pass of ``overrides``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from trainer.planner.cost.model import unit_pass

    cfg, plan = _plan("train.global_batch_size=8", *overrides)
    seen: dict[tuple[str, str], set[float]] = {}

    class Record(TorchDispatchMode):
        def __init__(self, where):
            super().__init__()
            self.where = where

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            unit, phase = self.where()
            if unit in plan.blocks:
                seen.setdefault((phase, func.overloadpacket.__name__), set()).add(self.where.share())
            return out

    unit_pass(cfg, plan, 2, Record)
    return seen


def test_sequence_parallel_norms_and_residual_adds_run_on_a_quarter_of_the_rows():
    """tp 4 with sequence parallelism: the norms (pow, mean, rsqrt) and the residual adds work on the
    rank's sequence shard in forward and backward, priced at 1/4; attention and the MLP (matmuls,
    flash attention, SiLU) run on the gathered sequence: whole. Without it, everything whole."""
    seen = _shares("+parallel=tp", "mesh=[4]", "parallel.tensor_parallel.sequence_parallel=true")
    for phase in ("forward", "backward"):
        assert seen[(phase, "mm")] == {1.0}
        assert seen[(phase, "_scaled_dot_product_flash_attention_for_cpu" + ("_backward" if phase == "backward"
                                                                             else ""))] == {1.0}
        assert seen[(phase, "pow")] == {0.25}
        assert 0.25 in seen[(phase, "add")]  # the residual adds (rotary embedding's adds stay whole)
    assert seen[("forward", "rsqrt")] == seen[("forward", "mean")] == {0.25}
    # The gated unit's backward rebuilds SiLU and runs its backward (trainer.models.layers.swiglu).
    assert seen[("forward", "silu")] == seen[("backward", "silu")] == seen[("backward", "silu_backward")] == {1.0}
    plain = _shares("+parallel=tp", "mesh=[4]")
    assert set().union(*plain.values()) == {1.0}


@pytest.mark.parametrize("extra", [
    ["parallel.tensor_parallel.sequence_parallel=true"],
    ["parallel.pipeline.schedule=Interleaved1F1B", "parallel.pipeline.stages_per_rank=2",
     "parallel.data_parallel.mode=zero2"],
    ["parallel.data_parallel.mode=ddp", "parallel.activation_checkpointing=full"],
])
def test_the_lower_bound_stays_under_the_prediction_with_these_terms(extra):
    """The planner prunes by :func:`lower_bound_on_profile`: sequence parallelism, an interleaved
    pipeline's gathers and reduces, ddp in a pipeline must never push it above the prediction."""
    from test_device_cost import assert_the_bound_is_under_the_prediction

    assert_the_bound_is_under_the_prediction(*_plan("+parallel=3d", "launch.nnodes=2", "mesh=[4,2,2]", *extra))
