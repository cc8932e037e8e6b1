"""What a CPU worker's resident memory holds beyond its live tensors: the terms
:func:`trainer.planner.memory.predict.predict_memory` adds on CPU, so that its total compares with the resident
high-water mark above the worker's start-up floor (:class:`trainer.run.metrics.MemoryMeter`).

Each term is named, says what it is, and how it was measured (Llama-shaped 25M and 100M models,
global batch 8 x 128 tokens, 3 steps; ``tests/bench/bench_memory.py``). The measurements that
separate them:

* Heap holes are the whole gap. Run with ``MALLOC_MMAP_THRESHOLD_=131072`` (glibc then serves
  every block from 128 KiB up with its own mmap and unmaps it on free, so no hole stays
  resident), a rank's peak is the live tensors :mod:`trainer.planner.memory.predict` predicts plus 39-51 MiB
  (25M: fsdp [2] 397 MiB for 358 live, fsdp [8] 170 for 119, dp x tp [2, 2] 250 for 207; 15-32 MiB
  when re-measured on 2026-11-27: :data:`RUNTIME_DISTRIBUTED`), against
  545-714 MiB with glibc's default dynamic threshold. (Not the default: that threshold costs one
  process ~40% more CPU time per step in page faults, measured on the 25M Llama.)
* The process groups are not: a script that only builds a mesh of [2], [4], [8], [2, 2] or
  [2, 2, 2] ranks and runs one collective on every axis grows 2-3 MiB per rank above the floor
  (the default group exists before the floor is read; a sub-group adds three threads).
* A pipeline's import is not: torch builds the schedule on the first step, after the floor, and
  ``torch.distributed.pipelining`` pulls in ``torch._dynamo``, ``torch._inductor`` and ``torch.onnx``
  (224 modules, 30 MiB), but the workers' fork server preloads those (:func:`runtime`).
* ``launch.unmap_freed_memory`` sets that threshold for a run (``mallopt``, from 128 KiB): fsdp [8]
  then measured 166 / 408 MiB per rank (25M / 100M) for 165 / 387 predicted as live tensors plus
  the runtime, against 543 / 1,567 MiB with the default heap.
* ``malloc_stats()`` at the end of an fsdp [8] run: the main arena holds 490-605 MB (25M) and
  1.1-1.8 GB (100M) for 162 MB / 0.4 GB in use; each of gloo's two worker threads' arenas holds
  14-64 MB (25M) and about 56 MB (100M) with nothing in use.
"""

from __future__ import annotations

import ctypes
import platform

from parallel.config import REPLICATED_DP_MODES
from parallel.plan.spec import ParallelPlan
from trainer.config.schema import RunConfig
from trainer.planner.numbers import MIB

# A CPU worker's own memory before training, below the floor the plan counts from: the interpreter,
# torch and the trainer's modules, anonymous pages (RssAnon 198 MiB after importing trainer.run.loop; the
# 80 MiB of file-backed code pages are shared by all workers of a host). Without it, 8 workers of a
# 1B model, each predicted within 90% of the host's memory / 8, were OOM-killed together.
WORKER_FLOOR = 200 * MIB
# glibc serves requests from 32 MiB up with their own mmap, unmapped on free; smaller ones come from
# the heap (its dynamic mmap threshold rises to the largest freed block, at most 32 MiB).
MMAP_FROM = 32 * MIB

# Resident at the peak beyond the live tensors when no heap hole stays resident (measured with the
# fixed mmap threshold above): one process, the batch, the autograd engine's and the loop's buffers;
# several, also FSDP's and DTensor's per-module state and the code pages first run after the floor.
# Measured 2026-11-27 (launch.unmap_freed_memory, 3 steps, the largest rank's peak less the live
# tensors predicted): 21-32 MiB on fsdp [2], [4], [8] of gpt_debug and the 25M Llama, on fsdp [4] of
# 2 layers of width 512 and of 16 of width 64, and 15-24 on cp [2], [4], [8] of gpt_debug at 4,096
# and 16,384 tokens; median 23, no trend with the ranks, layers or width. (The 39-51 MiB measured on
# 25M models in November's bench runs no longer reproduce: 25M fsdp [8] measured 151 MiB for its
# 166 then.)
RUNTIME_SINGLE = 10 * MIB
RUNTIME_DISTRIBUTED = 24 * MIB
# An expert-parallel rank holds more beside its live tensors than a dense one, not itemised yet (the
# all-to-all's buffers, of sizes that change with the routing, are the likely part): gpt_moe ep [8]
# (experts 2048 wide, 4 steps) measured 80 MiB unmapped for 73 predicted with the runtime above (7 more),
# 96-101 MiB with the default heap for 83 (13-18 more). The middle of the two:
RUNTIME_EXPERT_PARALLEL = 12 * MIB

# Heap holes around the memory a step allocates and frees (activations, gradients, temporaries): the
# freed chunks stay resident and are reused only by requests that fit, so from the second step on the
# high-water mark settles this far above that cycled memory's live peak: 29-39% on one process and
# pipeline / tensor-parallel ranks (25M and 100M, batch 8-64, seq 128-256).
FRAGMENTATION = 0.35

# Heap holes per byte of the activations a step allocates over all its passes (every micro-batch a
# pipeline rank runs, not only those in flight at once): each pass allocates afresh between the
# survivors of the others and of backward's gradients. Fitted on issue 16's planner sweep (65
# layouts of 3M-25M Llamas on 8 ranks, tests/bench/data/planner_2026-11-24_evening.rows.jsonl): the
# holes measured (default heap minus live tensors and runtime) came to 0.35-0.8x these bytes on
# pipelined ranks (median about 0.6) and 0.6-0.9x on tp8, against 0.3-1.3x the cycled peak
# FRAGMENTATION scales. One process is the exception: its rows (25M-1B,
# tests/bench/data/memory_25m-1b.rows.jsonl) fit FRAGMENTATION alone, and this term would put 100M
# 10% over.
# A cp rank too, since the blocks keep less (trainer/models/layers.py): gpt_debug on cp [4], 2 rows of 16,384
# tokens, measured 271-289 MiB, 184 with freed memory unmapped, so 87-105 MiB of holes for 137 MiB of
# activations (0.6-0.75x; FRAGMENTATION of the cycled peak gives 54). Before, when they kept 185 MiB, the holes
# were 85 MiB (0.46x) and FRAGMENTATION alone fitted: the ring's blocks, not the saved bytes, set most of them.
# A pipeline's are measured in heap extent too (mallinfo2 at each action, 25M dp2 x pp4, rank 0):
# the heap grows as the four micro-batches' activations come and go, then by ddp's flat buffers.
STEP_FRAGMENTATION = 0.6

# Heap holes FSDP leaves, per byte of its block-sized flat buffers that pass through the heap in a
# step (each block's all-gather outputs, one per gather, and its reduce-scatter input). Between a
# block's all-gather and its free, that block's unsharded parameters and activations are carved
# out of the holes, so the next block's flat buffer seldom fits one and extends the heap. The
# step's other cycled memory is placed in these same holes, so the larger of the two counts, not
# their sum (except on a pipelined stage: host_overhead). Summed over a step the holes come to
# about the flat bytes, whatever the number of ranks (the buffers are a whole block's, not a
# shard's): main-arena holes 0.75-1.06x the flat
# bytes on fsdp [2], [8] and dp x tp [2, 2] (25M), 0.95x on fsdp [8] (100M). This is why the gap to
# the live tensors grew with the ranks: the live bytes shrink as 1 / ranks, the holes do not.
FSDP_FLAT = 1.0
# From 400M on, a block's flat buffers pass 32 MiB and are mmapped (no holes), while its unsharded
# parameters and gradients, one tensor per parameter, stay below it and come from the heap: a fifth
# of their bytes per step stay resident in holes, beside the cycled memory's own (fsdp [8], 400M:
# 2236 MiB measured for 1077 live, 0.21x). Below 400M both fit the flat buffers' larger holes.
FSDP_PER_PARAM = 0.2

# gloo runs a group's collectives on its own worker threads (two per group), which copy FSDP's flat
# buffers in their own glibc arenas; each arena's heap keeps about two of the largest resident
# with nothing in use between steps: 14-64 MB per arena (25M, 12 MiB blocks) and 56 MB (100M, 27 MiB
# blocks) in malloc_stats() at the end of fsdp [8] runs.
GLOO_THREADS, GLOO_BUFFERS_PER_ARENA = 2, 2


# launch.unmap_freed_memory: mallopt(M_MMAP_THRESHOLD, 128 KiB), which also stops glibc raising the
# threshold as blocks are freed. Measured with this threshold, a rank's peak is its live tensors plus
# the runtime above: no heap-hole term.
M_MMAP_THRESHOLD, UNMAP_FROM = -3, 128 * 1024


def has_mallopt() -> bool:
    return platform.libc_ver()[0] == "glibc"


def unmap_freed_memory() -> None:
    """From now on this process serves every allocation from ``UNMAP_FROM`` up with its own
    mapping, unmapped when freed (glibc's ``mallopt``; the validator refuses the option elsewhere).
    Set from Python, not with ``MALLOC_MMAP_THRESHOLD_`` in the environment, so that a one-device
    run, which trains in the launching process, gets it too."""
    if not ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, UNMAP_FROM):
        raise OSError("mallopt(M_MMAP_THRESHOLD) was refused")


def runtime(plan: ParallelPlan) -> float:
    """The process's own resident bytes above its floor: the constants above (an ep rank's extra too). A
    pipeline's first step imports ``torch.distributed.pipelining``, after the floor, but that adds 1 MiB
    (measured) now that the workers' fork server preloads ``torch._dynamo``, ``torch._inductor`` and
    ``torch.onnx`` with it (:data:`trainer.launch.processes.PRELOAD`); pipelined runs measured 21-26 MiB
    above their live tensors (gpt_debug pp [2], the 25M Llama pp [4], unmapped)."""
    base = RUNTIME_DISTRIBUTED if plan.mesh.world_size > 1 else RUNTIME_SINGLE
    return base + (RUNTIME_EXPERT_PARALLEL if plan.expert_parallel is not None else 0.0)


def fsdp_heap_buffers(cfg: RunConfig, plan: ParallelPlan, blocks: list[list[float]]) -> tuple[list[float], float]:
    """``(sizes of FSDP's block-sized flat buffers served from the heap in one step, one entry per
    allocation; bytes of its per-parameter unsharded tensors from the heap in one step)``
    (``blocks``: each held block's tp-local fp32 parameter sizes); nothing without FSDP."""
    dp = plan.param_data_parallel  # FSDP shards over the cp ranks too
    if dp is None or dp.mode in REPLICATED_DP_MODES or plan.mesh.world_size == 1:
        return [], 0.0
    pdt = 0.5 if cfg.train.precision == "bf16" else 1.0  # all-gathers move the compute dtype
    gathers = 1 if dp.mode == "zero2" or plan.pipeline is not None else 2  # per block and step
    flat, per_param = [], 0.0
    for sizes in blocks:
        flat += [sum(sizes) * pdt] * gathers + [sum(sizes)]  # all-gather outputs, reduce-scatter input
        per_param += (gathers + 1) * sum(s * pdt for s in sizes if s * pdt < MMAP_FROM)  # parameters, gradients
    return [b for b in flat if b < MMAP_FROM], per_param


def host_overhead(cfg: RunConfig, plan: ParallelPlan, cycled: float, blocks: list[list[float]],
                  step_activations: float) -> float:
    """Resident bytes of glibc's heap holes at the peak (``cycled``: the live bytes a step
    allocates and frees at its peak, i.e. all but the weights and AdamW's moments;
    ``step_activations``: the activations it allocates over all its passes). Where FSDP's flat
    buffers come from the heap their holes hold the step's other cycled tensors; else those and
    FSDP's per-parameter ones, of like sizes, leave holes of their own; at least
    :data:`STEP_FRAGMENTATION` of the step's activations. Where FSDP's flat buffers outweigh the
    step's activations their holes and the activations' add up: the larger flat buffers fit in none of
    the activations' holes (issue 16's two planner sweeps: dp8 and dp4 x tp2 FSDP rows 8-13% under
    with the larger of the two, within 1-8% with the sum; dp2 x tp4, whose activations outweigh its
    flat buffers, within 3% with the larger). The holes grow over the first steps: 25M fsdp [2] and
    dp x tp [2, 2] measured 741 / 418 MiB after 3 steps, 783 / 459 after 5, 815 / 474 after 12, for
    844 / 489 predicted with the sum. A pipelined FSDP stage gathers its blocks
    before the first micro-batch and reduce-scatters them after the last, so its flat buffers' holes
    and its activations' add up (the planner sweep's 17 pipelined FSDP layouts: 0.9-1.3x the
    holes measured with the sum, 0.5-0.8x with the larger). With ``launch.unmap_freed_memory``
    nothing stays resident once freed: no holes."""
    if cfg.launch.unmap_freed_memory:
        return 0.0
    flat, per_param = fsdp_heap_buffers(cfg, plan, blocks)
    steps = STEP_FRAGMENTATION * step_activations if plan.mesh.world_size > 1 else 0.0
    flat_holes = FSDP_FLAT * sum(flat)
    # a pipelined stage's flat buffers and activations cycle at other times; larger flat buffers fit in
    # none of the activations' holes; else the activations' holes hold the flat buffers
    stacked = flat_holes + steps if plan.pipeline is not None or flat_holes >= steps else steps
    main_arena = max(stacked, FRAGMENTATION * cycled + FSDP_PER_PARAM * per_param)
    gloo_arenas = GLOO_THREADS * GLOO_BUFFERS_PER_ARENA * max(flat, default=0.0)
    return main_arena + gloo_arenas
