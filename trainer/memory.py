"""Per-rank peak memory of a config, predicted before any worker starts: the steady state's
(from the second step on, when AdamW's moments sit beside the forward's activations).

    est = predict_memory(cfg, plan)          # one MemoryEstimate per pp rank
    est[0].total / 2**30                     # GiB at the peak of a training step on pp rank 0

* Weights, gradients, AdamW: from the plan (:func:`trainer.plan.plan_numbers`: what each rank holds
  after pipeline split, tensor and data-parallel sharding).
* Activations and backward: measured, not guessed. The model runs a forward and backward on the
  meta device, tensor-parallel parameters at their local shapes, on a micro-batch of the run's
  shape. What autograd saves is counted per pipeline unit and block (``saved_tensors_hooks``), then
  scaled by the micro-batches the schedule keeps in flight, activation checkpointing and sequence
  parallelism; a dispatch mode follows every tensor the pass creates until it dies, so what
  backward adds at its worst moment (gradients of the largest activations, e.g. SwiGLU's
  [b, s, ffn] ones, and of the logits; parameter gradients as they appear) is exact for the model.
* FSDP's unsharded blocks, autocast's bf16 weight copies (:func:`_gathered`); ddp's unsharded copy and
  its post-backward reduce through two flat buffers of the whole model (:func:`_replicate_reduce`).
* CPU only: the runtime's own memory and glibc's heap holes (:mod:`trainer.host_memory`), so the
  total compares with the resident high-water mark :class:`trainer.metrics.MemoryMeter` reads.

On CPU the real attention kernel keeps only its log-sum-exp (not the T x T scores); the meta
device would take the math path and count the scores, so the counting pass uses the fused
kernel's own autograd formula. The budget a run's peak is checked against: :mod:`trainer.memory_budget`.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import weakref
from collections import defaultdict
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from parallel.config import INTERLEAVED_SCHEDULES, V_SCHEDULES
from parallel.plan import ParallelPlan
from trainer.config import RunConfig
from trainer.host_memory import MMAP_FROM, host_overhead, runtime

MIB = 2**20
GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at the peak of a training step, by kind. ``parts``: ``transient`` (what
    backward adds to the saved activations at its worst moment), ``step_temporaries`` (clipping and
    AdamW), ``runtime`` and ``allocator`` (CPU: process groups, glibc's heap holes)."""

    pp_rank: int
    params: float
    grads: float
    optimizer: float
    gathered: float  # FSDP's unsharded parameters and collective buffers, autocast's bf16 weight copies
    activations: float  # saved for backward, over the micro-batches in flight
    in_flight: int  # micro-batch x stage passes whose activations are held at once
    parts: dict = field(default_factory=dict)

    @property
    def live(self) -> float:
        """Bytes in tensors at the peak: the larger of backward's worst moment (what FSDP and autocast
        gathered, saved activations, what backward adds, and with accumulation all the gradients) and
        the optimizer step's (FSDP reshards after backward and autocast's copies die with it, so
        nothing gathered is left then); with ``ddp`` also the gradient reduce's, after backward
        (``parts["reduce"]``, see :func:`_replicate_reduce`)."""
        p = self.parts
        backward = (self.activations + p.get("transient", 0.0) + p.get("stage_grads", 0.0)
                    + (self.grads if p.get("accumulates") else 0.0))
        step = self.grads + p.get("step_temporaries", 0.0)
        return self.params + self.optimizer + max(self.gathered + backward, p.get("reduce", 0.0), step)

    @property
    def total(self) -> float:
        return self.live + self.parts.get("runtime", 0.0) + self.parts.get("allocator", 0.0)


def _flash_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    # The fused CPU kernel: saves q, k, v, the output and a log-sum-exp per row, as real runs do.
    if attn_mask is not None:
        return _SDPA(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, scale=scale)[0]


_SDPA = F.scaled_dot_product_attention


@contextlib.contextmanager
def _fused_attention():
    F.scaled_dot_product_attention = _flash_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _SDPA


def _local_shapes(model: nn.Module, plan: ParallelPlan) -> None:
    """Give every tensor-parallel parameter of the meta ``model`` its local shape (in place)."""
    for fqn, axes in plan.placements.items():
        owner, _, name = fqn.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        shape = list(getattr(module, name).shape)
        for axis, placement in axes.items():
            if placement.is_shard:
                dim = placement.dim % len(shape)
                shape[dim] = math.ceil(shape[dim] / plan.mesh.size(axis))
        setattr(module, name, nn.Parameter(torch.empty(shape, device="meta")))


class _Census(TorchDispatchMode):
    """``timeline``: live bytes of the tensors a meta pass creates, after every op, as (activations
    and temporaries, parameter gradients). A storage counts from the op that makes it until its last
    reference dies; a gradient moves to the second column when autograd accumulates it."""

    def __init__(self, model: nn.Module, share) -> None:
        super().__init__()
        self.share = share  # () -> the share of a new tensor this rank holds (sequence parallel)
        self.live = [0.0, 0.0]
        self.timeline: list[tuple[float, float]] = []
        self._bytes: dict[int, list[float]] = {}  # key -> [column, bytes]
        self._keys = itertools.count(1)
        for t in [*model.parameters(), *model.buffers()]:
            t.untyped_storage()._census = 0
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._to_grads)

    def _to_grads(self, p: torch.Tensor) -> None:
        entry = self._bytes.get(getattr(p.grad.untyped_storage(), "_census", 0))
        if entry is not None and entry[0] == 0:
            entry[0] = 1
            self.live[0] -= entry[1]
            self.live[1] += entry[1]

    def _free(self, key: int) -> None:
        column, nbytes = self._bytes.pop(key)
        self.live[int(column)] -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not hasattr(storage := t.untyped_storage(), "_census"):
                key = storage._census = next(self._keys)
                self._bytes[key] = [0, storage.nbytes() * self.share()]
                self.live[0] += self._bytes[key][1]
                weakref.finalize(storage, self._free, key)
        self.timeline.append((self.live[0], self.live[1]))
        return out


def saved_activations(cfg: RunConfig, plan: ParallelPlan, micro_batch: int, *, model: nn.Module | None = None) -> dict:
    """One forward and backward of ``micro_batch`` sequences on the meta device: ``{"units": {unit:
    bytes saved for backward}, "block_inputs": {block: bytes}, "timeline": [(activations and
    temporaries, gradients) after each op], "forward_ops": n, "unit_params": {unit: [fp32 bytes of
    each tp-local parameter]}}`` (the last unit also holds the loss's)."""
    from trainer.models import build_model, loss_fn_for

    # A given model is copied: the pass gives its parameters their tp-local shapes.
    model = copy.deepcopy(model) if model is not None else build_model(cfg.model, device="meta")
    _local_shapes(model, plan)
    unit_params: dict[str, list[float]] = defaultdict(list)
    for fqn, p in model.named_parameters():
        unit_params[next((u for u in plan.units if fqn == u or fqn.startswith(u + ".")), "")].append(p.numel() * 4.0)
    if cfg.train.precision == "bf16":
        model.to(torch.bfloat16)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    sp_norms = {name for name, layout in plan.layouts.items() if any(p.is_shard for p in layout.input.values())}
    tp = plan.mesh.size([a for axes in plan.placements.values() for a in axes])
    current: list[str] = []
    units: dict[str, float] = defaultdict(float)
    inputs: dict[str, float] = {}
    seen: set[int] = set()
    hooks = []
    for name, module in model.named_modules():
        if name in plan.units or name in sp_norms:
            hooks.append(module.register_forward_pre_hook(lambda _m, args, name=name: _enter(name, args)))
            hooks.append(module.register_forward_hook(lambda *_: current.pop() and None))

    def _enter(name: str, args: tuple) -> None:
        current.append(name)
        if name in plan.blocks and args and isinstance(args[0], torch.Tensor):
            inputs[name] = args[0].numel() * args[0].element_size()

    def share() -> float:  # sequence parallel: a norm runs on this rank's sequence shard
        return 1 / tp if any(c in sp_norms for c in current) else 1.0

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in params and storage._cdata not in seen:
            seen.add(storage._cdata)
            owner = next((c for c in current if c in plan.units), plan.units[-1])
            units[owner] += storage.nbytes() * share()
        return t

    seq = cfg.train.seq_len
    if hasattr(cfg.model, "in_features"):  # regression: features in, predictions out
        x = torch.empty(micro_batch, cfg.model.in_features, device="meta")
        y = torch.empty(micro_batch, cfg.model.out_features, device="meta")
    else:
        x = torch.zeros(micro_batch, seq, dtype=torch.long, device="meta")
        y = torch.zeros(micro_batch, seq, dtype=torch.long, device="meta")
    census = _Census(model, share)
    with _fused_attention(), census:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x)
            # A tp-local output (Partial / Shard) has no loss here: its sum stands in for backward.
            loss = loss_fn_for(cfg.model)(out, y) if out.shape == y.shape or out.shape[:-1] == y.shape else out.sum()
        forward_ops = len(census.timeline)
        if loss.requires_grad:
            loss.backward()
    for hook in hooks:
        hook.remove()
    return {"units": dict(units), "block_inputs": inputs, "timeline": census.timeline, "forward_ops": forward_ops,
            "unit_params": dict(unit_params)}


def _in_flight(plan: ParallelPlan, pp_rank: int) -> int:
    """Micro-batch x stage forward passes whose activations a pp rank holds at the peak."""
    pp = plan.pipeline
    if pp is None:
        return 1
    m, size, spr = pp.num_microbatches, plan.pp_size, pp.stages_per_rank
    if pp.schedule == "GPipe":
        return m
    if pp.schedule == "1F1B":
        return min(m, size - pp_rank)
    if pp.schedule in INTERLEAVED_SCHEDULES + V_SCHEDULES:
        # torch's interleaved warm-up: (spr - 1) * pp + 2 * (pp - 1 - rank) forwards, then one more.
        return min(m * spr, (spr - 1) * size + 2 * (size - 1 - pp_rank) + 1)
    return m


def _in_flight_peak(plan: ParallelPlan, in_flight: int, per_pass: float, stage_grads: float, chunks: int,
                    accumulated: bool) -> tuple[float, float]:
    """``(activations, accumulated gradients)`` a pp rank holds at its backward's worst moment
    (``per_pass``: one micro-batch x stage pass's saved activations; ``stage_grads``: the gradients
    the rank's stages accumulate over the micro-batches, ``chunks`` stages on the rank).

    A stage's gradients appear during its first backward, as that pass's activations are freed:
    the peak is either all passes in flight before any gradient, or one pass freed and the first
    stage's gradients made. Where forwards follow a backward (more passes than are in flight at
    once, e.g. 1F1B's steady state), the rank holds as many passes again beside those gradients.
    (Measured: in-use bytes at each pipeline action, 25M Llama, dp2 x pp4, 1F1B, 4 micro-batches:
    pp rank 0 peaks in its first backward at 4 passes' activations (21.5 MiB each) and its
    gradients; rank 3 in the steady state at one pass and all gradients; interleaved, rank 0 at
    8 passes, rank 3 at 5 beside its last stage's gradients.) ``accumulated``: gradients kept from
    an earlier accumulation step, all there from the start."""
    pp = plan.pipeline
    first = stage_grads / chunks  # the stage that runs backward first
    if accumulated or pp.schedule not in ("GPipe", "1F1B") + INTERLEAVED_SCHEDULES + V_SCHEDULES:
        return per_pass * in_flight, stage_grads  # an unmodelled order: the bound
    passes = pp.num_microbatches * chunks
    options = [(per_pass * in_flight, 0.0), (per_pass * (in_flight - 1), first)]
    if passes > in_flight:
        options.append((per_pass * in_flight, first))
    return max(options, key=sum)


def predict_memory(cfg: RunConfig, plan: ParallelPlan, *, model: nn.Module | None = None,
                   cache: dict | None = None) -> list[MemoryEstimate]:
    """One :class:`MemoryEstimate` per pp rank (one without a pipeline). A planner comparing many
    layouts passes the meta ``model`` it built once and a ``cache`` dict: the meta pass (the costly
    part) depends only on the tp size, the micro-batch and the precision, and is reused."""
    from trainer.plan import plan_numbers, stage_views

    if plan.pipeline is not None and plan.pipeline.stages:  # each stage by its own layout
        return [predict_memory(view_cfg, view)[i] for i, (view_cfg, view) in enumerate(stage_views(cfg, plan))]

    numbers = plan_numbers(cfg, plan, model=model)
    t = cfg.train
    micro = max(1, t.global_batch_size // t.grad_accum // max(1, plan.dp_size) // cfg.num_microbatches)
    tp = plan.mesh.size(sorted({a for axes in plan.placements.values() for a in axes}))
    key = (tp, micro, t.precision, bool(plan.layouts))
    if cache is None or key not in cache:
        saved = saved_activations(cfg, plan, micro, model=model)
        if cache is not None:
            cache[key] = saved
    else:
        saved = cache[key]
    pp, dp = plan.pipeline, plan.data_parallel
    stage_units = pp.stage_units if pp else (tuple(plan.units),)
    wrapped = _checkpointed(plan)
    shard = plan.mesh.size(dp.shard_dim_names) if dp is not None else 1
    # With accumulation (grad_accum, a pipeline's micro-batches) earlier passes' gradients are all there
    # beside later activations (MemoryEstimate.live adds them); else backward makes them as it frees
    # activations and the census gives both at its worst moment, FSDP keeping 1/shard once reduce-scattered.
    accumulates = pp is not None or t.grad_accum > 1
    keep = 0.0 if accumulates else 1.0 / shard if dp is not None and dp.mode != "ddp" else 1.0
    # A pipelined stage accumulates its micro-batches' gradients (FSDP2's unsharded: _in_flight_peak);
    # FSDP2's sharded ones appear only as the stage's final reduce frees those, so beside the
    # activations they are there only from an earlier accumulation step.
    pipelined_fsdp = pp is not None and _fsdp2(plan)
    sharded_grads_in_backward = t.grad_accum > 1 if pipelined_fsdp else accumulates and pp is None
    backward = saved["timeline"][saved["forward_ops"]:] or [(0.0, 0.0)]
    transient = max(0.0, max(a + keep * g for a, g in backward) - sum(saved["units"].values()))
    cpu = not _on_cuda(cfg)
    out = []
    for rank_numbers in numbers["per_pp_rank"]:
        r = rank_numbers["pp_rank"]
        held = [u for s in rank_numbers["stages"] for u in stage_units[s]]
        acts, recompute = 0.0, 0.0
        for unit in held:
            full = saved["units"].get(unit, 0.0)
            if unit in wrapped:  # checkpointed: only the block's input is kept; recomputed in backward
                acts += saved["block_inputs"].get(unit, 0.0)
                recompute = max(recompute, full)
            else:
                acts += full
        in_flight = _in_flight(plan, r)
        blocks = [saved["unit_params"].get(u, []) for u in held if u in plan.blocks]
        root = sum(sum(saved["unit_params"].get(u, [])) for u in held if u not in plan.blocks)
        local = rank_numbers["params"] * 4.0
        chunks = max(1, len(rank_numbers["stages"]))
        # FSDP2's pipelined stage accumulates unsharded gradients in the compute dtype; else param.grad
        stage_grads = local * (0.5 if t.precision == "bf16" else 1.0) if pipelined_fsdp else rank_numbers["grad_bytes"]
        held_acts, held_grads = _in_flight_peak(plan, in_flight, acts / chunks, stage_grads, chunks,
                                                accumulated=t.grad_accum > 1 and not pipelined_fsdp) if pp else (acts, 0.0)
        estimate = MemoryEstimate(
            pp_rank=r, params=rank_numbers["param_bytes"], grads=rank_numbers["grad_bytes"],
            optimizer=rank_numbers["optim_bytes"], gathered=_gathered(cfg, plan, local, blocks, root),
            activations=held_acts + recompute, in_flight=in_flight,
            parts={"accumulates": sharded_grads_in_backward, "stage_grads": held_grads, "micro_batch": micro,
                   "step_activations": (acts + recompute) * (pp.num_microbatches if pp else 1),
                   "transient": transient,
                   "step_temporaries": 4.0 * max(max(v) for v in saved["unit_params"].values()) / shard})
        backward = estimate.gathered + estimate.activations + transient + held_grads
        if pipelined_fsdp:
            reduce, mapped = _stage_reduce(cfg, plan, local, blocks, backward)
        else:
            reduce, mapped = _replicate_reduce(cfg, plan, local, backward)
        estimate = replace(estimate, parts={**estimate.parts, "reduce": reduce})
        # A pipelined stage's unsharded parameters and gradients are allocated once a step and live
        # through all its micro-batches: their heap holes are FSDP's per-parameter term, not cycled memory's.
        cycled = estimate.live - estimate.params - estimate.optimizer - (estimate.gathered if pipelined_fsdp else 0.0)
        if estimate.live - estimate.params - estimate.optimizer == reduce:  # mmapped buffers leave no heap holes
            cycled -= mapped
        host = {"runtime": runtime(plan), "allocator": host_overhead(cfg, plan, max(0.0, cycled), blocks,
                                                                 estimate.parts["step_activations"])}
        out.append(replace(estimate, parts={**estimate.parts, **(host if cpu else {})}))
    return out


def _on_cuda(cfg: RunConfig) -> bool:
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def _fsdp(plan: ParallelPlan) -> bool:  # FSDP2 shards parameters (one rank: no data parallelism at all)
    dp = plan.data_parallel
    return dp is not None and dp.mode != "ddp" and plan.mesh.world_size > 1


def _replicated(plan: ParallelPlan) -> bool:  # ddp: FSDP2's replicate, the whole model (or stage) one unit
    dp = plan.data_parallel
    return dp is not None and dp.mode == "ddp" and plan.mesh.world_size > 1


def _fsdp2(plan: ParallelPlan) -> bool:  # either runs on FSDP2's parameter groups
    return _fsdp(plan) or _replicated(plan)


def _replicate_reduce(cfg: RunConfig, plan: ParallelPlan, local: float, heap: float) -> tuple[float, float]:
    """``(bytes beyond weights and AdamW while ddp reduces its gradients, after backward; of those,
    the flat buffers glibc maps on their own)``. ``local``: this rank's fp32 parameter bytes;
    ``heap``: what backward's peak held beyond weights and AdamW (the unsharded copy, activations,
    gradients).

    ``replicate`` is FSDP2 with one parameter group for the whole model: after backward it frees
    its unsharded parameter copy, copies every unsharded gradient (compute dtype) into one flat
    fp32 buffer, frees them and all-reduces into a second flat buffer that becomes the gradients.
    On GPU the caching allocator reuses what was freed: the peak is two of the three. On CPU
    everything backward freed stays resident as heap holes, too scattered for a flat buffer of the
    whole model's size (and from glibc's mmap threshold up such a buffer gets pages of its own,
    leaving no hole when freed): the two flat buffers sit on top of backward's peak. (Measured,
    25M Llama, ddp [2] / [8], batch 4 / 1 per rank: 954 / 792 MiB, 77% / 93% of it predicted
    without this term's heap; 2 ranks of 24 Linear(2048): 2,015 MiB above the weights at the
    reduce, 1,920 predicted.) A pipelined stage reduces once, after its last micro-batch, what it
    accumulated (in :func:`_gathered`)."""
    if not _replicated(plan) or plan.pipeline is not None:
        return 0.0, 0.0
    pdt = 0.5 if cfg.train.precision == "bf16" else 1.0
    if _on_cuda(cfg) or cfg.launch.unmap_freed_memory:  # what backward freed is reused or returned
        return max(local * pdt + local, 2 * local), 0.0
    return heap + 2 * local, 2 * local if local >= MMAP_FROM else 0.0


def _stage_reduce(cfg: RunConfig, plan: ParallelPlan, local: float, blocks: list[list[float]],
                  heap: float) -> tuple[float, float]:
    """``(bytes beyond weights and AdamW while a pipelined FSDP2 stage reduces what its micro-batches
    accumulated, after its last backward; of those, the ones that leave no heap holes)``. ``heap``:
    what backward's peak held beyond weights and AdamW.

    In tensors: the unsharded gradients and, ddp, one fp32 flat buffer of the stage (the unsharded
    copy is freed first), FSDP, the unsharded parameters and one block's fp32 reduce-scatter input.
    (Measured in use, 25M, dp2 x pp4, pp rank 0: 1.8 MiB above ddp's gradients and copy during the
    reduce, 9.6 above FSDP's.) On CPU ddp's two flat buffers do not fit the holes the activations
    left: glibc extends the heap by both, above backward's peak and its holes, and trims them off
    again before the next step (heap extent, same run: +46.6 MiB at the reduce for 2 x 24.6)."""
    pdt = 0.5 if cfg.train.precision == "bf16" else 1.0
    if not _replicated(plan):
        return 2 * local * pdt + max((sum(b) for b in blocks), default=0.0), 0.0
    if _on_cuda(cfg) or cfg.launch.unmap_freed_memory:
        return local * pdt + local, 0.0
    return heap + 2 * local, 2 * local


def _gathered(cfg: RunConfig, plan: ParallelPlan, local: float, blocks: list[list[float]], root: float) -> float:
    """Unsharded parameter bytes at the backward's peak (``local``: this rank's tp-local fp32
    parameter bytes; ``blocks``: each held block's parameter sizes; ``root``: the others' bytes).
    FSDP2 keeps the root's parameters (embeddings, final norm, head) unsharded from forward to
    backward and, early in backward while the activations are all there, one block's unsharded
    parameters and the next one's (prefetched) with the all-gather output they are copied from.
    zero2 keeps every parameter unsharded, plus one block's unsharded gradients and fp32
    reduce-scatter input. A pipelined stage keeps every parameter unsharded: torch's
    ``PipelineStage`` runs each micro-batch's backward with gradient sync and resharding off and
    reduces the whole stage once, after the last (``perform_reduce_grad``); the unsharded
    gradients it accumulates until then: :func:`_in_flight_peak`, the reduce: :func:`_stage_reduce`.
    Unsharded, bf16 autocast keeps a bf16 copy of every weight."""
    half = cfg.train.precision == "bf16"
    pdt = 0.5 if half else 1.0  # gathered parameters and unsharded gradients are in the compute dtype
    if _replicated(plan) or (_fsdp(plan) and plan.pipeline is not None):
        return local * pdt  # ddp: one unit's unsharded copy; a pipelined FSDP stage keeps it all unsharded
    if not _fsdp(plan):
        return local * 0.5 if half else 0.0
    block = max((sum(b) for b in blocks), default=0.0)
    if plan.data_parallel.mode == "zero2":
        return local * pdt + block * (pdt + 1.0)
    return root * pdt + 3 * block * pdt


def _checkpointed(plan: ParallelPlan) -> set[str]:
    if plan.activation_checkpointing == "full":
        return set(plan.blocks)
    if plan.activation_checkpointing == "selective":
        every = plan.activation_checkpointing_every
        return {b for i, b in enumerate(plan.blocks) if (i + 1) % every == 0}
    return set()
