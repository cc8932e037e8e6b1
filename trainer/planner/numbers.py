"""What each rank of a plan holds, from the resolved plan and the model on the meta device: the
parameters after pipeline split, tensor-parallel and data-parallel sharding, their bytes with
gradients and AdamW state, the pipeline bubble and the bytes each rank sends per step on every
mesh axis (analytic, ring algorithms). The dry run prints them, the memory model starts from them.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace

from parallel.config import ParallelConfig
from parallel.pipeline.order import expected_bubble
from parallel.placements import PlacementSpec
from parallel.plan.resolve import resolve_plan
from parallel.plan.held import layout_placements
from parallel.plan.spec import ParallelPlan
from parallel.sharding.adapters import adapter_placements
from trainer.config.schema import RunConfig
from trainer.models import decoder_config
from parallel.plan.traffic import layout_traffic
from trainer.models.skeleton import meta_model

MIB, GIB = 2**20, 2**30
BYTES = 4  # fp32 master weights, gradients and AdamW state


@dataclass(frozen=True)
class RankHoldings:
    """What one pp rank holds: its stages, its tp-local parameter count, and the bytes (dp-sharded)
    of its fp32 weights, gradients and AdamW moments (the last two of the parameters that train:
    with LoRA, the adapters only)."""

    pp_rank: int
    stages: list[int]
    params: int
    param_bytes: float
    grad_bytes: float
    optim_bytes: float
    expert_bytes: float = 0.0  # of the three above, the experts' (a mixture of experts: its weights, grads, AdamW)
    expert_params: int = 0  # of ``params``, the experts' (after ep, before dp sharding)

    @property
    def state_bytes(self) -> float:
        """Weights + gradients + AdamW: the lower bound of the rank's memory."""
        return self.param_bytes + self.grad_bytes + self.optim_bytes


@dataclass(frozen=True)
class PlanNumbers:
    """A plan's arithmetic: parameters per stage, where the stages begin, what each pp rank holds,
    the pipeline bubble (fraction of the step) and the bytes sent per rank and step on each axis."""

    stage_params: list[int]
    boundaries: list[str]
    per_pp_rank: list[RankHoldings]
    bubble: float
    comm: dict[str, float]




def stage_views(cfg: RunConfig, plan: ParallelPlan) -> list[tuple[RunConfig, ParallelPlan]]:
    """Per-stage layouts (``parallel.pipeline.stages``): for each stage, the config and plan in
    which every stage has that stage's layout (mesh ``[stages, *its sub-mesh]``). Stage ``i``'s
    numbers in view ``i`` (parameters held, communication, memory) are the stage's own, so the
    uniform arithmetic serves both forms."""
    par = cfg.parallel
    pp = par.pipeline if par is not None else None
    if par is None or pp is None or pp.stages is None:
        raise ValueError("stage views are those of parallel.pipeline.stages, which this config does not set")
    model = meta_model(cfg.model)
    views = []
    for stage in pp.stages:
        view = ParallelConfig(dims=[pp.dim, *stage.dims], data_parallel=stage.data_parallel,
                              tensor_parallel=stage.tensor_parallel, placements=stage.placements, layouts=stage.layouts,
                              context_parallel=stage.context_parallel, expert_parallel=stage.expert_parallel,
                              pipeline=pp.model_copy(update={"stages": None}),
                              activation_checkpointing=par.activation_checkpointing,
                              activation_checkpointing_every=par.activation_checkpointing_every)
        view_cfg = cfg.model_copy(update={"mesh": [len(pp.stages), *stage.shape], "parallel": view})
        views.append((view_cfg, resolve_plan(view, view_cfg.mesh, model)))
    return views


_PARAMETERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ADAPTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def parameter_list(model) -> list[tuple[str, int, bool]]:
    """``(fqn, numel, trainable)`` of every parameter of ``model``, listed once per model: a planner
    asks for them thousands of times, and walking the module tree each time dominated its search."""
    if model not in _PARAMETERS:
        _PARAMETERS[model] = [(fqn, p.numel(), p.requires_grad) for fqn, p in model.named_parameters()]
    return _PARAMETERS[model]


_UNITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _units_of(model, units: tuple[str, ...]) -> dict[str, str]:
    """``{parameter FQN: its unit}`` for ``model`` cut into ``units`` (:meth:`ParallelPlan.unit_of` of each),
    kept per model: a planner asks it of thousands of plans that share a handful of unit lists."""
    known = _UNITS.setdefault(model, {})
    if units not in known:
        known[units] = ParallelPlan(units=units).units_of([fqn for fqn, _, _ in parameter_list(model)])
    return known[units]


def held_placements(model, plan: ParallelPlan) -> Mapping[str, Mapping[str, PlacementSpec]]:
    """``plan.placements`` (base weights only) with LoRA's adapters as the tp styles shard them
    (:func:`parallel.sharding.adapters.adapter_placements`): what a rank's tp-local shapes follow."""
    if model not in _ADAPTED:  # asked per candidate by a planner: the module walk once per model
        _ADAPTED[model] = any(name.endswith(".lora_A") for name, _ in model.named_modules())
    if not _ADAPTED[model]:
        return plan.placements
    return {**plan.placements, **adapter_placements(model, plan.placements)}


def plan_numbers(cfg: RunConfig, plan: ParallelPlan, *, model=None) -> PlanNumbers:
    """What each pp rank holds, the bubble and the traffic per axis. ``model``: the config's model
    on the meta device when the caller has it (a planner builds it once), else built here."""
    if plan.pipeline is not None and plan.pipeline.stages:
        return _stage_numbers(cfg, plan)

    model = model if model is not None else meta_model(cfg.model)
    units = list(plan.units)
    pp = plan.pipeline
    num_stages = pp.num_stages if pp else 1
    groups, owner = (pp.stage_units, pp.stage_ranks) if pp else ([units], [0])
    stage_of = {unit: s for s, group in enumerate(groups) for unit in group}
    bounds = pp.boundaries if pp else []

    # The topology's divisors: tp (and ep for an expert) cut a parameter into blocks; FSDP shards a block over
    # the dp axes (and cp; hsdp: its inner one; ddp: none), and a parameter beside the experts over ep too.
    topology = plan.topology
    stage_params = [0] * num_stages
    stage_local = [0.0] * num_stages
    stage_sharded = [0.0] * num_stages
    stage_trainable = [0.0] * num_stages  # frozen weights (LoRA's base) have no gradient nor AdamW state
    stage_experts = [0.0] * num_stages  # the experts' weights + gradients + AdamW moments, in parameters
    stage_expert_local = [0.0] * num_stages
    # the grid's or cube's blocks as they hold them (the meta pass runs them whole: held_placements alone)
    placements = {**held_placements(model, plan), **layout_placements(plan, model)}
    unit_of = _units_of(model, plan.units)
    parameters = parameter_list(model)
    holdings = topology.holdings([fqn for fqn, _, _ in parameters], placements)  # one table, computed in parallel/
    for fqn, numel, trainable in parameters:
        tp_div, dp_div, expert = holdings[fqn]
        s = stage_of[unit_of[fqn]]
        stage_params[s] += numel
        stage_local[s] += numel / tp_div
        stage_sharded[s] += numel / tp_div / dp_div
        stage_trainable[s] += numel / tp_div / dp_div if trainable else 0.0
        if expert:
            stage_experts[s] += numel / tp_div / dp_div * (4 if trainable else 1)
            stage_expert_local[s] += numel / tp_div

    spr = pp.stages_per_rank if pp else 1
    per_rank = []
    for r in range(cfg.pp_size):
        stages = [s for s in range(num_stages) if owner[s] == r]
        local = sum(stage_local[s] for s in stages)
        sharded = sum(stage_sharded[s] for s in stages)  # weights, gradients and each AdamW moment
        trained = sum(stage_trainable[s] for s in stages)
        per_rank.append(RankHoldings(pp_rank=r, stages=stages, params=int(local), param_bytes=sharded * BYTES,
                                     grad_bytes=trained * BYTES,
                                     optim_bytes=2 * trained * BYTES / topology.optimizer_divisor,
                                     expert_bytes=sum(stage_experts[s] for s in stages) * BYTES,
                                     expert_params=int(sum(stage_expert_local[s] for s in stages))))

    m = cfg.num_microbatches
    # (p-1)/(m+p-1), over v for interleaving; the zero-bubble schedules' own (parallel.pipeline.order).
    bubble = expected_bubble(pp.schedule, pp_size=cfg.pp_size, stages_per_rank=spr, microbatches=m) if pp else 0.0
    comm = _comm_bytes(cfg, plan, per_rank, model)
    return PlanNumbers(stage_params=stage_params, boundaries=bounds, per_pp_rank=per_rank, bubble=bubble, comm=comm)


def _stage_numbers(cfg: RunConfig, plan: ParallelPlan) -> PlanNumbers:
    """:func:`plan_numbers` of per-stage layouts: each stage's row from its own view; the
    communication per axis named ``stage <i> <axis>``."""
    views = [plan_numbers(view_cfg, view_plan) for view_cfg, view_plan in stage_views(cfg, plan)]
    assert plan.pipeline is not None, "per-stage layouts are a pipeline's"
    pp_dim, comm = plan.pipeline.dim, {}
    for index, numbers in enumerate(views):
        comm.update({f"stage {index} {axis}": nbytes for axis, nbytes in numbers.comm.items() if axis != pp_dim})
        comm[pp_dim] = numbers.comm.get(pp_dim, 0.0)
    return replace(views[0], per_pp_rank=[numbers.per_pp_rank[i] for i, numbers in enumerate(views)], comm=comm)


def kv_bytes(cfg: RunConfig, plan: ParallelPlan, decoder, rows: int, elem: int) -> float:
    """Bytes of K and V (and their gradients) each cp rank sends per step, K/V in ``elem`` bytes: per
    layer, its K/V block (its tokens, its tp share of the kv heads). The ring passes a block one hop at
    each of ``cp - 1`` steps in forward and again in backward, where each block's gradient (fp32)
    travels with it and takes one more hop home (``cp`` hops); the all-gather sends its block to the
    ``cp - 1`` others in forward and their gradients back in the reduce-scatter; a checkpointed block's
    recomputed forward sends its K/V again. A pipeline rank does it for its stages' layers only."""
    cp = plan.cp_size
    tp = plan.topology.size(plan.placement_axes)  # each axis the placements name, once
    block = 2 * rows * (cfg.train.seq_len // cp) * decoder.num_kv_heads / tp * decoder.head_width
    # A checkpointed block's forward runs again in backward, and its ring (or all-gather) with it.
    ac, blocks = plan.activation_checkpointing, max(1, len(plan.blocks))
    recomputed = (1.0 if ac == "full" else (blocks // plan.activation_checkpointing_every) / blocks
                  if ac == "selective" else 0.0)
    hops = (2 + recomputed) * (cp - 1) * block * elem
    if plan.context_parallel is not None and plan.context_parallel.method == "ring":
        hops += cp * block * 4
    return decoder.n_layers / cfg.pp_size * hops


def _comm_bytes(cfg: RunConfig, plan: ParallelPlan, per_rank: list[RankHoldings], model) -> dict[str, float]:
    """Bytes each rank sends per optimizer step on each mesh axis (ring collectives); ``model`` on the meta
    device (the grid's and cube's formulas read its Linears)."""
    par = cfg.parallel
    out: dict[str, float] = {}
    if par is None:
        return out
    local = max(r.params for r in per_rank) * BYTES
    cp = plan.cp_size
    if dp := plan.param_data_parallel:  # the cp ranks reduce gradients (and gather parameters) with the dp ranks
        n = plan.mesh.size(dp.dim_names)
        ring = 2 * (n - 1) / n
        # ddp: all-reduce of grads; fsdp: all-gather fwd + all-gather bwd + reduce-scatter;
        # zero2: one all-gather + reduce-scatter; zero1: ddp's all-reduce + the updated parameters' all-gather;
        # each all-gather/reduce-scatter moves (n-1)/n.
        factor = {"ddp": ring, "zero1": ring + (n - 1) / n, "fsdp": 3 * (n - 1) / n, "zero2": 2 * (n - 1) / n,
                  "hsdp": 3 * (n - 1) / n}[dp.mode]
        out[",".join(dp.dim_names)] = factor * local * cfg.train.grad_accum ** (dp.mode == "fsdp")
    elif (ep := plan.expert_parallel) is not None and (n := plan.mesh.size(ep.dim)) > 1:
        # ep alone splits the batch: the parameters beside the experts are replicated over it, gradients all-reduced.
        rest = max(r.params - r.expert_params for r in per_rank) * BYTES
        out[ep.dim] = 2 * (n - 1) / n * rest
    rows = cfg.train.global_batch_size // max(1, cfg.dp_size)
    tokens = rows * cfg.train.seq_len // cp  # a cp rank holds 1/cp of every row
    if (decoder := decoder_config(cfg.model)) is not None:
        elem = 2 if cfg.train.precision == "bf16" else BYTES  # activations in compute precision
        act = tokens * decoder.dim * elem
        layers_per_rank = decoder.n_layers / cfg.pp_size
        if par.context_parallel is not None and cp > 1:
            out[f"{par.context_parallel.dim} K/V"] = kv_bytes(cfg, plan, decoder, rows, elem)
        for axis in {a for axes in plan.placements.values() for a in axes}:
            n = cfg.axis_size(axis)
            # Megatron: 2 all-reduces per block forward and 2 backward.
            out[axis] = 4 * layers_per_rank * act * 2 * (n - 1) / n
        # 2-D / 2.5-D / 3-D: the grid's or cube's own collectives, per accumulation pass (parallel.plan.traffic)
        passes = cfg.train.grad_accum
        for axis, nbytes in layout_traffic(plan, model, tokens=tokens // passes, dtype_bytes=elem).items():
            out[axis] = out.get(axis, 0.0) + nbytes * passes
        if pp := par.pipeline:
            out[pp.dim] = 2 * act * pp.stages_per_rank  # activations forward + gradients backward
        if (ep_cfg := par.expert_parallel) is not None and decoder.moe is not None:
            n = cfg.axis_size(ep_cfg.dim)
            # Every token's top_k rows out to the experts' ranks and back, forward and backward (the
            # gradients retrace them): 4 all-to-alls per MoE block of this rank's stages, (n-1)/n of the
            # rows leaving the rank when routing is balanced.
            out[f"{ep_cfg.dim} all-to-all"] = 4 * layers_per_rank * act * decoder.moe.top_k * (n - 1) / n
    return out
