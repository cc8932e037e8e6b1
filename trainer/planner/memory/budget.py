"""A run's memory budget per rank, and the check of its predicted peak against it.

    budget, source = memory_budget(cfg)      # bytes per rank, and where the number comes from
    check_memory(cfg, plan)                  # [] or one ConfigIssue whose fix lists what would fit

The peak is :func:`trainer.planner.memory.predict.predict_memory`'s; the fix tries the usual ways to need less memory
per rank (activation checkpointing, more micro-batches, fsdp, accumulation, unmapped memory, bf16)
and names those predicted to fit. On CPU the budget is the host's memory shared by the workers it
starts, less what each worker holds before its first step, since the prediction counts from there.
"""

from __future__ import annotations

import math
import os

import torch

from parallel.errors import ConfigIssue
from parallel.plan.resolve import resolve_plan
from parallel.plan.spec import ParallelPlan
from trainer.config.schema import RunConfig
from trainer.models import build_model
from trainer.planner.memory.host import WORKER_FLOOR, has_mallopt
from trainer.planner.memory.layout import on_cuda
from trainer.planner.memory.predict import MemoryEstimate, predict_memory
from trainer.planner.numbers import GIB


def memory_budget(cfg: RunConfig) -> tuple[float, str]:
    """``(bytes per rank, where the number comes from)``: ``launch.memory_budget_gb``, else a
    hardware profile's device memory, else the GPU's memory when the run will use CUDA, else 90% of this host's memory shared by its workers,
    less what each worker holds before training (:data:`trainer.planner.memory.host.WORKER_FLOOR`)."""
    if cfg.launch.memory_budget_gb is not None:
        return cfg.launch.memory_budget_gb * GIB, "launch.memory_budget_gb"
    if not cfg.hardware.is_host and cfg.hardware.memory_gb is not None:
        return cfg.hardware.memory_bytes, f"hardware={cfg.hardware.name}: {cfg.hardware.memory_gb:g} GB per device"
    if on_cuda(cfg):
        return float(torch.cuda.get_device_properties(0).total_memory), "the GPU's memory"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    workers = max(1, cfg.world_size // cfg.launch.nnodes)
    # The plan counts from each worker's floor up; the floors themselves come out of the host's memory first.
    return 0.9 * host / workers - WORKER_FLOOR, (f"90% of this host's {host / GIB:.1f} GiB over {workers} worker(s), "
                                                f"less each one's own {WORKER_FLOOR / GIB:.2f} GiB")


def describe_estimate(e: MemoryEstimate) -> str:
    p = e.parts
    return (f"weights {e.params / GIB:.2f} + grads {e.grads / GIB:.2f} + AdamW {e.optimizer / GIB:.2f} + gathered "
            f"{e.gathered / GIB:.2f} + activations {e.activations / GIB:.2f} GiB ({e.in_flight} micro-batch pass"
            f"{'es' if e.in_flight != 1 else ''} in flight) + backward {p.transient / GIB:.2f} + process "
            f"{e.process / GIB:.2f} GiB")


def check_memory(cfg: RunConfig, plan: ParallelPlan):
    """A :class:`~parallel.errors.ConfigIssue` when the predicted per-rank peak exceeds the budget;
    its fix lists the changes predicted to fit."""
    budget, source = memory_budget(cfg)
    worst = max(predict_memory(cfg, plan), key=lambda e: e.total)
    if worst.total <= budget:
        return []
    fits = [what for what, changed in _remedies(cfg) if _peak(changed) <= budget]
    fix = ("set " + ", or ".join(fits[:4])) if fits else "use more ranks (a larger mesh with fsdp or tp), or a smaller model"
    return [ConfigIssue("launch.memory_budget_gb",
                        f"predicted peak {worst.total / GIB:.2f} GiB on pp rank {worst.pp_rank} "
                        f"({describe_estimate(worst)}) exceeds the budget of {budget / GIB:.2f} GiB per rank ({source})",
                        fix + " (or raise launch.memory_budget_gb if the budget is wrong)")]


def _peak(cfg: RunConfig) -> float:
    try:
        return predicted_peak_mib(cfg) * 2**20
    except ValueError:
        return math.inf


def predicted_peak_mib(cfg: RunConfig) -> float:
    """The plan's per-rank peak (the largest over pipeline ranks), MiB; raises what resolving the
    plan or the meta pass raises (e.g. a custom module the meta device cannot run)."""
    plan = resolve_plan(cfg.parallel, cfg.mesh, build_model(cfg.model, device="meta"))
    return max(e.total for e in predict_memory(cfg, plan)) / 2**20


def _remedies(cfg: RunConfig):
    """``(what to set, the changed config)`` for the usual ways to need less memory per rank."""
    par, t = cfg.parallel, cfg.train
    if par is not None and par.activation_checkpointing != "full":
        yield "parallel.activation_checkpointing=full", cfg.model_copy(update={"parallel": par.model_copy(
            update={"activation_checkpointing": "full", "activation_checkpointing_every": 1})})
    elif par is not None and par.activation_checkpointing_every > 1:  # full on every n-th block: on every block
        yield "parallel.activation_checkpointing_every=1", cfg.model_copy(update={"parallel": par.model_copy(
            update={"activation_checkpointing_every": 1})})
    if par is not None and par.pipeline is not None:
        for factor in (2, 4, 8):
            m = par.pipeline.microbatches * factor
            if t.global_batch_size // t.grad_accum // max(1, cfg.dp_size) >= m:
                yield f"parallel.pipeline.microbatches={m}", cfg.model_copy(update={"parallel": par.model_copy(
                    update={"pipeline": par.pipeline.model_copy(update={"microbatches": m})})})
                break
    if par is not None and par.data_parallel is not None and par.data_parallel.mode in ("ddp", "zero2"):
        yield "parallel.data_parallel.mode=fsdp", cfg.model_copy(update={"parallel": par.model_copy(
            update={"data_parallel": par.data_parallel.model_copy(update={"mode": "fsdp"})})})
    for factor in (2, 4, 8):
        if (t.global_batch_size // max(1, cfg.dp_size)) % (t.grad_accum * factor * cfg.num_microbatches) == 0:
            yield f"train.grad_accum={t.grad_accum * factor}", cfg.model_copy(update={"train": t.model_copy(
                update={"grad_accum": t.grad_accum * factor})})
    if not on_cuda(cfg) and not cfg.launch.unmap_freed_memory and has_mallopt():
        yield "launch.unmap_freed_memory=true", cfg.model_copy(update={"launch": cfg.launch.model_copy(
            update={"unmap_freed_memory": True})})
    if t.precision == "fp32":
        yield "train.precision=bf16", cfg.model_copy(update={"train": t.model_copy(update={"precision": "bf16"})})
