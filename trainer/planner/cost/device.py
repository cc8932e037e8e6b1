"""Predict a training step on a hardware profile: GPUs this host need not have (``hardware=h100_sxm``).

    speed = DeviceSpeed.of(profile, "bf16")
    costs = device_unit_costs(cfg, plan, micro_batch=1, speed=speed)   # per pipeline unit: seconds, FLOPs
    t = predict_on_profile(cfg, plan, profile, costs=costs)
    t.total_s, t.compute_s, t.bubble_s, t.comm_s["tp"], t.model_flops

Nothing here touches a GPU or starts a process: the model runs once on the meta device, at
tp-local shapes (:func:`trainer.planner.cost.model.unit_pass`), and every op it dispatches is
priced on the profile as it goes:

* a matmul by a roofline, ``max(FLOPs / (peak x achieved x size x waves), bytes / (HBM x achieved))``:
  ``achieved`` is the fraction of the datasheet's peak a large GEMM reaches (the profile's
  ``achieved.matmul``), ``size = F / (F + F_half)`` the curve over a GEMM's FLOPs F that smaller
  ones fall on (``achieved.matmul_half_gflop``, from a sweep of decoder shapes), ``waves`` the wave quantisation of its output tiles over the SMs (a GEMM of
  ``tiles`` output tiles runs ``ceil(tiles / SMs)`` waves; the last one part-full), for the best of
  the tile shapes cuBLAS picks among, as NVIDIA's matmul performance guide describes;
* flash attention by its FLOPs (``4 b h s_q s_k d``, half when causal; backward 2.5 times forward:
  it recomputes the scores) at the profile's achieved attention fraction of peak;
* every other op by its bytes read and written at the achieved fraction of HBM bandwidth;
* each kernel at least ``achieved.kernel_s`` (launch and the eager framework's dispatch).

A step is the busiest pp rank's passes (a checkpointed block's forward twice) stretched by the
pipeline bubble, plus what communication leaves exposed and the optimizer step:

* each collective of :func:`trainer.planner.cost.comm.comm_ops` is priced on the link its mesh
  axes ride (:mod:`trainer.planner.cost.links`: NVLink inside a node, the NICs across nodes,
  hierarchical for a group that spans both);
* tp's activation all-reduces sit on the critical path (exposed);
* FSDP2 prefetches its all-gathers and reduce-scatters behind compute, as does ddp's bucketed
  all-reduce behind backward: only what does not fit behind the passes' compute, plus the last
  unit's reduce, is exposed. A pipelined stage gathers before its first micro-batch and reduces
  after its last (torch's ``PipelineStage``): exposed;
* pipeline sends and receives are asynchronous: in the steady state they hide behind other
  micro-batches' compute; the fill and the drain wait for ``2 (pp - 1)`` of them;
* AdamW is memory-bound: :data:`ADAMW_FOREACH_BYTES_PER_PARAM` per local parameter at the
  achieved HBM bandwidth (torch's foreach implementation, the default on CUDA, passes over the lists
  once per op).
* ``train.compile=true`` (Inductor fuses each block's elementwise ops) leaves the profile's
  ``achieved.compiled_elementwise`` share of the elementwise time; matmuls and attention are unchanged.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from parallel.pipeline.order import expected_bubble
from parallel.plan.spec import ParallelPlan
from trainer.config.hardware import HardwareProfile
from trainer.config.schema import RunConfig
from trainer.models import build_model
from trainer.planner.cost.comm import comm_ops, unit_params
from trainer.planner.cost.links import collective_seconds, group_link
from trainer.planner.cost.model import _FLASH_CPU, StepTime, flash_flops, placed_params, unit_pass
from trainer.planner.cost.reference import rank_units
from trainer.planner.memory.layout import checkpointed, core_recomputed

# Views their schemas do not mark as aliases: no kernel runs.
_FREE = {torch.ops.aten._unsafe_view, torch.ops.aten.lift_fresh}
# torch's foreach AdamW on CUDA (its default there) and the gradient clipping before it: each foreach
# op reads and writes whole lists, per fp32 parameter: lerp m (12 B), v *= b2 (8), v += g*g (12), weight
# decay (8), sqrt v (8), / bias correction (8), + eps (8), p -= lr m / d (16); clipping's norm (4) and
# scale (8). Measured: 39.1 ms of multi_tensor_apply kernels per step for 1.16B parameters on an
# H100 at 2.95 TB/s, i.e. 99 B per parameter (tests/bench/gpu_kernel_sweep.py).
ADAMW_FOREACH_BYTES_PER_PARAM = 92
TILES = ((128, 128), (128, 256), (256, 128), (64, 128), (128, 64))  # output tiles cuBLAS's Tensor Core kernels use


@dataclass(frozen=True)
class DeviceSpeed:
    """What one device of a profile does per second, as achieved (not peak) rates."""

    matmul_flops: float  # a large GEMM's achieved FLOP/s in the compute dtype
    attention_flops: tuple[float, float]  # flash attention's achieved FLOP/s: forward, backward
    memory_bytes: float  # achieved HBM bytes/s of a streaming kernel
    kernel_s: float  # the least a kernel costs: launch and the framework's dispatch
    sms: int  # streaming multiprocessors: the wave quantisation's unit
    matmul_half_flops: float = 0.0  # the GEMM size reaching half of matmul_flops
    fused: float = 1.0  # the share of elementwise time left when torch.compile fuses the blocks' ops

    @classmethod
    def of(cls, profile: HardwareProfile, precision: str, *, compiled: bool = False) -> DeviceSpeed:
        a = profile.achieved
        peak = profile.peak_flops(precision)
        return cls(matmul_flops=peak * a.matmul, attention_flops=(peak * a.attention_forward, peak * a.attention_backward),
                   memory_bytes=profile.memory_bandwidth_gb_s * 1e9 * a.memory, kernel_s=a.kernel_us * 1e-6,
                   sms=profile.sm_count, matmul_half_flops=a.matmul_half_gflop * 1e9,
                   fused=a.compiled_elementwise if compiled else 1.0)

    def matmul_s(self, flops: float, nbytes: float, tiles_of) -> float:
        size = flops / (flops + self.matmul_half_flops) if flops > 0 else 1.0
        return max(flops / (self.matmul_flops * tiles_of(self.sms) * size), nbytes / self.memory_bytes, self.kernel_s)

    def memory_s(self, nbytes: float) -> float:
        return self.fused * max(nbytes / self.memory_bytes, self.kernel_s)


def wave_efficiency(batch: int, m: int, n: int, sms: int) -> float:
    """The busy share of a GEMM's waves for the best output tile: ``tiles / (waves x SMs)``."""
    best = 0.0
    for tm, tn in TILES:
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        best = max(best, tiles / (math.ceil(tiles / sms) * sms))
    return best


@dataclass
class DeviceCost:
    """One pipeline unit's predicted seconds and matmul FLOPs for one micro-batch on one device."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    forward_flops: float = 0.0
    backward_flops: float = 0.0
    attention_flops: float = 0.0  # what the two lines above count for flash attention (causal half, recompute)
    attention_model_flops: float = 0.0  # the usual model count of it: 3 x its forward, causal or not
    core_forward_s: float = 0.0  # of forward_s: the attention kernel's, which selective recomputation runs twice

    @property
    def model_flops(self) -> float:
        """Forward and backward FLOPs as utilisation counts them (6 N per token, attention 12 l h s)."""
        return self.forward_flops + self.backward_flops - self.attention_flops + self.attention_model_flops


class _Pricer(TorchDispatchMode):
    """Adds every op's predicted seconds on ``speed`` to ``costs[unit]``; views cost nothing."""

    def __init__(self, costs: dict[str, DeviceCost], speed: DeviceSpeed, where) -> None:
        super().__init__()
        self.costs, self.speed, self.where = costs, speed, where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        unit, phase = self.where()
        cost, backward = self.costs[unit], phase == "backward"
        if func in _FLASH_CPU:
            full, flops = flash_flops(func, args, kwargs)
            seconds = max(flops / self.speed.attention_flops[backward], self.speed.kernel_s)
            cost.attention_flops += flops
            cost.attention_model_flops += 0.0 if backward else 3 * full
            cost.core_forward_s += 0.0 if backward else seconds
        elif func.overloadpacket in flop_registry:
            flops = flop_registry[func.overloadpacket](*args, **(kwargs or {}), out_val=out)
            nbytes = _bytes(args, kwargs, out)
            shape = out.shape if isinstance(out, torch.Tensor) else (1, 1)
            batch, m, n = math.prod(shape[:-2]), (shape[-2] if len(shape) > 1 else 1), shape[-1]
            seconds = self.speed.matmul_s(flops, nbytes, lambda sms: wave_efficiency(batch, m, n, sms))
        elif func.overloadpacket in _FREE:
            return out
        elif not any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
            flops, seconds = 0.0, self.speed.memory_s(_bytes(args, kwargs, out))
        else:
            return out
        if backward:
            cost.backward_s += seconds
            cost.backward_flops += flops
        else:
            cost.forward_s += seconds
            cost.forward_flops += flops
        return out


def _bytes(args, kwargs, out) -> float:
    return float(sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)))


def device_unit_costs(cfg: RunConfig, plan: ParallelPlan, micro_batch: int, speed: DeviceSpeed, *,
                      model: nn.Module | None = None) -> dict[str, DeviceCost]:
    """Per pipeline unit: predicted forward and backward seconds and FLOPs of one micro-batch."""
    costs: dict[str, DeviceCost] = defaultdict(DeviceCost)
    unit_pass(cfg, plan, micro_batch, lambda where: _Pricer(costs, speed, where), model=model)
    return dict(costs)


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
                       params: dict[str, tuple[float, int]] | None = None) -> ProfileStep:
    """The step time of ``cfg`` laid out as ``plan`` on ``profile``'s devices (see the module
    docstring). ``costs``, ``params``: the layout's meta pass and :func:`unit_params`, when a
    planner has them cached."""
    model = model if model is not None else build_model(cfg.model, device="meta")
    t, pp = cfg.train, plan.pipeline
    micro = cfg.micro_batch_size
    speed = DeviceSpeed.of(profile, t.precision, compiled=t.compile)
    costs = costs if costs is not None else device_unit_costs(cfg, plan, micro, speed, model=model)
    passes = t.grad_accum * (pp.num_microbatches if pp else 1)
    wrapped, cores = checkpointed(plan), core_recomputed(plan)  # full: whole blocks; selective: attention cores
    busy = []
    for held in rank_units(plan):
        c = [costs.get(u, DeviceCost()) for u in held]
        forward = sum(x.forward_s * (2 if u in wrapped else 1) + (x.core_forward_s if u in cores else 0.0)
                      for u, x in zip(held, c))
        busy.append((forward + sum(x.backward_s for x in c)) * passes)
    bubble = expected_bubble(pp.schedule, pp_size=plan.pp_size, stages_per_rank=pp.stages_per_rank,
                             microbatches=pp.num_microbatches) if pp else 0.0
    compute = max(busy)
    span = compute / (1.0 - bubble) if bubble < 1 else math.inf
    params = params if params is not None else unit_params(plan, model)
    comm, exposed, traffic, optimizer = _waits(cfg, plan, profile, params, micro, busy, speed)
    total = span + sum(exposed.values()) + optimizer
    # Model FLOPs count each matmul once: a unit whose parameters tp splits did 1/tp of it on this rank;
    # a unit tp leaves whole (the Megatron plan's output head) did all of it on every tp rank.
    tp = plan.mesh.size(sorted({a for axes in plan.placements.values() for a, pl in axes.items() if pl.is_shard}))
    split = placed_params(plan)
    per_micro = sum(x.model_flops * (tp if split.get(u) else 1) for u, x in costs.items())
    sequences = t.global_batch_size
    model_flops = per_micro * sequences / micro
    return ProfileStep(total_s=total, compute_s=compute, bubble_s=span - compute, comm_s=comm, optimizer_s=optimizer,
                       traffic=traffic, tokens_per_step=sequences * t.seq_len, model_flops=model_flops,
                       devices=plan.mesh.world_size, peak_flops=profile.peak_flops(t.precision), exposed_s=exposed)


def _waits(cfg: RunConfig, plan: ParallelPlan, profile: HardwareProfile, params: dict, micro: int,
           busy: list[float], speed: DeviceSpeed):
    """``(comm seconds per axis, exposed seconds per axis, bytes sent per axis, optimizer seconds)`` of
    the pp rank whose communication and optimizer step leave the most on the critical path."""
    shape, names = plan.mesh.shape, plan.mesh.dim_names
    per_node = max(1, plan.mesh.world_size // cfg.launch.nnodes)  # the ranks one node runs (row-major)
    shard = plan.mesh.size(plan.data_parallel.shard_dim_names) if plan.data_parallel else 1
    dp_axes = ",".join(plan.data_parallel.dim_names) if plan.data_parallel else None
    dp_keys = {dp_axes, *plan.data_parallel.dim_names} if plan.data_parallel else set()  # joined, or one (hsdp)
    worst = None
    for rank, held in enumerate(rank_units(plan)):
        comm: dict[str, float] = defaultdict(float)
        exposed: dict[str, float] = defaultdict(float)
        traffic: dict[str, float] = defaultdict(float)
        dp_s, tail = 0.0, 0.0
        for op in comm_ops(cfg, plan, held, params, micro):
            link = _link(shape, names, tuple(op.axis.split(",")), per_node)
            one = collective_seconds(profile, op.op, link, op.nbytes)
            comm[op.axis] += one * op.count
            traffic[op.axis] += op.sent_bytes
            if op.op == "send_recv":
                exposed[op.axis] += one * min(op.count, 2 * (plan.pp_size - 1) * cfg.train.grad_accum)
            elif op.axis in dp_keys:
                dp_s += one * op.count
                if op.op in ("reduce_scatter", "all_reduce"):
                    tail = max(tail, one)
            else:  # tp: on the critical path
                exposed[op.axis] += one * op.count
        if dp_s:
            key = dp_axes or "dp"
            if plan.pipeline is not None:  # the stage gathers first and reduces last: nothing to hide behind
                exposed[key] += dp_s
            else:  # prefetched / bucketed behind the passes' compute, the last reduce excepted
                exposed[key] += max(dp_s - busy[rank], 0.0) + min(tail, dp_s)
        numel = sum(params[u][0] for u in held)
        optimizer = numel / shard * ADAMW_FOREACH_BYTES_PER_PARAM / speed.memory_bytes
        wait = sum(exposed.values()) + optimizer
        if worst is None or wait > worst[0]:
            worst = (wait, dict(comm), dict(exposed), dict(traffic), optimizer)
    return worst[1], worst[2], worst[3], worst[4]


@functools.lru_cache(maxsize=4096)
def _link(shape: tuple[int, ...], names: tuple[str, ...], axes: tuple[str, ...], per_node: int):
    return group_link(shape, names, list(axes), per_node)


def lower_bound_on_profile(cfg: RunConfig, plan: ParallelPlan, profile: HardwareProfile,
                           params: dict[str, tuple[float, int]], flops_per_sequence: float) -> float:
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
