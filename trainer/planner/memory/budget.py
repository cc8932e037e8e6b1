"""A run's memory budget per rank, and the check of its predicted peak against it.

    budget, source = memory_budget(cfg)      # bytes per rank, and where the number comes from
    verdict = memory_verdict(cfg, peak)      # fits / may not fit (within the measured error) / does not fit
    check_memory(cfg, plan)                  # [] or one ConfigIssue whose fix lists what would fit

On a GPU profile the prediction is checked against published runs (tests/bench/bench_profiles.py) and
is only as good as its error there: a layout is refused only where its predicted peak exceeds the
budget by more than :data:`PUBLISHED_MEMORY_ERROR`; between the budget and that, the dry run and the
launch warn, naming the margin, and go on (a planner that refuses a layout known to train is worse
than none). On this host the prediction is measured against this host's runs: the budget is the line.

The peak is :func:`trainer.planner.memory.predict.predict_memory`'s; the fix tries the usual ways to need less memory
per rank (activation checkpointing, more micro-batches, fsdp, accumulation, unmapped memory, bf16)
and names those predicted to fit. On CPU the budget is the host's memory shared by the workers it
starts, less what each worker holds before its first step, since the prediction counts from there.
"""

from __future__ import annotations

import math
import os

import torch

import sys
from dataclasses import dataclass

from parallel.errors import ConfigIssue
from parallel.plan.resolve import resolve_plan
from parallel.plan.spec import ParallelPlan
from trainer.config.schema import RunConfig
from trainer.models.skeleton import meta_model
from trainer.planner.memory.host import WORKER_FLOOR, has_mallopt
from trainer.planner.memory.layout import on_cuda
from trainer.planner.memory.predict import MemoryEstimate, predict_memory
from trainer.planner.numbers import GIB


# The GPU-profile prediction's largest |error| on the published rows that publish memory (against
# MemoryEstimate.reserved: torchtitan's column is torch.cuda.max_memory_reserved; nanotron's figure does not
# say), each predicted for the engine that made it (tests/bench/bench_profiles.py row_model: torchtitan's and
# nanotron's MLP keep silu(gate), this engine's does not; tests/bench/engine_state.py: nanotron's bf16 weights,
# fp32 gradient buffers of every parameter, fp32 master weights and AdamW moments, DDP's buckets, read in its
# source), rounded up to a whole percent: 30 rows, 4 torchtitan Llama 3.1 8B FSDP rows on H100 (-3% to +5%) and
# nanotron's 26 dp x tp x pp layouts on H100 (-41% to +30%, median 8.7%; the two worst its 80B on pp 16 and 32);
# median |error| 8.0%. Measured 2026-11-29. tests/unit/test_memory_margin.py recomputes it from those rows: a
# change of the predictor or of the rows that moves it fails there until this line is updated.
PUBLISHED_MEMORY_ERROR = 0.42
PUBLISHED_MEMORY_ROWS = 30

# The share of a GPU's nominal memory CUDA shows as its total: the datasheets' HBM "GB" are binary
# (16 GiB stacks), of which the driver keeps a little. Measured: an H100 SXM5 "80 GB" reports
# total_memory 85,017,493,504 bytes = 79.18 GiB = 0.9897 x 80 GiB
# (tests/bench/results/h100_sxm_2026-11-26_a.json, "memory_bytes"); torchtitan's benchmarks name the
# 96 GB HBM2e part "95 GiB" (benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md): 0.9897 x 96 = 95.0.
VISIBLE_SHARE = 0.9897


def device_memory(hw) -> float:
    """Bytes CUDA shows as a profile's device's total memory (``hardware.memory_gb`` as the datasheet
    states it: nominal GiB, of which :data:`VISIBLE_SHARE`)."""
    return hw.memory_gb * GIB * VISIBLE_SHARE


def memory_budget(cfg: RunConfig) -> tuple[float, str]:
    """``(bytes per rank, where the number comes from)``: ``launch.memory_budget_gb``, else a
    hardware profile's device memory, else the GPU's memory when the run will use CUDA, else 90% of this host's memory
    shared by its workers, less what each worker holds before training
    (:data:`trainer.planner.memory.host.WORKER_FLOOR`)."""
    if cfg.launch.memory_budget_gb is not None:
        return cfg.launch.memory_budget_gb * GIB, "launch.memory_budget_gb"
    if not cfg.hardware.is_host and cfg.hardware.memory_gb is not None:
        return device_memory(cfg.hardware), (f"hardware={cfg.hardware.name}: {cfg.hardware.memory_gb:g} GB per device, "
                                             f"{device_memory(cfg.hardware) / GIB:.1f} GiB as CUDA shows it")
    if on_cuda(cfg):
        return float(torch.cuda.get_device_properties(0).total_memory), "the GPU's memory"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    workers = max(1, cfg.world_size // cfg.launch.nnodes)
    # The plan counts from each worker's floor up; the floors themselves come out of the host's memory first.
    return 0.9 * host / workers - WORKER_FLOOR, (f"90% of this host's {host / GIB:.1f} GiB over {workers} worker(s), "
                                                f"less each one's own {WORKER_FLOOR / GIB:.2f} GiB")


def describe_estimate(e: MemoryEstimate) -> str:
    """The peak by named term (:meth:`MemoryEstimate.terms`), the zero ones left out:
    ``weights 3.74 + optimizer state 7.48 + ... GiB at backward, 1 micro-batch pass in flight`` (MiB below 1 GiB)."""
    scale, unit = (GIB, "GiB") if e.total >= GIB else (2**20, "MiB")  # a small model's terms in MiB
    terms = " + ".join(f"{name.replace('_', ' ')} {value / scale:.2f}" for name, value in e.terms().items() if value)
    return f"{terms} {unit} at {e.phase}, {e.in_flight} micro-batch pass{'es' if e.in_flight != 1 else ''} in flight"


@dataclass(frozen=True)
class MemoryVerdict:
    """A predicted peak against the budget: ``status`` is ``fits``, ``may not fit`` (above the budget,
    within the prediction's measured error: a warning) or ``does not fit`` (beyond it: a refusal)."""

    peak: float  # bytes, the worst rank's
    budget: float
    limit: float  # the budget plus the measured error's margin: refused above this
    error: float  # the prediction's measured error (0 where the budget itself is the line)
    status: str
    source: str

    @property
    def refused(self) -> bool:
        return self.status == "does not fit"

    def margin(self) -> str:
        """``predicted X GiB, budget Y GiB, measured error Z% on N published rows``."""
        text = f"predicted {self.peak / GIB:.2f} GiB, budget {self.budget / GIB:.2f} GiB ({self.source})"
        if self.error:
            text += (f", measured error {self.error:.0%} on {PUBLISHED_MEMORY_ROWS} published rows "
                     f"(refused above {self.limit / GIB:.2f} GiB)")
        return text

    def warning(self) -> str | None:
        """The line the dry run and a launch print for a layout that may not fit; None otherwise."""
        if self.status != "may not fit":
            return None
        return (f"warning: memory may not fit: {self.margin()}; the prediction is within its error of the budget, "
                "so the run goes on (set parallel.activation_checkpointing=full or use more ranks to be sure)")


def memory_margin(cfg: RunConfig) -> float:
    """The error a GPU profile's prediction is allowed before a refusal: :data:`PUBLISHED_MEMORY_ERROR`;
    0 on this host, whose prediction is checked against its own runs."""
    return 0.0 if cfg.hardware.is_host else PUBLISHED_MEMORY_ERROR


def memory_verdict(cfg: RunConfig, peak: float) -> MemoryVerdict:
    """``peak`` (bytes, the worst rank's predicted total) against the run's budget and margin."""
    budget, source = memory_budget(cfg)
    error = memory_margin(cfg)
    limit = budget * (1 + error)
    status = "fits" if peak <= budget else "may not fit" if peak <= limit else "does not fit"
    return MemoryVerdict(peak=peak, budget=budget, limit=limit, error=error, status=status, source=source)


def check_memory(cfg: RunConfig, plan: ParallelPlan):
    """A :class:`~parallel.errors.ConfigIssue` when the predicted per-rank peak exceeds the budget
    beyond the prediction's measured error (:func:`memory_verdict`); its fix lists the changes
    predicted to fit. Within the error it prints the warning and refuses nothing."""
    worst = max(predict_memory(cfg, plan), key=lambda e: e.total)
    verdict = memory_verdict(cfg, worst.total)
    if not verdict.refused:
        if (line := verdict.warning()) is not None:
            print(line, file=sys.stderr)
        return []
    fits = [what for what, changed in _remedies(cfg) if not memory_verdict(changed, _peak(changed)).refused]
    fix = (("set " + ", or ".join(fits[:4])) if fits
           else "use more ranks (a larger mesh with fsdp or tp), or a smaller model")
    beyond = f", beyond the prediction's measured error of {verdict.error:.0%}" if verdict.error else ""
    return [ConfigIssue("launch.memory_budget_gb",
                        f"predicted peak {worst.total / GIB:.2f} GiB on pp rank {worst.pp_rank} "
                        f"({describe_estimate(worst)}) exceeds the budget of {verdict.budget / GIB:.2f} GiB per rank "
                        f"({verdict.source}){beyond}",
                        fix + " (or raise launch.memory_budget_gb if the budget is wrong)")]


def _peak(cfg: RunConfig) -> float:
    try:
        return predicted_peak_mib(cfg) * 2**20
    except ValueError:
        return math.inf


def predicted_peak_mib(cfg: RunConfig, plan: ParallelPlan | None = None) -> float:
    """The plan's per-rank peak (the largest over pipeline ranks), MiB; raises what resolving the
    plan or the meta pass raises (e.g. a custom module the meta device cannot run). ``plan``: the
    config's, when the caller has it (the launcher: validation's)."""
    plan = plan if plan is not None else resolve_plan(cfg.parallel, cfg.mesh, meta_model(cfg.model))
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
    if par is not None and par.data_parallel is not None and par.data_parallel.mode in ("ddp", "zero1", "zero2"):
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
