"""What a layout holds beyond the model's own tensors, for :func:`trainer.planner.memory.predict.predict_memory`:
FSDP's and ddp's unsharded parameters and their reduce, autocast's copies, and how many
micro-batches a pipeline schedule keeps in flight with the gradients beside them. Each term says
how it was measured."""

from __future__ import annotations

import torch

from parallel.config import INTERLEAVED_SCHEDULES, REPLICATED_DP_MODES, V_SCHEDULES
from parallel.plan.spec import ParallelPlan
from trainer.config.schema import RunConfig
from trainer.planner.memory.host import MMAP_FROM


def passes_in_flight(plan: ParallelPlan, pp_rank: int) -> int:
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


def in_flight_peak(plan: ParallelPlan, in_flight: int, per_pass: float, stage_grads: float, chunks: int,
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
    if accumulated:
        return per_pass * in_flight, stage_grads
    assert pp is not None, "in flight: a pipeline's passes"
    if pp.schedule not in ("GPipe", "1F1B") + INTERLEAVED_SCHEDULES + V_SCHEDULES:
        return per_pass * in_flight, stage_grads  # an unmodelled order: the bound
    passes = pp.num_microbatches * chunks
    options = [(per_pass * in_flight, 0.0), (per_pass * (in_flight - 1), first)]
    if passes > in_flight:
        options.append((per_pass * in_flight, first))
    return max(options, key=sum)


def on_cuda(cfg: RunConfig) -> bool:
    """The run's devices are GPUs: a GPU profile (``hardware=h100_sxm``, planned from any host) or
    ``device=cuda`` (or ``auto`` on a host that has one)."""
    return (cfg.hardware.device == "cuda" or cfg.device == "cuda"
            or (cfg.device == "auto" and torch.cuda.is_available()))


def fsdp(plan: ParallelPlan) -> bool:  # FSDP2 shards parameters (one rank: no data parallelism at all)
    dp = plan.param_data_parallel  # cp ranks shard parameters as dp ranks
    return dp is not None and dp.mode not in REPLICATED_DP_MODES and plan.mesh.world_size > 1


def replicated(plan: ParallelPlan) -> bool:  # ddp, zero1: FSDP2's replicate, the whole model (or stage) one unit
    dp = plan.param_data_parallel
    return dp is not None and dp.mode in REPLICATED_DP_MODES and plan.mesh.world_size > 1


def fsdp2(plan: ParallelPlan) -> bool:  # either runs on FSDP2's parameter groups
    return fsdp(plan) or replicated(plan)


def replicate_reduce(cfg: RunConfig, plan: ParallelPlan, local: float, heap: float) -> tuple[float, float]:
    """``(bytes beyond weights and AdamW while ddp reduces its gradients, after backward; of those,
    the flat buffers glibc maps on their own)``. ``local``: this rank's fp32 bytes of the parameters
    that train (all of them, or LoRA's adapters: frozen weights have no gradient to reduce);
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
    accumulated (:func:`stage_reduce`)."""
    if not replicated(plan) or plan.pipeline is not None:
        return 0.0, 0.0
    pdt = 0.5 if cfg.train.precision == "bf16" else 1.0
    if on_cuda(cfg) or cfg.launch.unmap_freed_memory:  # what backward freed is reused or returned
        return max(local * pdt + local, 2 * local), 0.0
    return heap + 2 * local, 2 * local if local >= MMAP_FROM else 0.0


def stage_reduce(cfg: RunConfig, plan: ParallelPlan, local: float, blocks: list[list[float]],
                  heap: float, *, trained: float | None = None) -> tuple[float, float]:
    """``(bytes beyond weights and AdamW while a pipelined FSDP2 stage reduces what its micro-batches
    accumulated, after its last backward; of those, the ones that leave no heap holes)``. ``heap``:
    what backward's peak held beyond weights and AdamW.

    In tensors: the unsharded gradients and, ddp, one fp32 flat buffer of the stage (the unsharded
    copy is freed first), FSDP, the unsharded parameters and one block's fp32 reduce-scatter input.
    (Measured in use, 25M, dp2 x pp4, pp rank 0: 1.8 MiB above ddp's gradients and copy during the
    reduce, 9.6 above FSDP's.) On CPU ddp's two flat buffers do not fit the holes the activations
    left: glibc extends the heap by both, above backward's peak and its holes, and trims them off
    again before the next step (heap extent, same run: +46.6 MiB at the reduce for 2 x 24.6).
    ``trained``: the bytes of ``local`` that train (LoRA's adapters; default all): the gradients."""
    pdt = 0.5 if cfg.train.precision == "bf16" else 1.0
    trained = local if trained is None else trained
    if not replicated(plan):
        return local * pdt + trained * pdt + max((sum(b) for b in blocks), default=0.0) * trained / max(local, 1.0), 0.0
    if on_cuda(cfg) or cfg.launch.unmap_freed_memory:
        return trained * pdt + trained, 0.0
    return heap + 2 * trained, 2 * trained


def gathered(cfg: RunConfig, plan: ParallelPlan, local: float, blocks: list[list[float]], root: float) -> float:
    """Unsharded parameter bytes at the backward's peak (``local``: this rank's tp-local fp32
    parameter bytes; ``blocks``: each held block's parameter sizes; ``root``: the others' bytes).
    FSDP2 keeps the root's parameters (embeddings, final norm, head) unsharded from forward to
    backward and, early in backward while the activations are all there, one block's unsharded
    parameters and the next one's (prefetched) with the all-gather output they are copied from.
    zero2 keeps every parameter unsharded, plus one block's unsharded gradients and fp32
    reduce-scatter input. A pipelined stage keeps every parameter unsharded: torch's
    ``PipelineStage`` runs each micro-batch's backward with gradient sync and resharding off and
    reduces the whole stage once, after the last (``perform_reduce_grad``); the unsharded
    gradients it accumulates until then: :func:`in_flight_peak`, the reduce: :func:`stage_reduce`.
    Unsharded, bf16 autocast keeps a bf16 copy of every weight."""
    half = cfg.train.precision == "bf16"
    pdt = 0.5 if half else 1.0  # gathered parameters and unsharded gradients are in the compute dtype
    if replicated(plan) or (fsdp(plan) and plan.pipeline is not None):
        return local * pdt  # ddp: one unit's unsharded copy; a pipelined FSDP stage keeps it all unsharded
    if not fsdp(plan):
        return local * 0.5 if half else 0.0
    block = max((sum(b) for b in blocks), default=0.0)
    dp = plan.param_data_parallel
    assert dp is not None, "fsdp(plan) holds"
    if dp.mode == "zero2":
        return local * pdt + block * (pdt + 1.0)
    return root * pdt + 3 * block * pdt


def expert_split(plan: ParallelPlan) -> tuple[int, tuple[str, ...]]:
    """``(ep size, the expert modules' FQN prefixes)``: ``(1, ())`` without expert parallelism."""
    return plan.topology.ep_size, plan.topology.expert_prefixes


def expert_share(plan: ParallelPlan, numbers) -> float:
    """The share of the meta pass's parameters (every expert of every block, at tp-local shapes) the
    largest rank holds, and so of the gradients its backward makes: 1 without expert parallelism; with
    it, a rank holds 1/ep of the experts (``numbers``: :func:`trainer.planner.numbers.plan_numbers`)."""
    ep, _ = expert_split(plan)
    rank = max(numbers.per_pp_rank, key=lambda r: r.params)
    every = rank.params + rank.expert_params * (ep - 1)
    return rank.params / every if every else 1.0


def checkpointed(plan: ParallelPlan) -> set[str]:
    """The blocks ``full`` checkpointing wraps whole (every ``activation_checkpointing_every``-th): each keeps
    only its input, and its forward runs again in backward."""
    if plan.activation_checkpointing == "full":
        every = plan.activation_checkpointing_every
        return {b for i, b in enumerate(plan.blocks) if (i + 1) % every == 0}
    return set()


def core_recomputed(plan: ParallelPlan) -> set[str]:
    """The blocks whose attention core ``selective`` recomputes (every block): each drops what the attention
    kernel saves beyond q, k, v, and runs that kernel's forward again in backward."""
    return set(plan.blocks) if plan.activation_checkpointing == "selective" else set()
