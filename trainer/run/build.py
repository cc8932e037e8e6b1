"""This rank's share of the model with its first values: built, split and sharded as the plan
says, then given the seed's values, ``train.init_from``'s or a Hugging Face directory's, and checked
against the file it read (:mod:`trainer.models.fingerprint`) before any step trains on it.
"""

from __future__ import annotations

import torch

from parallel.engine import ParallelModel, parallelize
from parallel.plan.resolve import resolve_plan
from trainer.config.schema import HFModelConfig, RunConfig
from trainer.export.weights import check_weights_fit, load_weights
from trainer.models import build_model, meta_initializer
from trainer.models.fingerprint import check_fingerprints, source_fingerprints
from trainer.models.hf import hf_fingerprints, load_hf_sharded, weight_files


def build_parallel_model(cfg: RunConfig, device: torch.device) -> ParallelModel:
    """This rank's share of the model, split and sharded as the config's plan says, with one
    device's initial values (from the seed, ``train.init_from``, or a Hugging Face directory's
    safetensors).

    On a mesh the model is built on the meta device, split and sharded there, and only then
    allocated: each rank holds and initialises its own shards (values computed block by block,
    :func:`trainer.models.init.initial_block`) and reads only its slices of a weights file. A
    custom module without ``init_weights`` cannot be initialised that way: every rank builds it
    in full (its builder sets the values) before sharding."""
    init = None
    if cfg.world_size > 1:
        model = build_model(cfg.model, device="meta")
        init = meta_initializer(model, cfg.train.seed)
    if init is None:
        return _build_in_full(cfg, device)
    hf_files = isinstance(cfg.model, HFModelConfig) and bool(weight_files(cfg.model.path))
    if cfg.train.init_from:
        check_weights_fit(model, cfg.train.init_from)
    pm = parallelize(model, resolve_plan(cfg.parallel, cfg.mesh, model), device=device, init=init,
                     precision=cfg.train.precision, compile=cfg.train.compile)
    if cfg.train.init_from:
        load_weights(pm.model_parts, cfg.train.init_from, tied=pm.tied_names)
    elif hf_files:
        load_hf_sharded(pm.model_parts, cfg.model.path)
    if cfg.train.init_from or hf_files:  # the files name a tied parameter once: every stage's copy takes it
        pm.copy_tied_values()
    check_loaded(pm, cfg)
    return pm


def _build_in_full(cfg: RunConfig, device: torch.device) -> ParallelModel:
    """The whole model built and initialised on every rank, then split and sharded."""
    model = build_model(cfg.model, seed=cfg.train.seed)
    if cfg.train.init_from:
        load_weights(model, cfg.train.init_from)
    pm = parallelize(model, resolve_plan(cfg.parallel, cfg.mesh, model), device=device, precision=cfg.train.precision,
                     compile=cfg.train.compile)
    check_loaded(pm, cfg)
    return pm


def check_loaded(pm: ParallelModel, cfg: RunConfig) -> None:
    """Refuse to train unless every parameter holds what the weights file it was loaded from holds
    (nothing to check when the values come from the seed)."""
    if cfg.train.init_from:
        check_fingerprints(pm, source_fingerprints([cfg.train.init_from]), what="train.init_from")
    elif isinstance(cfg.model, HFModelConfig) and (files := weight_files(cfg.model.path)):
        path = cfg.model.path  # a mixture of experts' files name each expert apart: hf_fingerprints stacks them
        check_fingerprints(pm, source_fingerprints(files, read=lambda: hf_fingerprints(path)), what="model.path")
