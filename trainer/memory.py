"""Per-rank peak memory of a config, activations included, predicted before any worker starts.

Weights, gradients and AdamW state come from the plan (:func:`trainer.plan.plan_numbers`: what each
rank holds after pipeline split, tensor and data-parallel sharding). Activations are not guessed
from a formula: the model runs one forward pass (and the loss) on the meta device, with each
tensor-parallel parameter at its local shape and a micro-batch of the run's shape, and every
tensor autograd saves for backward is counted (``torch.autograd.graph.saved_tensors_hooks``), per
pipeline unit and per block. That is exact for any model source's own code, then scaled by what the
schedule keeps in flight, activation checkpointing and sequence parallelism:

    est = predict_memory(cfg, plan)          # one MemoryEstimate per pp rank
    est[0].total / 2**30                     # GiB at the peak of a training step on pp rank 0

On CPU the real attention kernel keeps only its log-sum-exp (not the T x T scores); the meta
device would take the math path and count the scores, so the counting pass uses the fused
kernel's own autograd formula.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from parallel.config import INTERLEAVED_SCHEDULES, V_SCHEDULES
from parallel.plan import ParallelPlan
from trainer.config import RunConfig


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at the peak of a training step, by kind."""

    pp_rank: int
    params: float
    grads: float
    optimizer: float
    gathered: float  # FSDP's unsharded parameters, autocast's bf16 weight copies
    activations: float  # saved for backward, over the micro-batches in flight
    in_flight: int  # micro-batch x stage passes whose activations are held at once
    parts: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        # Gradients appear as activations are released in backward; with micro-batches or
        # accumulation the first ones' gradients live beside the later ones' activations.
        overlap = self.activations + self.grads if self.parts.get("accumulates") else max(self.activations, self.grads)
        return self.params + self.optimizer + self.gathered + overlap


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


def _unit_of(fqn: str, units: tuple[str, ...]) -> str | None:
    for unit in units:
        if fqn == unit or fqn.startswith(unit + "."):
            return unit
    return None


def saved_activations(cfg: RunConfig, plan: ParallelPlan, micro_batch: int) -> dict:
    """Bytes autograd saves for one micro-batch of ``micro_batch`` sequences: ``{"units": {unit:
    bytes}, "block_inputs": {block: bytes}}`` (the last unit also holds the loss's)."""
    from trainer.models import build_model, loss_fn_for

    model = build_model(cfg.model, device="meta")
    _local_shapes(model, plan)
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

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in params and storage._cdata not in seen:
            seen.add(storage._cdata)
            nbytes = storage.nbytes()
            if any(c in sp_norms for c in current):
                nbytes /= tp  # sequence parallel: the norm runs on this rank's sequence shard
            owner = next((c for c in current if c in plan.units), plan.units[-1])
            units[owner] += nbytes
        return t

    seq = cfg.train.seq_len
    if hasattr(cfg.model, "in_features"):  # regression: features in, predictions out
        x = torch.empty(micro_batch, cfg.model.in_features, device="meta")
        y = torch.empty(micro_batch, cfg.model.out_features, device="meta")
    else:
        x = torch.zeros(micro_batch, seq, dtype=torch.long, device="meta")
        y = torch.zeros(micro_batch, seq, dtype=torch.long, device="meta")
    with _fused_attention(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
        if out.shape == y.shape or out.shape[:-1] == y.shape:  # a tp-local output (Partial / Shard) has no loss here
            loss_fn_for(cfg.model)(out, y)
    for hook in hooks:
        hook.remove()
    return {"units": dict(units), "block_inputs": inputs}


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


def predict_memory(cfg: RunConfig, plan: ParallelPlan) -> list[MemoryEstimate]:
    """One :class:`MemoryEstimate` per pp rank (one without a pipeline)."""
    from trainer.plan import plan_numbers

    numbers = plan_numbers(cfg, plan)
    t = cfg.train
    micro = max(1, t.global_batch_size // t.grad_accum // max(1, plan.dp_size) // cfg.num_microbatches)
    saved = saved_activations(cfg, plan, micro)
    pp = plan.pipeline
    stage_units = pp.stage_units if pp else (tuple(plan.units),)
    wrapped = _checkpointed(plan)
    half = cfg.train.precision == "bf16"
    dp = plan.data_parallel
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
        n_stages = max(1, len(rank_numbers["stages"]))
        in_flight = _in_flight(plan, r)
        activations = acts / n_stages * in_flight + recompute
        local_params = rank_numbers["params"] * 4  # tp-local, before dp sharding
        gathered = 0.0
        if dp is not None and dp.mode != "ddp":
            blocks = [u for u in held if u in plan.blocks]
            block_bytes = local_params / max(1, len(held)) if not blocks else _largest_block(cfg, plan, blocks)
            keeps_all = dp.mode == "zero2" or pp is not None
            gathered = local_params if keeps_all else local_params - block_bytes * max(0, len(blocks) - 2)
            gathered *= 0.5 if half else 1.0
        elif half:
            gathered = local_params * 0.5  # autocast's bf16 copies of the weights, kept for the step
        accumulates = pp is not None or t.grad_accum > 1
        out.append(MemoryEstimate(pp_rank=r, params=rank_numbers["param_bytes"], grads=rank_numbers["grad_bytes"],
                                  optimizer=rank_numbers["optim_bytes"], gathered=gathered, activations=activations,
                                  in_flight=in_flight, parts={"accumulates": accumulates, "micro_batch": micro}))
    return out


def _checkpointed(plan: ParallelPlan) -> set[str]:
    if plan.activation_checkpointing == "full":
        return set(plan.blocks)
    if plan.activation_checkpointing == "selective":
        every = plan.activation_checkpointing_every
        return {b for i, b in enumerate(plan.blocks) if (i + 1) % every == 0}
    return set()


def _largest_block(cfg: RunConfig, plan: ParallelPlan, blocks: list[str]) -> float:
    """fp32 bytes of the largest block at its tp-local size."""
    from trainer.models import build_model

    model = build_model(cfg.model, device="meta")
    _local_shapes(model, plan)
    return max(sum(p.numel() for p in model.get_submodule(b).parameters()) for b in blocks) * 4.0


# --------------------------------------------------------------------------- budget

GIB = 2**30


def memory_budget(cfg: RunConfig) -> tuple[float, str]:
    """``(bytes per rank, where the number comes from)``: ``launch.memory_budget_gb``, else the
    GPU's memory when the run will use CUDA, else 90% of this host's memory shared by its workers."""
    if cfg.launch.memory_budget_gb is not None:
        return cfg.launch.memory_budget_gb * GIB, "launch.memory_budget_gb"
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return float(torch.cuda.get_device_properties(0).total_memory), "the GPU's memory"
    import os

    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    workers = max(1, cfg.world_size // cfg.launch.nnodes)
    return 0.9 * host / workers, f"90% of this host's {host / GIB:.1f} GiB over {workers} worker(s)"


def describe_estimate(e: MemoryEstimate) -> str:
    return (f"weights {e.params / GIB:.2f} + grads {e.grads / GIB:.2f} + AdamW {e.optimizer / GIB:.2f} + gathered "
            f"{e.gathered / GIB:.2f} + activations {e.activations / GIB:.2f} GiB ({e.in_flight} micro-batch pass"
            f"{'es' if e.in_flight != 1 else ''} in flight)")


def check_memory(cfg: RunConfig, plan: ParallelPlan):
    """A :class:`~parallel.errors.ConfigIssue` when the predicted per-rank peak exceeds the budget;
    its fix lists the changes predicted to fit."""
    from parallel.errors import ConfigIssue

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
    from parallel.plan import resolve_plan
    from trainer.models import build_model

    try:
        plan = resolve_plan(cfg.parallel, cfg.mesh, build_model(cfg.model, device="meta"))
    except ValueError:
        return math.inf
    return max(e.total for e in predict_memory(cfg, plan))


def _remedies(cfg: RunConfig):
    """``(what to set, the changed config)`` for the usual ways to need less memory per rank."""
    par, t = cfg.parallel, cfg.train
    if par is not None and par.activation_checkpointing != "full":
        yield "parallel.activation_checkpointing=full", cfg.model_copy(update={"parallel": par.model_copy(
            update={"activation_checkpointing": "full"})})
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
    if t.precision == "fp32":
        yield "train.precision=bf16", cfg.model_copy(update={"train": t.model_copy(update={"precision": "bf16"})})
