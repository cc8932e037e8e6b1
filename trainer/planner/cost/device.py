"""Predict a training step on a hardware profile: GPUs this host need not have (``hardware=h100_sxm``).

    speed = DeviceSpeed.of(profile, "bf16")
    costs = device_unit_costs(cfg, plan, micro_batch=1, speed=speed)   # per pipeline unit: seconds, FLOPs
    t = predict_on_profile(cfg, plan, profile, costs=costs)
    t.total_s, t.compute_s, t.bubble_s, t.comm_s["tp"], t.model_flops

Nothing here touches a GPU or starts a process: the model runs once on the meta device, at
tp-local shapes (:func:`trainer.planner.cost.model.unit_pass`), and every op it dispatches is
priced on the profile as it goes, at the achieved rates of
:class:`~trainer.planner.cost.speed.DeviceSpeed`:

* a matmul by a roofline, ``max(FLOPs / (peak x achieved x waves) + fixed, bytes / (HBM x achieved))``:
  ``achieved`` is the fraction of the datasheet's peak a large GEMM reaches (the profile's
  ``achieved.matmul``), ``fixed`` the time the size curve ``F / (F + F_half)`` of a sweep of decoder
  shapes amounts to (``achieved.matmul_half_gflop`` at the bf16 rate it was measured at: 19 us on an
  H100, in every precision), ``waves`` the wave quantisation of its output tiles over the SMs (a GEMM of
  ``tiles`` output tiles runs ``ceil(tiles / SMs)`` waves; the last one part-full), for the best of
  the tile shapes cuBLAS picks among, as NVIDIA's matmul performance guide describes;
* flash attention by its FLOPs (``4 b h s_q s_k d``, half when causal; backward 2.5 times forward:
  it recomputes the scores) at the profile's achieved attention fraction of peak;
* every other op by its bytes read and written at the achieved fraction of HBM bandwidth;
* each kernel at least ``achieved.kernel_s`` (launch and the eager framework's dispatch): a floor, not
  a sum, since the host dispatches the next op while the device runs this one; each fixed cost counted
  once, so a small model costs its kernels' count, never more than a larger one.

A step is the busiest pp rank's passes (a checkpointed block's forward twice) and the pipeline's
bubble (:func:`~trainer.planner.cost.overlap.pipeline_bubble_s`: the fill and drain at each stage's own pace), plus what
communication leaves exposed and the optimizer step (:mod:`trainer.planner.cost.overlap`):

* each collective of :func:`trainer.planner.cost.comm.comm_ops` is priced on the link its mesh
  axes ride (:mod:`trainer.planner.cost.links`: NVLink inside a node, the NICs across nodes,
  hierarchical for a group that spans both);
* tp's collectives sit on the critical path (exposed): the engine's tensor-parallel styles
  (``torch.distributed.tensor.parallel``, in eager and in the per-block ``torch.compile``) wait for
  each one before the next matmul; it has no async tensor parallelism (Inductor's
  ``_micro_pipeline_tp`` over symmetric memory, which would overlap them), so nothing hides them.
  With sequence parallelism each all-reduce is a reduce-scatter and an all-gather, and the blocks'
  norms and residual adds work on the rank's 1/tp of the rows (:func:`trainer.planner.cost.model.unit_pass`);
* FSDP2 prefetches its all-gathers and reduce-scatters behind compute: only what does not fit
  behind the passes' compute, plus the last unit's reduce, is exposed (ddp is FSDP2's replicate on
  the whole model, one unit: its one all-reduce comes after backward, all of it exposed). A pipelined
  stage gathers during its first micro-batch and reduces after its last backward (torch's
  ``PipelineStage.perform_reduce_grad``), which only the fill and the drain hide
  (:func:`~trainer.planner.cost.overlap.pipelined_dp_exposed`);
* pipeline sends and receives are asynchronous: in the steady state they hide behind other
  micro-batches' compute; the fill and the drain wait for ``2 (pp - 1)`` of them;
* the cp ring's K/V hops travel while the ring's attention blocks compute: only what a hop takes
  beyond its block's attention, and the K/V gradients' last hop home, are exposed
  (:func:`trainer.planner.cost.comm.ring_exposed_s`); FSDP over dp x cp is FSDP like any other;
  utilisation counts every cp rank's tokens;
* AdamW is memory-bound: :data:`~trainer.planner.cost.speed.ADAMW_FOREACH_BYTES_PER_PARAM` per local parameter at the
  achieved HBM bandwidth (torch's foreach implementation, the default on CUDA, passes over the lists
  once per op), and at least one kernel per foreach op (:data:`~trainer.planner.cost.speed.ADAMW_FOREACH_OPS`).
* ``train.compile=true`` (Inductor fuses each block's elementwise ops) leaves the profile's
  ``achieved.compiled_elementwise`` share of the elementwise time; matmuls and attention are unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from parallel.context import ring_alone
from parallel.pipeline.order import expected_bubble
from parallel.plan.spec import ParallelPlan
from parallel.plan.split import layout_shares
from trainer.config.hardware import HardwareProfile
from trainer.config.schema import RunConfig
from trainer.models import decoder_config
from trainer.models.skeleton import meta_model
from trainer.planner.cost.comm import UnitParams, unit_params
from trainer.planner.cost.model import _FLASH_CPU, StepTime, flash_flops, placed_params, unit_pass
from trainer.planner.cost.overlap import _waits, pipeline_bubble_s
from trainer.planner.cost.reference import rank_units
from trainer.planner.cost.speed import DeviceSpeed, wave_efficiency
from trainer.planner.memory.layout import checkpointed, core_recomputed
from trainer.planner.memory.meta_pass import RING_BLOCKS_PRICED

# Views their schemas do not mark as aliases: no kernel runs.
_FREE = {torch.ops.aten._unsafe_view, torch.ops.aten.lift_fresh}


@dataclass
class DeviceCost:
    """One pipeline unit's predicted seconds and matmul FLOPs for one micro-batch on one device."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    forward_flops: float = 0.0
    backward_flops: float = 0.0
    attention_flops: float = 0.0  # what the two lines above count for flash attention (causal half, recompute)
    attention_model_flops: float = 0.0  # the usual model count of it: 3 x its forward, causal or not
    causal_ring: bool = False  # the unit's attention is a causal cp ring (its model count: the own block's)
    core_forward_s: float = 0.0  # of forward_s: the attention kernel's, which selective recomputation runs twice

    @property
    def model_flops(self) -> float:
        """Forward and backward FLOPs as utilisation counts them (6 N per token, attention 12 l h s)."""
        return self.forward_flops + self.backward_flops - self.attention_flops + self.attention_model_flops


class _Pricer(TorchDispatchMode):
    """Adds every op's predicted seconds on ``speed`` to ``costs[unit]``; views cost nothing."""

    def __init__(self, costs: dict[str, DeviceCost], speed: DeviceSpeed, where, *, ring: int = 1) -> None:
        super().__init__()
        self.costs, self.speed, self.where = costs, speed, where
        self.ring = ring  # cp's ring size (1: none): see the model count below

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        unit, phase = self.where()
        cost, backward = self.costs[unit], phase == "backward"
        share = self.where.share() if hasattr(self.where, "share") else 1.0  # sequence parallel: 1/tp of the rows
        split = getattr(self.where, "split", None)  # a grid's or cube's block: the rank's share of every op
        if func in _FLASH_CPU:
            full, flops = flash_flops(func, args, kwargs)
            if split is not None:
                full, flops = full * split(core=True), flops * split(core=True)
            seconds = max(flops / self.speed.attention_flops[backward], self.speed.kernel_s)
            cost.attention_flops += flops
            if not backward:
                cost.attention_model_flops += 3 * self._model_count(cost, full, func, args, kwargs)
                cost.core_forward_s += seconds
        elif func.overloadpacket in flop_registry:
            part = split() if split is not None else 1.0
            flops = flop_registry[func.overloadpacket](*args, **(kwargs or {}), out_val=out) * part
            nbytes = _bytes(args, kwargs, out) * part
            shape = out.shape if isinstance(out, torch.Tensor) else (1, 1)
            batch, m, n = math.prod(shape[:-2]), (shape[-2] if len(shape) > 1 else 1), shape[-1]
            m = max(1, round(m * part))  # a grid's or cube's rank: its rows of the product (for the waves)
            seconds = self.speed.matmul_s(flops, nbytes, lambda sms: wave_efficiency(batch, m, n, sms))
        elif func.overloadpacket in _FREE:
            return out
        elif not any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
            flops, seconds = 0.0, self.speed.memory_s(_bytes(args, kwargs, out) * share * (split() if split else 1.0))
        else:
            return out
        if backward:
            cost.backward_s += seconds
            cost.backward_flops += flops
        else:
            cost.forward_s += seconds
            cost.forward_flops += flops
        return out

    def _model_count(self, cost: DeviceCost, full: float, func, args, kwargs) -> float:
        """Utilisation's count of a forward attention call: its FLOPs unmasked. Under a causal cp ring
        (the balanced split) the own block's call (causal) stands for the row, ``cp`` blocks of its
        square; the other blocks' calls (half their keys each, or merged) count in it."""
        if self.ring == 1:
            return full
        if flash_flops(func, args, kwargs)[1] < full:  # causal: the rank's own block
            cost.causal_ring = True
            return full * self.ring
        return 0.0 if cost.causal_ring else full


def _bytes(args, kwargs, out) -> float:
    return float(sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out))
                     if isinstance(t, torch.Tensor)))


def device_unit_costs(cfg: RunConfig, plan: ParallelPlan, micro_batch: int, speed: DeviceSpeed, *,
                      model: nn.Module | None = None) -> dict[str, DeviceCost]:
    """Per pipeline unit: predicted forward and backward seconds and FLOPs of one micro-batch."""
    costs: dict[str, DeviceCost] = defaultdict(DeviceCost)
    ring = plan.cp_size if plan.context_parallel is not None and plan.context_parallel.method == "ring" else 1
    unit_pass(cfg, plan, micro_batch, lambda where: _Pricer(costs, speed, where, ring=ring), model=model)
    if ring > RING_BLOCKS_PRICED:  # the pass merged the received blocks: their steps' own work added here
        forward, backward = _ring_steps_left_out(cfg, plan, micro_batch, speed)
        for cost in costs.values():
            if cost.attention_flops:  # a block: one attention, one ring
                cost.forward_s += forward
                cost.backward_s += backward
    return dict(costs)


def _ring_steps_left_out(cfg: RunConfig, plan: ParallelPlan, micro: int, speed: DeviceSpeed) -> tuple[float, float]:
    """``(forward, backward)`` seconds of what the pass's merged ring (:data:`RING_BLOCKS_PRICED`) leaves
    out of one block's ring: ``cp - 2`` received steps' launches and merges (their FLOPs are in the
    merged call). One step's: a ring of 3 blocks less a ring of 2, priced on the rank's q, k, v with
    attention's FLOPs free (a kernel call still costs its launch)."""
    decoder = decoder_config(cfg.model)
    assert decoder is not None, "a cp ring runs in a decoder's attention"
    tp = plan.mesh.size(sorted({a for axes in plan.placements.values() for a in axes}))
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    tokens = cfg.train.seq_len // plan.cp_size
    free = dataclasses.replace(speed, attention_flops=(math.inf, math.inf))

    def priced(blocks: int) -> tuple[float, float]:
        costs: dict[str, DeviceCost] = defaultdict(DeviceCost)
        phase = ["forward"]
        q = torch.empty(micro, decoder.n_heads // tp, tokens, decoder.head_width, device="meta", dtype=dtype,
                        requires_grad=True)
        k, v = (torch.empty(micro, max(1, decoder.num_kv_heads // tp), tokens, decoder.head_width, device="meta",
                            dtype=dtype, requires_grad=True) for _ in range(2))
        with _Pricer(costs, free, lambda: ("ring", phase[0])):
            out = ring_alone(q, k, v, blocks=blocks, causal=True)
            phase[0] = "backward"
            out.backward(torch.empty_like(out))
        return costs["ring"].forward_s, costs["ring"].backward_s

    (f3, b3), (f2, b2) = priced(3), priced(2)  # a middle step: its block's hop on, its gradients' hop on
    steps = plan.cp_size - 2
    return steps * (f3 - f2), steps * (b3 - b2)


@dataclass(frozen=True)
class ProfileStep(StepTime):
    """:class:`StepTime` on a profile, with the FLOPs that make its utilisation."""

    model_flops: float = 0.0  # the step's model FLOPs over all devices (6 N per token + attention's 12 l h s)
    devices: int = 1
    peak_flops: float = 0.0  # one device's datasheet peak in the compute dtype
    exposed_s: dict[str, float] | None = None  # per axis: the communication left on the critical path

    @property
    def model_flops_utilization(self) -> float:
        return self.model_flops / (self.total_s * self.devices * self.peak_flops) if self.total_s > 0 else 0.0


def predict_on_profile(cfg: RunConfig, plan: ParallelPlan, profile: HardwareProfile, *,
                       costs: dict[str, DeviceCost] | None = None, model: nn.Module | None = None,
                       params: UnitParams | None = None) -> ProfileStep:
    """The step time of ``cfg`` laid out as ``plan`` on ``profile``'s devices (see the module
    docstring). ``costs``, ``params``: the layout's meta pass and :func:`unit_params`, when a
    planner has them cached."""
    model = model if model is not None else meta_model(cfg.model)
    t, pp = cfg.train, plan.pipeline
    micro = cfg.micro_batch_size
    speed = DeviceSpeed.of(profile, t.precision, compiled=t.compile)
    costs = costs if costs is not None else device_unit_costs(cfg, plan, micro, speed, model=model)
    passes = t.grad_accum * (pp.num_microbatches if pp else 1)
    wrapped, cores = checkpointed(plan), core_recomputed(plan)  # full: whole blocks; selective: attention cores
    busy, per_micro = [], []
    for held in rank_units(plan):
        c = [costs.get(u, DeviceCost()) for u in held]
        forward = sum(x.forward_s for x in c)
        backward = sum(x.backward_s + (x.forward_s if u in wrapped else 0.0) + (x.core_forward_s if u in cores else 0.0)
                       for u, x in zip(held, c))
        busy.append((forward + backward) * passes)
        per_micro.append((forward, backward))
    bubble = expected_bubble(pp.schedule, pp_size=plan.pp_size, stages_per_rank=pp.stages_per_rank,
                             microbatches=pp.num_microbatches) if pp else 0.0
    compute = max(busy)
    span = compute + pipeline_bubble_s(busy, bubble) if bubble < 1 else math.inf
    params = params if params is not None else unit_params(plan, model)
    comm, exposed, traffic, optimizer = _waits(cfg, plan, profile, params, micro, busy, speed, per_micro)
    total = span + sum(exposed.values()) + optimizer
    # Model FLOPs count each matmul once: a unit whose parameters tp splits did 1/tp of it on this rank;
    # a unit tp leaves whole (the Megatron plan's output head) did all of it on every tp rank.
    tp = plan.mesh.size(sorted(plan.sharded_axes))
    split = placed_params(plan)
    # A grid's or cube's block did its share of the block's work on this rank (parallel.plan.split).
    layout = layout_shares(plan, model)
    flops_per_micro = sum(x.model_flops * (tp if split.get(u) else 1) / (
        layout.block if layout is not None and u in layout.blocks else 1.0) for u, x in costs.items())
    sequences = t.global_batch_size
    # A cp rank's pass covers 1/cp of its micro-batch's tokens: the cp ranks together do the micro-batch.
    model_flops = flops_per_micro * plan.cp_size * sequences / micro
    return ProfileStep(total_s=total, compute_s=compute, bubble_s=span - compute, comm_s=comm, optimizer_s=optimizer,
                       traffic=traffic, tokens_per_step=sequences * t.seq_len, model_flops=model_flops,
                       devices=plan.mesh.world_size, peak_flops=profile.peak_flops(t.precision), exposed_s=exposed)


def lower_bound_on_profile(cfg: RunConfig, plan: ParallelPlan, profile: HardwareProfile,
                           params: UnitParams, flops_per_sequence: float) -> float:
    """A time :func:`predict_on_profile` never undercuts, without a meta pass: the step's FLOPs shared
    perfectly over the devices at the achieved GEMM rate, stretched by the bubble; the exposed
    communication that needs no pass (tp, pipelined dp, the fill and drain); the optimizer step."""
    t, pp = cfg.train, plan.pipeline
    speed = DeviceSpeed.of(profile, t.precision, compiled=t.compile)
    fastest = max(speed.matmul_flops, *speed.attention_flops)
    compute = flops_per_sequence * t.global_batch_size / plan.mesh.world_size / fastest
    bubble = expected_bubble(pp.schedule, pp_size=plan.pp_size, stages_per_rank=pp.stages_per_rank,
                             microbatches=pp.num_microbatches) if pp else 0.0
    ranks = len(rank_units(plan))
    _, exposed, _, optimizer = _waits(cfg, plan, profile, params, cfg.micro_batch_size, [math.inf] * ranks, speed)
    return compute / (1.0 - bubble) + sum(exposed.values()) + optimizer
