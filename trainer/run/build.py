"""What the loop trains with, built before its first step: this rank's share of the model, its
optimizer and learning-rate schedule, its data loader and its loss.

    pm = build_parallel_model(cfg, device)
    optimizer, scheduler = build_optimizer(pm, cfg.optim, total_steps=cfg.train.steps)
    loader = build_loader(source, pm, cfg.train)
    loss_fn = build_loss(cfg, pm, masked=hasattr(source, "target_count"))

The model is built, split and sharded as the plan says, then given the seed's values,
``train.init_from``'s or a Hugging Face directory's, and checked against the file it read
(:mod:`trainer.models.fingerprint`) before any step trains on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from parallel.engine import ParallelModel, parallelize
from parallel.plan.resolve import resolve_plan
from parallel.plan.serial import ResolvedPlan
from parallel.plan.spec import ParallelPlan
from trainer.config.schema import HFModelConfig, OptimConfig, RunConfig, TrainConfig
from trainer.data import Source
from trainer.data.loader import GlobalBatchLoader
from trainer.export.weights import check_weights_fit, load_weights
from trainer.models import build_model, decoder_config, loss_fn_for, meta_initializer
from trainer.models.fingerprint import check_fingerprints, source_fingerprints
from trainer.models.hf import hf_fingerprints, load_hf_sharded, model_dir, weight_files
from trainer.models.moe import with_aux_loss


def build_parallel_model(cfg: RunConfig, device: torch.device, *, plan: ResolvedPlan | None = None) -> ParallelModel:
    """This rank's share of the model, split and sharded as the config's plan says, with one
    device's initial values (from the seed, ``train.init_from``, or a Hugging Face directory's
    safetensors).

    On a mesh the model is built on the meta device, split and sharded there, and only then
    allocated: each rank holds and initialises its own shards (values computed block by block,
    :func:`trainer.models.init.initial_block`) and reads only its slices of a weights file. A
    custom module without ``init_weights`` cannot be initialised that way: every rank builds it
    in full (its builder sets the values) before sharding. ``plan``: the launcher's, for the model
    this rank builds (:func:`worker_plan`)."""
    init = None
    if cfg.world_size > 1:
        model = build_model(cfg.model, device="meta")
        init = meta_initializer(model, cfg.train.seed)
    if init is None:
        return _build_in_full(cfg, device, plan)
    hf_dir = model_dir(cfg.model) if isinstance(cfg.model, HFModelConfig) else None
    hf_files = hf_dir is not None and bool(weight_files(hf_dir))
    if cfg.train.init_from:
        check_weights_fit(model, cfg.train.init_from)
    pm = parallelize(model, worker_plan(cfg, model, plan), device=device, init=init,
                     precision=cfg.train.precision, compile=cfg.train.compile)
    if cfg.train.init_from:
        load_weights(pm.model_parts, cfg.train.init_from, tied=pm.tied_names)
    elif hf_dir is not None and hf_files:
        load_hf_sharded(pm.model_parts, hf_dir)
    if cfg.train.init_from or hf_files:  # the files name a tied parameter once: every stage's copy takes it
        pm.copy_tied_values()
    check_loaded(pm, cfg)
    return pm


def _build_in_full(cfg: RunConfig, device: torch.device, plan: ResolvedPlan | None) -> ParallelModel:
    """The whole model built and initialised on every rank, then split and sharded."""
    model = build_model(cfg.model, seed=cfg.train.seed)
    if cfg.train.init_from:
        load_weights(model, cfg.train.init_from)
    pm = parallelize(model, worker_plan(cfg, model, plan), device=device, precision=cfg.train.precision,
                     compile=cfg.train.compile)
    check_loaded(pm, cfg)
    return pm


def worker_plan(cfg: RunConfig, model: nn.Module, given: ResolvedPlan | None = None) -> ParallelPlan:
    """The plan of this worker's own model build: the launcher's (``given``), once the build is seen to be
    the model it was resolved for (:class:`~parallel.plan.serial.PlanMismatch` otherwise, never another
    plan); without one (a direct caller of the loop), resolved for the build, so the engine places the
    very modules it was given."""
    if given is not None:
        return given.plan_for(model)
    return resolve_plan(cfg.parallel, cfg.mesh, model)


def check_loaded(pm: ParallelModel, cfg: RunConfig) -> None:
    """Refuse to train unless every parameter holds what the weights file it was loaded from holds
    (nothing to check when the values come from the seed)."""
    if cfg.train.init_from:
        check_fingerprints(pm, source_fingerprints([cfg.train.init_from]), what="train.init_from")
    elif isinstance(cfg.model, HFModelConfig) and (files := weight_files(model_dir(cfg.model))):
        path = model_dir(cfg.model)  # a mixture of experts' files name each expert apart: hf_fingerprints stacks them
        check_fingerprints(pm, source_fingerprints(files, read=lambda: hf_fingerprints(path)), what="model.path")


def build_optimizer(pm: ParallelModel, optim: OptimConfig, *, total_steps: int) -> tuple[
        torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the parameters that train, and its learning-rate schedule over ``total_steps``
    (:func:`lr_lambda`). LoRA: only the adapters train; frozen base weights get no gradient and no
    AdamW state. ``zero1``: the state sharded over the data-parallel axes (:meth:`ParallelModel.shard_optimizer`)."""
    optimizer = pm.shard_optimizer(torch.optim.AdamW(
        [p for p in pm.parameters() if p.requires_grad], lr=optim.lr, betas=optim.betas, eps=optim.eps,
        weight_decay=optim.weight_decay,
    ))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim, total_steps))


def lr_lambda(optim: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak lr at a step: linear warm-up, then cosine / linear decay / constant."""

    warmup = optim.warmup_steps_for(total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if optim.schedule == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        progress = min(1.0, progress)
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if optim.schedule == "cosine" else 1 - progress
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * decay

    return factor


def build_loader(source: Source, pm: ParallelModel, train: TrainConfig) -> GlobalBatchLoader:
    """This rank's share of each global batch. One loader batch is one accumulation batch; the loader
    position is global, so a resume on another dp size continues at the same sample."""
    return GlobalBatchLoader(source, global_batch_size=train.global_batch_size // train.grad_accum,
                             dp_rank=pm.dp_rank, dp_size=pm.dp_size, seed=train.seed, cp_rank=pm.cp_rank,
                             cp_size=pm.cp_size)


def build_loss(cfg: RunConfig, pm: ParallelModel, *, masked: bool):
    """The training loss: the model's (``masked``: averaged over the targets a data source marks), and
    an MoE model's weighted balance loss beside it (evaluation uses its ``base`` alone); a Hugging Face
    MoE's weight comes from its config.json."""
    return with_aux_loss(loss_fn_for(cfg.model, masked=masked, chunk_tokens=cfg.train.loss_chunk_tokens),
                         pm.model_parts, decoder_config(cfg.model), pipelined=pm.pipelined)
