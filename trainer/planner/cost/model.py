"""Predict a layout's optimizer-step time from the model's work and a calibration of the host.

    costs = unit_costs(cfg, plan, micro_batch=2)           # per pipeline unit: FLOPs, bytes, calls
    t = predict_step_time(cfg, plan, calibration, costs=costs)
    t.total_s, t.compute_s, t.bubble_s, t.comm_s["tp"]

* Work per pipeline unit (``tok_embeddings``, ``layers.0``, ..., ``output``) comes from one forward
  and backward of one micro-batch on the meta device, tensor-parallel parameters at their local
  shapes: every matmul's FLOPs (torch's own flop formulas; CPU flash attention by its two matmuls,
  halved when causal) and every other op's bytes read and written. Each call costs the
  calibration's per-call latency plus its size over the calibrated rate (:mod:`trainer.planner.calibration.probe`).
  Activation checkpointing adds a checkpointed block's forward again to its backward. With sequence
  parallelism a block's norms and residual adds run on the rank's 1/tp of the rows: the pass tells
  a pricer so (``where.share()``, :mod:`trainer.planner.cost.sequence`), forward and backward, and a
  hardware profile prices their bytes at that share (:mod:`trainer.planner.cost.device`).
* Communication per rank and step (:func:`trainer.planner.cost.comm.comm_ops`): Megatron tp all-reduces
  of activations, dp's gradient all-reduce or FSDP's all-gathers and reduce-scatters per FSDP
  unit, pp sends; each priced by the calibrated fit of its op and group size.
* The busiest pp rank's compute sets the pace; on workers sharing fewer CPU cores, the ranks'
  mean (a lighter stage gives its cores to the others, :func:`stage_span`). The pipeline bubble
  stretches it by ``1 / (1 - bubble)`` (:func:`parallel.pipeline.order.expected_bubble`), less
  when workers share fewer CPU cores (:func:`bubble_span`).
* Every call costs at least the calibrated framework latency (an op inside a module's forward
  and backward under autograd), and the optimizer step at least the calibrated time per tensor;
  DTensors (tp-placed parameters in every pass, FSDP's or tp's parameters in the optimizer) add
  their calibrated dispatch. All compute is scaled by the calibration's ``compute_efficiency``: a small
  decoder's measured forward + backward over what the fits predict for it.
* The step's work the parts above do not itemize (FSDP2's and replicate's gradient buffers,
  DTensor's redistributions, the loop's collectives and clipping): the calibration trains the same
  small decoder for real laid out as pure ddp, fsdp and tp over all the probe's workers and keeps
  each step's measured time over its prediction; a layout's prediction is scaled by those ratios,
  each to the share of the layout's degree in that family. Pipelined references (dp x pp2, and
  with tp2) measure a fixed cost per schedule action and per tp all-reduce of a pipelined stage,
  which a pipeline adds (:mod:`trainer.planner.cost.reference`).
* Overlap: none. On CPU, gloo's collectives and the compute share the same cores and FSDP2's
  prefetch buys little, so the prediction adds compute, bubble, communication and the optimizer
  step. (On GPUs with nccl this over-predicts FSDP and dp: a later calibration may fit an overlap.)
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from parallel.pipeline.order import expected_bubble
from parallel.plan.spec import ParallelPlan, unit_owner
from parallel.plan.split import layout_shares
from trainer.config.model_schema import MLPConfig
from trainer.config.schema import RunConfig
from trainer.models import loss_fn_for
from trainer.models.skeleton import meta_model
from trainer.planner.cost.calibration import Calibration
from trainer.planner.cost.comm import UnitParams, comm_ops, unit_params
from trainer.planner.cost.reference import rank_units, with_reference_costs
from trainer.planner.cost.sequence import _Enter, _mark_sequence_shards, _Where, sequence_share
from trainer.planner.memory.layout import checkpointed, core_recomputed
from trainer.planner.memory.meta_pass import (  # the memory model's meta-pass helpers
    AttentionKernel,
    _local_shapes,
    _over_the_row,
    flash_attention_for_cpu,
)

_FLASH_CPU = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: 1.0,
              torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 2.5}
ADAMW_OPS_PER_TENSOR = 12  # torch's single-tensor AdamW (CPU's default): lerp, mul, addcmul, sqrt, div, ...
ADAMW_BYTES_PER_PARAM = 4 * 9  # fp32 param, grad, two moments: read, and write three of them, plus clipping


@dataclass
class Work:
    """What one pass of one unit asks of a worker: matmul calls and FLOPs, other calls and bytes."""

    matmul_calls: int = 0
    matmul_flops: float = 0.0
    other_calls: int = 0
    other_bytes: float = 0.0

    def seconds(self, cal: Calibration, dtype: str) -> float:
        mm = cal.matmul.get(dtype) or cal.matmul["fp32"]
        ew = cal.elementwise
        # A call costs at least what an op pays inside a training step (modules, autograd), beyond
        # the raw op the compute probe times.
        return cal.compute_efficiency * (
            self.matmul_calls * max(mm.latency_s, cal.op_latency_s) + self.matmul_flops / mm.rate
            + self.other_calls * max(ew.latency_s, cal.op_latency_s) + self.other_bytes / ew.rate)


@dataclass
class UnitCost:
    forward: Work = field(default_factory=Work)
    backward: Work = field(default_factory=Work)
    # Of forward: the attention kernel's own work, which selective recomputation runs again in backward.
    core: Work = field(default_factory=Work)


class _Counter(TorchDispatchMode):
    """Adds every op to ``costs[unit()][phase()]``; views cost nothing."""

    def __init__(self, costs: dict[str, UnitCost], where) -> None:
        super().__init__()
        self.costs, self.where = costs, where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        unit, phase = self.where()
        work = getattr(self.costs[unit], phase)
        split = getattr(self.where, "split", None)  # a grid's or cube's block: the rank's share of each op
        if func in _FLASH_CPU:
            full, counted = flash_flops(func, args, kwargs)
            counted *= split(core=True) if split else 1.0
            work.matmul_calls += 2
            work.matmul_flops += counted
            if phase == "forward":
                core = self.costs[unit].core
                core.matmul_calls += 2
                core.matmul_flops += counted
        elif func.overloadpacket in flop_registry:
            work.matmul_calls += 1
            work.matmul_flops += flop_registry[func.overloadpacket](*args, **(kwargs or {}), out_val=out) * (
                split() if split else 1.0)
        elif not any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
            work.other_calls += 1
            work.other_bytes += sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out))
                                    if isinstance(t, torch.Tensor)) * (split() if split else 1.0)
        return out


def flash_flops(func, args, kwargs) -> tuple[float, float]:
    """``(the forward's FLOPs of full attention, the FLOPs this call does)`` of a flash attention op
    (:data:`_FLASH_CPU`): ``4 b h s_q s_k d`` forward, 2.5 times that backward (it recomputes the
    scores), half of either when causal."""
    forward = func.name().endswith("cpu")
    q, k = (args[0], args[1]) if forward else (args[1], args[2])
    causal = bool(kwargs.get("is_causal")) if kwargs else False
    causal = causal or any(a is True for a in args[3:])  # forward: args[4], backward: args[7]
    b, h, s, d = q.shape
    full = 4.0 * b * h * s * k.shape[-2] * d
    return full, full * _FLASH_CPU[func] * (0.5 if causal else 1.0)


def count_calls(fn) -> int:
    """The ops :class:`Work` counts (matmuls and non-view others) that running ``fn`` dispatches."""
    costs: dict[str, UnitCost] = defaultdict(UnitCost)
    with _Counter(costs, lambda: ("all", "forward")):
        fn()
    work = costs["all"].forward
    return work.matmul_calls + work.other_calls


def unit_costs(cfg: RunConfig, plan: ParallelPlan, micro_batch: int, *, model: nn.Module | None = None
               ) -> dict[str, UnitCost]:
    """Forward and backward work of every pipeline unit for one micro-batch of ``micro_batch``
    sequences at tp-local shapes. ``model``: the meta model to copy (built once by a planner)."""
    costs: dict[str, UnitCost] = defaultdict(UnitCost)
    model = unit_pass(cfg, plan, micro_batch, lambda where: _Counter(costs, where), model=model)
    return _spread_unhooked(dict(costs), plan, model)


def unit_pass(cfg: RunConfig, plan: ParallelPlan, micro_batch: int, mode, *, model: nn.Module | None = None
              ) -> nn.Module:
    """Run one forward and backward of a micro-batch of ``micro_batch`` sequences on the meta device,
    tp-placed parameters at their local shapes, under the dispatch mode ``mode(where)`` builds;
    ``where()`` names the pipeline unit and phase (forward, backward) each op belongs to. Returns
    the meta model it ran (a copy of ``model`` when given)."""
    model = copy.deepcopy(model if model is not None else meta_model(cfg.model))
    _local_shapes(model, plan)
    if cfg.train.precision == "bf16":
        model.to(torch.bfloat16)
    state = {"unit": plan.units[-1], "phase": "forward", "sharded": False}  # the loss belongs to the last unit
    modules = dict(model.named_modules())
    hooks = []
    for unit in plan.units:
        if unit in modules:
            hooks.append(modules[unit].register_forward_pre_hook(lambda *_, u=unit: state.update(unit=u) and None))
            hooks.append(modules[unit].register_forward_hook(
                lambda _m, _a, out, u=unit: _Enter.apply(out, lambda: state.update(unit=u))
                if isinstance(out, torch.Tensor) and out.requires_grad else None))
    hooks += _mark_sequence_shards(plan, modules, state)
    if isinstance(cfg.model, MLPConfig):  # regression: features in, predictions out
        x = torch.empty(micro_batch, cfg.model.in_features, device="meta")
        y = torch.empty(micro_batch, cfg.model.out_features, device="meta")
    else:
        # A cp rank's 1/cp of every row, its queries over the whole row in attention (the ring's kernels).
        x = torch.zeros(micro_batch, cfg.train.seq_len // plan.cp_size, dtype=torch.long, device="meta")
        y = torch.zeros(micro_batch, cfg.train.seq_len // plan.cp_size, dtype=torch.long, device="meta")
    where = _Where(state, sequence_share(plan), layout_shares(plan, model))
    with AttentionKernel(_over_the_row(flash_attention_for_cpu, plan)), mode(where):
        out = model(x)
        state["unit"] = plan.units[-1]
        loss = (loss_fn_for(cfg.model, chunk_tokens=cfg.train.loss_chunk_tokens)(out, y)
                if out.shape == y.shape or out.shape[:-1] == y.shape else out.sum())
        state["phase"] = "backward"
        loss.backward()
    for hook in hooks:
        hook.remove()
    return model


def _spread_unhooked(costs: dict[str, UnitCost], plan: ParallelPlan, model: nn.Module) -> dict[str, UnitCost]:
    """Units that are raw parameters (the mlp arch's ``w0``, ``w1``) have no hooks: their work, all
    counted on the last unit, is shared out by parameter count."""
    modules = dict(model.named_modules())
    raw = [u for u in plan.units if u not in modules]
    if not raw:
        return costs
    sizes = {u: model.get_parameter(u).numel() if u in raw else 0 for u in plan.units}
    pool, total = costs.pop(plan.units[-1], UnitCost()), sum(sizes[u] for u in raw)
    for unit in raw:
        share = sizes[unit] / total
        costs[unit] = UnitCost(*(Work(round(w.matmul_calls * share), w.matmul_flops * share,
                                      round(w.other_calls * share), w.other_bytes * share)
                                 for w in (pool.forward, pool.backward)))
    return costs


# --------------------------------------------------------------------- step time


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step: the busiest pp rank's compute, the pipeline's
    bubble, each mesh axis's communication and the optimizer step of the rank that waits most."""

    total_s: float
    compute_s: float
    bubble_s: float
    comm_s: dict[str, float]
    optimizer_s: float
    traffic: dict[str, float]  # bytes a rank sends per step, per mesh axis
    tokens_per_step: int
    overhead_s: float = 0.0  # the step's work the parts above do not itemize (trainer.planner.cost.reference)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.total_s if self.total_s > 0 else 0.0


def predict_step_time(cfg: RunConfig, plan: ParallelPlan, calibration: Calibration, *,
                      costs: dict[str, UnitCost] | None = None, model: nn.Module | None = None) -> StepTime:
    """The step time of ``cfg`` laid out as ``plan`` on the calibrated host. ``costs``: this
    layout's :func:`unit_costs` when a planner has them cached; ``model``: the meta model."""
    model = model if model is not None else meta_model(cfg.model)
    micro = cfg.micro_batch_size
    costs = costs if costs is not None else unit_costs(cfg, plan, micro, model=model)
    params = unit_params(plan, model)
    pp, t = plan.pipeline, cfg.train
    passes = t.grad_accum * (pp.num_microbatches if pp else 1)
    wrapped, cores = checkpointed(plan), core_recomputed(plan)
    busy = []
    placed = placed_params(plan, model)
    for held in rank_units(plan):
        per_pass = calibration.dtensor_linear_s * sum(placed.get(u, 0) for u in held)
        for unit in held:
            cost = costs.get(unit, UnitCost())
            forward = cost.forward.seconds(calibration, t.precision)
            per_pass += forward * (2 if unit in wrapped else 1) + cost.backward.seconds(calibration, t.precision)
            if unit in cores:  # selective: the attention kernel's forward runs again in backward
                per_pass += cost.core.seconds(calibration, t.precision)
        busy.append(per_pass * passes)
    bubble = expected_bubble(pp.schedule, pp_size=plan.pp_size, stages_per_rank=pp.stages_per_rank,
                             microbatches=pp.num_microbatches) if pp else 0.0
    compute = stage_span(busy, calibration)
    span = bubble_span(compute, bubble, calibration)
    _, comm, optimizer, traffic = worst_wait(cfg, plan, calibration, params, micro)
    itemized = span + sum(comm.values()) + optimizer
    total = with_reference_costs(itemized, plan, calibration, t.grad_accum)
    return StepTime(total_s=total, compute_s=compute, bubble_s=span - compute, comm_s=comm, optimizer_s=optimizer,
                    traffic=traffic, tokens_per_step=t.global_batch_size * t.seq_len, overhead_s=total - itemized)


def placed_params(plan: ParallelPlan, model: nn.Module | None = None) -> dict[str, int]:
    """Per pipeline unit: its parameters the plan places (tp): DTensors in forward and backward,
    each costing about one Linear's DTensor dispatch per pass (``Calibration.dtensor_linear_s``). With the
    ``model``, a grid's or cube's too (its Linears and norms, placed by their own code: parallel.plan.split)."""
    out: dict[str, int] = defaultdict(int)
    if model is not None and (shares := layout_shares(plan, model)) is not None:
        owner = unit_owner(tuple(plan.units))
        for name in (*shares.linears, *shares.norms):
            if (unit := owner(name)) is not None:
                out[unit] += 1
    split = {a for a, size in zip(plan.mesh.dim_names, plan.mesh.shape) if size > 1}  # a planner asks per candidate
    owner = unit_owner(tuple(plan.units))
    for fqn, axes in plan.placements.items():
        if not split.isdisjoint(axes):
            if (unit := owner(fqn)) is not None:
                out[unit] += 1
    # Loss parallel's head, when tied: the plan places the weight under the embedding's name, but the head's
    # unit runs a DTensor Linear on its vocabulary shard too.
    for name, layout in plan.layouts.items():
        if any(p.is_shard and a in split for a, p in layout.output.items()):
            if (unit := owner(name)) is not None and not out.get(unit):
                out[unit] += 1
    return dict(out)


def _dtensor_params(plan: ParallelPlan) -> bool:
    """The optimizer steps DTensors: FSDP2 (any dp mode) or tp placed the parameters."""
    return plan.mesh.world_size > 1 and (plan.data_parallel is not None or bool(placed_params(plan))
                                         or plan.grid is not None or plan.cube is not None)


def stage_span(busy: list[float], calibration: Calibration) -> float:
    """The compute span of a step whose pp ranks are each busy ``busy[r]`` seconds (at the speed
    the calibration measured with all its workers running).

    On workers that each own a device, the busiest stage sets the pace: ``max(busy)``. Workers
    sharing fewer CPU cores: a lighter stage's ranks finish early and give their share of the cores
    to the busier ones, so the span is the ranks' mean work, unless the busiest stage's ranks
    (``workers / pp`` of them) cannot use all the cores they are then given (at most one each).
    Measured here (10M and 25M Llama, 8 workers on 2 cores): dp2 x pp4, whose busiest stage holds
    2 of 6 blocks and the embeddings, ran as fast as or faster than dp4 x pp2 and dp8, which the
    busiest stage's pace put 10-30% behind them."""
    workers, cores = calibration.workers, calibration.cores
    if len(busy) < 2 or not 0 < cores < workers:
        return max(busy)
    per_stage = max(1, workers // len(busy))  # the ranks of one stage: dp x tp replicas
    own_cores = cores * per_stage / workers  # the busiest stage's cores while every rank runs
    return max(sum(busy) / len(busy), max(busy) * own_cores / min(cores, per_stage))


def bubble_span(compute: float, bubble: float, calibration: Calibration) -> float:
    """The pipeline's span for a rank busy ``compute`` seconds with ``bubble`` of the span idle.

    On workers that each own a device, the idle share is lost: ``compute / (1 - bubble)``. Workers
    sharing fewer CPU cores (the calibration measured each one's speed with all of them busy) lose
    less: a rank waiting in the bubble gives its share of the cores to the others, so the span
    shrinks by the ratio of the cores' busy share, ``max(cores, runnable) / workers`` with
    ``runnable = workers * (1 - bubble)``; down to ``compute`` when the runnable ranks still
    outnumber the cores (measured here: pp4 over 8 workers on 2 cores ran at +10..+68% of the
    unshared bubble's prediction)."""
    if bubble >= 1:
        return math.inf
    span = compute / (1.0 - bubble)
    workers, cores = calibration.workers, calibration.cores
    if bubble > 0 and 0 < cores < workers:
        span *= max(cores, workers * (1.0 - bubble)) / workers
    return span


def worst_wait(cfg: RunConfig, plan: ParallelPlan, calibration: Calibration, params: UnitParams,
               micro: int) -> tuple[float, dict[str, float], float, dict[str, float]]:
    """``(seconds, comm seconds per axis, optimizer seconds, bytes sent per axis)`` of the pp rank
    that spends the longest outside compute: communicating (no overlap) and in its optimizer step."""
    dp = plan.param_data_parallel  # cp ranks shard the optimizer state as dp ranks
    shard = plan.mesh.size(dp.shard_dim_names) if dp else 1
    waits = []
    for held in rank_units(plan):
        comm: dict[str, float] = defaultdict(float)
        traffic: dict[str, float] = defaultdict(float)
        for op in comm_ops(cfg, plan, held, params, micro):
            comm[op.axis] += op.seconds(calibration)
            traffic[op.axis] += op.sent_bytes
        numel, tensors = sum(params[u][0] for u in held), sum(params[u][1] for u in held)
        framework = calibration.optimizer_dtensor_tensor_s if _dtensor_params(plan) else calibration.optimizer_tensor_s
        per_tensor = max(ADAMW_OPS_PER_TENSOR * calibration.elementwise.latency_s, framework)
        optimizer = tensors * per_tensor + numel / shard * ADAMW_BYTES_PER_PARAM / calibration.elementwise.rate
        waits.append((sum(comm.values()) + optimizer, dict(comm), optimizer, dict(traffic)))
    return max(waits, key=lambda w: w[0])


def lower_bound_s(cfg: RunConfig, plan: ParallelPlan, calibration: Calibration, params: UnitParams,
                  flops_per_sequence: float) -> float:
    """A step time :func:`predict_step_time` can never undercut, without a meta pass: the whole
    model's matmul FLOPs for the global batch (``flops_per_sequence``: forward and backward of one
    unsplit sequence) shared perfectly by every rank at the full matmul rate, stretched by the
    bubble, plus the communication and optimizer step, which need no pass."""
    pp, t = plan.pipeline, cfg.train
    rate = (calibration.matmul.get(t.precision) or calibration.matmul["fp32"]).rate
    compute = calibration.compute_efficiency * flops_per_sequence * t.global_batch_size / plan.mesh.world_size / rate
    bubble = expected_bubble(pp.schedule, pp_size=plan.pp_size, stages_per_rank=pp.stages_per_rank,
                             microbatches=pp.num_microbatches) if pp else 0.0
    itemized = bubble_span(compute, bubble, calibration) + worst_wait(cfg, plan, calibration, params,
                                                                      cfg.micro_batch_size)[0]
    return with_reference_costs(itemized, plan, calibration, t.grad_accum)
