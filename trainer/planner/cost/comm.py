"""What a rank sends in one optimizer step, and what it costs on the calibrated host.

    params = unit_params(plan, model)                      # per pipeline unit: tp-local numel, tensors
    for op in comm_ops(cfg, plan, held=plan.units, params=params, micro_batch=2):
        op.axis, op.op, op.group_size, op.nbytes, op.count, op.seconds(calibration)

Megatron tp all-reduces of activations (with sequence parallelism, a reduce-scatter and an all-gather in
place of each, and in backward each norm's output gathered again; loss parallel's embedding and head one
each), dp's gradient all-reduce or FSDP's all-gathers and reduce-scatters per FSDP unit, pp sends, cp's K/V hops
(the ring's; ``role`` "kv" / "kv_grad", which :func:`ring_exposed_s` sets against the attention blocks they
overlap on a GPU profile) or all-gathers, ep's all-to-alls of the tokens routed to experts; each priced by the
calibrated fit of its op and group size (:meth:`trainer.planner.cost.calibration.Calibration.collective_time`).
:mod:`trainer.planner.cost.model` adds them to the step's compute (no overlap on CPU).
"""

from __future__ import annotations

from typing import NamedTuple

from torch import nn

from parallel.plan.held import layout_placements
from parallel.plan.spec import ParallelPlan
from trainer.config.schema import RunConfig
from trainer.models import decoder_config
from trainer.models.skeleton import meta_model
from trainer.planner.cost.calibration import Calibration
from parallel.plan.traffic import layout_calls, layout_traffic
from trainer.planner.memory.layout import checkpointed


_SPREAD = frozenset({"all_gather", "reduce_scatter", "all_to_all"})  # each rank sends (g - 1) / g of the buffer


class CommOp(NamedTuple):
    """One kind of collective a rank runs in a step: ``count`` calls of ``op`` over ``group_size``
    ranks of mesh axis ``axis`` (dp's axes joined by commas), each on a buffer of ``nbytes``. (A named
    tuple: a planner makes one per FSDP unit for every pp rank of thousands of candidates.)"""

    axis: str
    op: str
    group_size: int
    nbytes: float
    # Shadows tuple.count (a method) by design: the field is read as ``op.count`` everywhere.
    count: float  # type: ignore[assignment]  # a NamedTuple field named like tuple's method
    # "kv", "kv_grad": the cp ring's K/V hops and their gradients' (ring_exposed_s prices them);
    # "vocab": loss parallel's embedding and head
    role: str = ""

    @property
    def sent_bytes(self) -> float:
        """Bytes this rank sends in the step (ring algorithms), as the dry run's traffic counts them."""
        g = self.group_size
        share = 2 * (g - 1) / g if self.op == "all_reduce" else (g - 1) / g if self.op in _SPREAD else 1.0
        return share * self.nbytes * self.count

    def seconds(self, cal: Calibration) -> float:
        return self.count * cal.collective_time(self.op, self.group_size, self.nbytes)


# Per pipeline unit: (tp- and ep-local parameter count, parameter tensors, of which experts): unit_params.
UnitParams = dict[str, tuple[float, int, float]]


def unit_params(plan: ParallelPlan, model: nn.Module) -> UnitParams:
    """Per pipeline unit: ``(tp- and ep-local parameter count, parameter tensors, of which experts)``
    of one rank (experts split over ep: each rank holds 1/ep of them)."""
    out: dict[str, list] = {u: [0.0, 0, 0.0] for u in plan.units}
    topology = plan.topology
    placements = {**plan.placements, **layout_placements(plan, model)}  # the grid's or cube's blocks too
    for fqn, p in model.named_parameters():
        unit = plan.unit_of(fqn)
        expert = topology.is_expert(fqn)
        local = p.numel() / topology.local_divisor(fqn, placements.get(fqn, {}))
        out[unit][0] += local
        out[unit][1] += 1
        out[unit][2] += local if expert else 0.0
    return {u: (v[0], v[1], v[2]) for u, v in out.items()}


def comm_ops(cfg: RunConfig, plan: ParallelPlan, held: list[str], params: UnitParams,
             micro_batch: int) -> list[CommOp]:
    """The collectives of the pp rank holding units ``held`` in one optimizer step (see the module
    docstring); ``params``: :func:`unit_params`."""
    ops: list[CommOp] = []
    t, pp = cfg.train, plan.pipeline
    block_set = frozenset(plan.blocks)
    m = pp.num_microbatches if pp else 1
    cdt = 2 if t.precision == "bf16" else 4  # activations and gathered parameters in the compute dtype
    if (dp := plan.param_data_parallel) is not None:  # cp ranks shard and reduce parameters as dp ranks
        ops += _dp_ops(dp, plan, held, params, cdt, passes=t.grad_accum)
    elif (ep := plan.expert_parallel) is not None:  # ep alone: the rest replicated over it, gradients all-reduced
        rest = sum(params[u][0] - params[u][2] for u in held)
        ops.append(CommOp(ep.dim, "all_reduce", plan.mesh.size(ep.dim), 4.0 * rest, t.grad_accum))
    decoder = decoder_config(cfg.model)
    act = micro_batch * t.seq_len // plan.cp_size * (decoder.dim if decoder else 0) * cdt
    if (cp := plan.context_parallel) is not None and plan.cp_size > 1 and decoder is not None:
        blocks = [u for u in held if u in block_set]
        recomputed = len(checkpointed(plan) & set(blocks))  # a checkpointed block's forward runs its ring again
        ops += _kv_ops(cp, plan, decoder, micro_batch * t.seq_len // plan.cp_size, cdt,
                       layers=len(blocks) * m * t.grad_accum, forwards=(len(blocks) + recomputed) * m * t.grad_accum)
    tp_axes = sorted(plan.sharded_axes)
    blocks = [u for u in held if u in block_set]
    sp_axes = sequence_parallel_axes(plan)
    for axis in tp_axes:
        if (g := plan.mesh.size(axis)) > 1 and decoder is not None:
            count = tp_collectives(plan, blocks) * m * t.grad_accum
            if axis in sp_axes:  # each all-reduce's place taken by an all-gather and a reduce-scatter
                # Each stage's run of blocks gathers its output (forward) and its first block's scatter
                # of the input gathers the gradient (backward: DTensor's redistribute back to Replicate).
                runs = (pp.stages_per_rank if pp is not None else 1) * m * t.grad_accum if blocks else 0
                again = regathers(plan, blocks, axis) * m * t.grad_accum
                ops.append(CommOp(axis, "all_gather", g, act, count + 2 * runs + again))
                ops.append(CommOp(axis, "reduce_scatter", g, act, count))
            else:
                ops.append(CommOp(axis, "all_reduce", g, act, count))
            if (outside := vocab_parallel_reduces(plan, held, axis)) > 0:
                ops.append(CommOp(axis, "all_reduce", g, act, outside * m * t.grad_accum, role="vocab"))
    if (plan.grid is not None or plan.cube is not None) and blocks:
        ops += _layout_ops(cfg, plan, micro_batch * t.seq_len, cdt, passes=m * t.grad_accum)
    if pp is not None and plan.pp_size > 1:
        ops.append(CommOp(pp.dim, "send_recv", 2, act, 2 * pp.stages_per_rank * m * t.grad_accum))
    if (ep := plan.expert_parallel) is not None and decoder is not None and decoder.moe is not None:
        # Each MoE block sends its tokens' top_k rows out to the experts' ranks and back, forward and
        # backward (the gradients retrace them); a checkpointed block's forward twice.
        moe_blocks = sum(plan.unit_of(fqn) in held for fqn in ep.modules)
        count = (4 + 2 * (plan.activation_checkpointing == "full")) * moe_blocks * m * t.grad_accum
        ops.append(CommOp(ep.dim, "all_to_all", plan.mesh.size(ep.dim), act * decoder.moe.top_k, count))
    return [op for op in ops if op.count > 0 and op.group_size > 1]


def _layout_ops(cfg: RunConfig, plan: ParallelPlan, tokens: int, cdt: int, passes: int) -> list[CommOp]:
    """2-D / 2.5-D / 3-D tensor parallelism's collectives in ``passes`` forward and backward passes of ``tokens``
    token rows: :func:`parallel.plan.traffic.layout_traffic`'s bytes per axis, as gathers of one size
    (:func:`~parallel.plan.traffic.layout_calls` of them per pass) whose ring sends those bytes."""
    model = meta_model(cfg.model)
    calls = layout_calls(plan, model)
    ops = []
    for axis, sent in layout_traffic(plan, model, tokens=tokens, dtype_bytes=cdt).items():
        g = plan.mesh.size(axis.split(",")[0])
        ops.append(CommOp(axis, "all_gather", g, sent * g / (g - 1) / calls[axis], calls[axis] * passes))
    return ops


def _kv_ops(cp, plan: ParallelPlan, decoder, tokens: int, cdt: int, layers: int, forwards: int) -> list[CommOp]:
    """A cp rank's K/V traffic for ``layers`` block passes of ``tokens`` tokens (its share of the rows),
    ``forwards`` of them forward (a checkpointed block's twice): the ring sends its K/V block one hop at
    each of ``cp - 1`` steps in forward, again in backward, and the blocks' gradients (fp32) ``cp``
    hops; the all-gather gathers K/V in forward (a recomputed forward again) and reduce-scatters their
    gradients in backward."""
    tp = plan.mesh.size(sorted({a for axes in plan.placements.values() for a in axes}))
    g = plan.cp_size
    block = 2 * tokens * decoder.num_kv_heads / tp * decoder.head_width  # K and V elements
    if cp.method == "allgather":
        return [CommOp(cp.dim, "all_gather", g, g * block * cdt, forwards),
                CommOp(cp.dim, "reduce_scatter", g, g * block * cdt, layers)]
    return [CommOp(cp.dim, "send_recv", 2, block * cdt, (g - 1) * (forwards + layers), role="kv"),
            CommOp(cp.dim, "send_recv", 2, block * 4.0, g * layers, role="kv_grad")]


def ring_exposed_s(cp: int, hop_s: float, grad_hop_s: float, forward_s: float,
                   backward_s: float) -> tuple[float, float]:
    """``(forward, backward)`` seconds one block pass's ring leaves exposed (``hop_s``: one K/V hop;
    ``grad_hop_s``: one hop of their gradients; ``forward_s``, ``backward_s``: one block's attention,
    i.e. one ring step's, forward and backward). As :func:`parallel.context.ring.fused_ring` runs it:
    in forward each of the ``cp - 1`` hops travels while a block is computed; in backward the first
    step's compute hides a K/V hop, the middle ``cp - 2`` steps' a K/V hop and the last step's gradients
    together (one link, both ways at once), the last step's the gradients', and the gradients' last
    hop home waits with nothing to hide behind."""
    forward = (cp - 1) * max(0.0, hop_s - forward_s)
    backward = (max(0.0, hop_s - backward_s) + (cp - 2) * max(0.0, hop_s + grad_hop_s - backward_s)
                + max(0.0, grad_hop_s - backward_s) + grad_hop_s)
    return forward, backward


def tp_all_reduces_per_block(plan: ParallelPlan) -> int:
    """Megatron's activation all-reduces per block and micro-batch: attention's and the MLP's
    row-parallel outputs in forward, their column-parallel inputs' gradients in backward; a
    checkpointed block's forward runs twice."""
    return 4 + 2 * (plan.activation_checkpointing == "full")


def tp_collectives(plan: ParallelPlan, blocks: list[str]) -> int:
    """The tp collectives of one kind that ``blocks`` run per micro-batch: four per block (attention's
    and the MLP's row-parallel outputs in forward, their column-parallel inputs' gradients in
    backward), two more for each block activation checkpointing wraps (its forward runs again).
    Without sequence parallelism each is an all-reduce; with it each all-reduce becomes a
    reduce-scatter of the row-parallel output into sequence shards and the next norm's all-gather
    back (forward), and in backward the gather's gradient is reduce-scattered and the scatter's
    gradient gathered: four all-gathers and four reduce-scatters per block, the same bytes on a ring
    as four all-reduces (each half of one) in twice the calls."""
    wrapped = checkpointed(plan)
    return sum(4 + 2 * (b in wrapped) for b in blocks)


def vocab_parallel_reduces(plan: ParallelPlan, held: list[str], axis: str) -> int:
    """The all-reduces over ``axis`` per micro-batch of the units outside the blocks in ``held`` whose weights
    the axis splits (loss parallel): the vocabulary-parallel input embedding's masked lookups summed in
    forward, the column-parallel output head's input gradient summed in backward (Megatron's count: one
    each). A head tied to the embedding shares the embedding unit's weight and is not counted again."""
    split = plan.units_placed_over(axis) - set(plan.blocks)  # kept per plan: asked for every candidate's pp ranks
    return sum(u in split for u in held)


def regathers(plan: ParallelPlan, blocks: list[str], axis: str) -> int:
    """The all-gathers backward adds per micro-batch over ``axis``: one per sequence-parallel norm of
    ``blocks``, whose gathered output the column-parallel projections keep as its shard and gather again
    when backward first needs it (:mod:`parallel.sharding.sequence_parallel`, Megatron's count). Priced
    with ``train.compile`` too, as the memory model counts the shard there: a compiled block keeps the
    gathered input instead (what torch.compile saves is not modelled), while the published Megatron rows
    that ``compile`` stands in for (its fused kernels) gather it again."""
    norms = [name for name, layout in plan.layouts.items() if (pl := layout.input.get(axis)) is not None
             and pl.is_shard]
    return sum(any(name.startswith(f"{block}.") for block in blocks) for name in norms)


def sequence_parallel_axes(plan: ParallelPlan) -> set[str]:
    """The mesh axes over which the plan runs the blocks' norms on sequence shards: a layout whose
    input is ``Shard`` on an axis of more than one rank (the engine's ``SequenceParallel``)."""
    return set(plan.sequence_parallel_axes)


def _dp_ops(dp, plan: ParallelPlan, held: list[str], params: dict, cdt: int, passes: int) -> list[CommOp]:
    """FSDP2's collectives per FSDP unit (every block, then the root with the rest), per
    accumulation pass; a pipeline stage gathers once per pass and reduces after its last
    micro-batch (torch's PipelineStage), as does ddp (FSDP2's replicate: one all-reduce)."""
    axis = ",".join(dp.dim_names)
    numel = [params[u][0] for u in held]
    if dp.mode in ("ddp", "zero1"):
        # zero1 without a pipeline reduces once a step, in the last accumulation pass (ParallelModel.forward_backward)
        reduces = 1 if dp.mode == "zero1" and plan.pipeline is None else passes
        ops = [CommOp(axis, "all_reduce", plan.mesh.size(dp.dim_names), 4.0 * sum(numel), reduces)]
        if dp.mode == "zero1":  # after the step, every rank's updated fp32 shard gathered back (once per step)
            ops.append(CommOp(axis, "all_gather", plan.mesh.size(dp.dim_names), 4.0 * sum(numel), 1))
        return ops
    shard_axis = ",".join(dp.shard_dim_names) if dp.mode == "hsdp" else axis
    g = plan.mesh.size(dp.shard_dim_names)
    gathers = 1 if dp.mode == "zero2" or plan.pipeline is not None else 2
    ops = []
    replicated = 0.0  # hsdp: the gradient bytes a rank all-reduces over the replicate axis (its shards' of each unit)
    if (ep := plan.expert_parallel) is not None:
        # Experts: FSDP units of their own over the dp shard axes (hsdp: its shard axis, the replicate axis above);
        # the rest over those x ep (the ep ranks hold other rows of the batch), as Topology.fsdp_axes wraps them.
        experts = [params[u][2] for u in held if params[u][2]]
        ops += [op for n in experts for op in (CommOp(shard_axis, "all_gather", g, n * cdt, gathers * passes),
                                               CommOp(shard_axis, "reduce_scatter", g, n * 4.0, passes))]
        replicated += 4.0 * sum(experts) / g
        shard_axis, g = f"{shard_axis},{ep.dim}", g * plan.mesh.size(ep.dim)
    # asked of every unit held, for every pp rank of every candidate a planner prices
    block_set = frozenset(plan.blocks)
    fsdp_units = [params[u][0] - params[u][2] for u in held if u in block_set]
    fsdp_units.append(sum(params[u][0] - params[u][2] for u in held if u not in block_set))  # the root
    for index, n in enumerate(fsdp_units):
        root = index == len(fsdp_units) - 1  # stays gathered from forward to backward
        ops.append(CommOp(shard_axis, "all_gather", g, n * cdt, (1 if root else gathers) * passes))
        ops.append(CommOp(shard_axis, "reduce_scatter", g, n * 4.0, passes))
    replicated += 4.0 * sum(fsdp_units) / g
    if dp.mode == "hsdp":
        ops.append(CommOp(dp.dim_names[0], "all_reduce", plan.mesh.size(dp.dim_names[0]), replicated, passes))
    return [op for op in ops if op.nbytes > 0]
