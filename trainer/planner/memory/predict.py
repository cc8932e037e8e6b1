"""Per-rank peak memory of a config, predicted before any worker starts: the steady state's
(from the second step on, when AdamW's moments sit beside the forward's activations).

    est = predict_memory(cfg, plan)          # one MemoryEstimate per pp rank
    est[0].total / 2**30                     # GiB at the peak of a training step on pp rank 0

* Weights, gradients, AdamW: from the plan (:func:`trainer.planner.numbers.plan_numbers`: what each rank holds
  after pipeline split, tensor and data-parallel sharding).
* Activations and backward: measured, not guessed. The model runs a forward and backward on the
  meta device (:mod:`trainer.planner.memory.meta_pass`), tensor-parallel parameters at their local shapes,
  on a micro-batch of the run's shape. What autograd saves is counted per pipeline unit and block
  (``saved_tensors_hooks``), then scaled by the micro-batches the schedule keeps in flight, activation checkpointing
  and sequence parallelism; a dispatch mode follows every tensor the pass creates until it dies, so what
  backward adds at its worst moment (gradients of the largest activations, e.g. SwiGLU's
  [b, s, ffn] ones, and of the logits; parameter gradients as they appear) is exact for the model.
* What the layout adds (:mod:`trainer.planner.memory.layout`): FSDP's unsharded blocks, autocast's bf16
  weight copies; ddp's unsharded copy and its post-backward reduce through two flat buffers of the
  whole model; a pipeline stage's passes in flight beside the gradients it accumulates, its reduce.
* CPU only: the runtime's own memory and glibc's heap holes (:mod:`trainer.planner.memory.host`), so the
  total compares with the resident high-water mark :class:`trainer.run.metrics.MemoryMeter` reads.

The meta pass itself (:func:`~trainer.planner.memory.meta_pass.saved_activations`, with the CPU's fused
attention kernel rather than the meta device's math path) is :mod:`trainer.planner.memory.meta_pass`. The
budget a run's peak is checked against: :mod:`trainer.planner.memory.budget`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from parallel.config import REPLICATED_DP_MODES
from parallel.plan.spec import ParallelPlan
from parallel.plan.split import split_key
from trainer.config.schema import RunConfig
from trainer.planner.memory.host import host_overhead, runtime
from trainer.planner.memory.pass_cache import PASSES, PassCache, pass_key
from trainer.planner.memory.layout import (checkpointed, core_recomputed, expert_share, expert_split, fsdp, fsdp2,
                                           gathered, in_flight_peak, on_cuda,
                                           passes_in_flight, replicate_reduce, stage_reduce)
from trainer.planner.memory.meta_pass import flash_attention_for_cpu, saved_activations
from trainer.planner.numbers import GIB, plan_numbers, stage_views


@dataclass(frozen=True)
class MemoryParts:
    """The terms of a rank's peak beyond its weights, gradients, AdamW state, gathered parameters
    and saved activations (bytes unless said otherwise)."""

    transient: float = 0.0  # what backward adds to the saved activations at its worst moment
    stage_grads: float = 0.0  # a pipelined stage's gradients held beside its passes in flight
    accumulates: bool = False  # earlier passes' (sharded) gradients sit beside the activations
    micro_batch: int = 1  # sequences per forward
    step_activations: float = 0.0  # what all the step's passes allocate (their heap holes on CPU)
    step_temporaries: float = 0.0  # gradient clipping and AdamW's temporaries
    reduce: float = 0.0  # the gradient reduce's peak after backward (ddp; a pipelined FSDP stage)
    runtime: float = 0.0  # CPU: the process groups and runtime beyond the live tensors; a GPU profile: CUDA, NCCL
    allocator: float = 0.0  # CPU: glibc's heap holes; a GPU profile: the caching allocator's slack
    head: float = 0.0  # of the activations, the units after the last block's: final norm, output head, logits, loss
    recompute: float = 0.0  # of the activations, a checkpointed block's recomputed ones (when beyond the head's)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at the peak of a training step, by kind; :class:`MemoryParts` the rest."""

    pp_rank: int
    params: float
    grads: float
    optimizer: float
    gathered: float  # FSDP's unsharded parameters and collective buffers, autocast's bf16 weight copies
    activations: float  # saved for backward, over the micro-batches in flight
    in_flight: int  # micro-batch x stage passes whose activations are held at once
    parts: MemoryParts = field(default_factory=MemoryParts)

    @property
    def live(self) -> float:
        """Bytes in tensors at the peak: the larger of backward's worst moment (what FSDP and autocast
        gathered, saved activations, what backward adds, and with accumulation all the gradients) and
        the optimizer step's (FSDP reshards after backward and autocast's copies die with it, so
        nothing gathered is left then); with ``ddp`` also the gradient reduce's, after backward
        (``parts.reduce``, see :func:`trainer.planner.memory.layout.replicate_reduce`)."""
        p = self.parts
        backward = self.activations + p.transient + p.stage_grads + (self.grads if p.accumulates else 0.0)
        step = self.grads + p.step_temporaries
        return self.params + self.optimizer + max(self.gathered + backward, p.reduce, step)

    @property
    def total(self) -> float:
        return self.live + self.process

    @property
    def reserved(self) -> float:
        """On a GPU, what the caching allocator holds at the peak (the live tensors and its slack): what
        ``torch.cuda.max_memory_reserved`` reports, and torchtitan's memory column; :attr:`total` adds the
        CUDA context and NCCL's buffers, which CUDA allocates outside it. On CPU, the resident peak less
        the runtime."""
        return self.live + self.parts.allocator

    @property
    def process(self) -> float:
        """What the process holds beyond its live tensors: on CPU its runtime and heap holes; on a
        hardware profile's GPU the CUDA context, NCCL's buffers and the caching allocator's slack."""
        return self.parts.runtime + self.parts.allocator

    @property
    def phase(self) -> str:
        """The moment of the step the peak is at: ``backward`` (its worst moment, the activations all
        there), ``gradient reduce`` (ddp's or a pipelined stage's, after backward) or ``optimizer step``."""
        p = self.parts
        backward = self.gathered + self.activations + p.transient + p.stage_grads + (self.grads if p.accumulates
                                                                                     else 0.0)
        moments = {"backward": backward, "gradient reduce": p.reduce, "optimizer step": self.grads + p.step_temporaries}
        return max(moments, key=moments.__getitem__)

    def terms(self) -> dict[str, float]:
        """The peak as named terms in bytes that add up to :attr:`total`, each one a user can act on
        (docs/planning.md, "Memory"): the state every moment holds, then the peak moment's own
        (:attr:`phase`), then what the process holds beyond its tensors. Terms of other moments are 0."""
        p, phase = self.parts, self.phase
        out = dict.fromkeys(MEMORY_TERMS, 0.0)
        out.update(weights=self.params, optimizer_state=self.optimizer, runtime=p.runtime, allocator_slack=p.allocator)
        if phase == "backward":
            out.update(gathered_parameters=self.gathered, activations=self.activations - p.head - p.recompute,
                       recompute=p.recompute, logits_and_loss=p.head, backward_transient=p.transient,
                       gradients=p.stage_grads + (self.grads if p.accumulates else 0.0))
        elif phase == "gradient reduce":
            out.update(gradient_reduce_buffers=p.reduce)
        else:
            out.update(gradients=self.grads, optimizer_step_temporaries=p.step_temporaries)
        return out


# The names of :meth:`MemoryEstimate.terms`, in the order plan.json and the dry run's text give them.
MEMORY_TERMS = ("weights", "optimizer_state", "gradients", "gathered_parameters", "activations", "recompute",
                "logits_and_loss", "backward_transient", "gradient_reduce_buffers", "optimizer_step_temporaries",
                "runtime", "allocator_slack")


def predict_memory(cfg: RunConfig, plan: ParallelPlan, *, model: nn.Module | None = None,
                   cache: dict | None = None,
                   attention: Callable[..., torch.Tensor] = flash_attention_for_cpu) -> list[MemoryEstimate]:
    """One :class:`MemoryEstimate` per pp rank (one without a pipeline). A planner comparing many
    layouts passes the meta ``model`` it built once and a ``cache`` dict: the meta pass (the costly
    part) depends only on the tp size, the micro-batch and the precision, and is reused.
    ``attention``: the meta pass's attention kernel (see :func:`saved_activations`); default
    :func:`flash_attention_for_cpu`, the fused kernel a CPU run uses."""
    # A launch prices its config up to three times (the validation's budget check, plan.txt, the
    # prediction rank 0 prints): the meta pass, the costly part, is counted once (pass_cache).
    return _predict_memory(cfg, plan, model=model, cache=cache, attention=attention)


def _predict_memory(cfg: RunConfig, plan: ParallelPlan, *, model: nn.Module | None,
                    cache: dict | PassCache | None, attention: Callable[..., torch.Tensor]) -> list[MemoryEstimate]:
    if plan.pipeline is not None and plan.pipeline.stages:  # each stage by its own layout
        return [predict_memory(view_cfg, view, attention=attention)[i]
                for i, (view_cfg, view) in enumerate(stage_views(cfg, plan))]

    numbers = plan_numbers(cfg, plan, model=model)
    t = cfg.train
    micro = cfg.micro_batch_size
    tp = plan.mesh.size(sorted({a for axes in plan.placements.values() for a in axes}))
    key = (tp, micro, t.precision, bool(plan.layouts), attention, plan.context_parallel, plan.cp_size,
           expert_split(plan),
           plan.loss_parallel, t.loss_chunk_tokens, split_key(plan))
    if cache is None and model is None and (shared := pass_key(cfg, plan, micro, attention)) is not None:
        cache, key = PASSES, shared  # one process validating many configs of a model (pass_cache)
    if cache is None or key not in cache:
        saved = saved_activations(cfg, plan, micro, model=model, attention=attention)
        if cache is not None:
            cache[key] = saved
    else:
        saved = cache[key]
    pp, dp = plan.pipeline, plan.param_data_parallel  # cp ranks shard parameters as dp ranks
    stage_units = pp.stage_units if pp else (tuple(plan.units),)
    wrapped, cores = checkpointed(plan), core_recomputed(plan)
    shard = plan.mesh.size(dp.shard_dim_names) if dp is not None else 1
    # With accumulation (grad_accum, a pipeline's micro-batches) earlier passes' gradients are all there
    # beside later activations (MemoryEstimate.live adds them); else backward makes them as it frees
    # activations and the census gives both at its worst moment, FSDP keeping 1/shard once reduce-scattered.
    # On a GPU, FSDP2 allocates each block's reduce-scatter output, of which the sharded gradients are
    # views, on its reduce-scatter stream (torch.distributed.fsdp's foreach_reduce), and the caching
    # allocator reuses a freed block only for the stream it was allocated on: from the second step on,
    # the gradients the optimizer step freed stay reserved for that stream through the next forward and
    # backward's worst moment, where this step's gradients are made again in the same blocks.
    stream_held = on_cuda(cfg) and fsdp(plan) and pp is None
    accumulates = pp is not None or t.grad_accum > 1 or stream_held
    keep = 0.0 if accumulates else 1.0 / shard if dp is not None and dp.mode not in REPLICATED_DP_MODES else 1.0
    keep *= expert_share(plan, numbers)  # ep: the meta pass makes every expert's gradient, a rank 1/ep of them
    # A pipelined stage accumulates its micro-batches' gradients (FSDP2's unsharded: in_flight_peak);
    # FSDP2's sharded ones appear only as the stage's final reduce frees those, so beside the
    # activations they are there only from an earlier accumulation step.
    pipelined_fsdp = pp is not None and fsdp2(plan)
    sharded_grads_in_backward = (t.grad_accum > 1 and (pipelined_fsdp or pp is None)) or stream_held
    backward = saved["timeline"][saved["forward_ops"]:] or [(0.0, 0.0)]
    # The forward's own worst moment counts too: a chunked loss holds the logits beside the gradient it makes
    # from them (measured: 998 MiB per rank, tp [4], 32k vocabulary, 2048 tokens; 804 predicted from backward alone).
    forward_end = max((a for a, _ in saved["timeline"][:saved["forward_ops"]]), default=0.0)
    transient = max(0.0, max(forward_end, *(a + keep * g for a, g in backward)) - sum(saved["units"].values()))
    cpu = not on_cuda(cfg)
    out = []
    for rank_numbers in numbers.per_pp_rank:
        r = rank_numbers.pp_rank
        held = [u for s in rank_numbers.stages for u in stage_units[s]]
        acts, recompute = 0.0, 0.0
        for unit in held:
            full = saved["units"].get(unit, 0.0)
            if unit in wrapped:  # checkpointed: only the block's input is kept; recomputed in backward
                acts += saved["block_inputs"].get(unit, 0.0)
                recompute = max(recompute, full)
            elif unit in cores:  # selective: the attention core's own saved tensors, one block's at a time
                core = saved.get("cores", {}).get(unit, 0.0)
                acts += full - core
                recompute = max(recompute, core)
            else:
                acts += full
        # The head (final norm, output, loss: the units after the last block) runs backward first, at the
        # transient's worst moment when its vocabulary-wide logits dominate; a checkpointed block recomputes
        # its activations later, once the head's saved tensors are freed: only what exceeds those adds up.
        head = sum(saved["units"].get(u, 0.0) for u in _after_blocks(plan, held))
        recompute = max(0.0, recompute - head)
        in_flight = passes_in_flight(plan, r)
        blocks = [saved["unit_params"].get(u, []) for u in held if u in plan.blocks]
        root = sum(sum(saved["unit_params"].get(u, [])) for u in held if u not in plan.blocks)
        local = rank_numbers.params * 4.0
        # The part of it that trains (LoRA: the adapters): gradients, their buffers and reduces.
        trained = local * (rank_numbers.grad_bytes / rank_numbers.param_bytes if rank_numbers.param_bytes else 1.0)
        held_acts, held_grads = acts, 0.0
        if pp is not None:
            chunks = max(1, len(rank_numbers.stages))
            # FSDP2's pipelined stage accumulates unsharded gradients in the compute dtype; else param.grad
            stage_grads = rank_numbers.grad_bytes
            if pipelined_fsdp:
                stage_grads = trained * (0.5 if t.precision == "bf16" else 1.0)
            held_acts, held_grads = in_flight_peak(plan, in_flight, acts / chunks, stage_grads, chunks,
                                                   accumulated=t.grad_accum > 1 and not pipelined_fsdp)
            head *= held_acts / acts if acts else 0.0  # the head's passes in flight, as the rest's
        estimate = MemoryEstimate(
            pp_rank=r, params=rank_numbers.param_bytes, grads=rank_numbers.grad_bytes,
            optimizer=rank_numbers.optim_bytes, gathered=gathered(cfg, plan, local, blocks, root),
            activations=held_acts + recompute, in_flight=in_flight,
            parts=MemoryParts(accumulates=sharded_grads_in_backward, stage_grads=held_grads, micro_batch=micro,
                              head=head, recompute=recompute,
                              step_activations=(acts + recompute) * (pp.num_microbatches if pp else 1),
                              transient=transient,
                              step_temporaries=4.0 * saved["largest_trainable"] / shard))
        at_peak = estimate.gathered + estimate.activations + transient + held_grads
        if pipelined_fsdp:
            reduce, mapped = stage_reduce(cfg, plan, local, blocks, at_peak, trained=trained)
        else:
            reduce, mapped = replicate_reduce(cfg, plan, trained, at_peak)
        estimate = replace(estimate, parts=replace(estimate.parts, reduce=reduce))
        # A pipelined stage's unsharded parameters are allocated once a step and live through all its
        # micro-batches: their heap holes are FSDP's per-parameter term, not cycled memory's.
        cycled = estimate.live - estimate.params - estimate.optimizer - (estimate.gathered if pipelined_fsdp else 0.0)
        if estimate.live - estimate.params - estimate.optimizer == reduce:  # mmapped buffers leave no heap holes
            cycled -= mapped
        if cpu:
            allocator = host_overhead(cfg, plan, max(0.0, cycled), blocks, estimate.parts.step_activations)
            estimate = replace(estimate, parts=replace(estimate.parts, runtime=runtime(plan), allocator=allocator))
        elif (gpu := cfg.hardware.runtime_memory) is not None and not cfg.hardware.is_host:
            # A profile's device: the CUDA context and NCCL's buffers, and the caching allocator's
            # blocks held beyond the live tensors at the peak (a share of them).
            estimate = replace(estimate, parts=replace(estimate.parts, runtime=(gpu.cuda_context_gib + (
                gpu.nccl_gib if plan.mesh.world_size > 1 else 0.0)) * GIB,
                                                       allocator=gpu.allocator_slack * estimate.live))
        out.append(estimate)
    return out


def _after_blocks(plan: ParallelPlan, held: list[str]) -> list[str]:
    """Of the units a rank holds, those after the model's last block (final norm, output head, loss)."""
    if not plan.blocks:
        return []
    last = plan.units.index(plan.blocks[-1]) if plan.blocks[-1] in plan.units else len(plan.units)
    return [u for u in held if u in plan.units and plan.units.index(u) > last]
