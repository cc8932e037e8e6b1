"""Checks of ``train.compile: true`` that run inside the worker processes of one launch (see
``dist_harness``; the parent test is ``test_compile.py``).

Every model is built the trainer's way, :func:`trainer.run.build.build_parallel_model` from a validated
:class:`~trainer.config.schema.RunConfig` with ``train.compile=true``, and trained by ``dist_checks.train``
(5 AdamW steps on fixed batches); the parent compares the losses with the eager single-device
reference. Each check starts from a fresh Dynamo (``torch._dynamo.reset()``): one process runs
several models, whose blocks share one code object, and Dynamo's recompile limit would otherwise
quietly send later checks back to eager. What Dynamo did (graphs, graph breaks) is reported too,
so a check that compiled nothing fails.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import yaml

from dist_checks import CPU, MLP_CFG, REPO, batches, make_optimizer, train
from trainer.config.schema import RunConfig
from trainer.run.build import build_parallel_model
from trainer.models import loss_fn_for
from trainer.validate.checks import validate_config

CKPT_DIR_ENV = "MESHFLOW_TEST_COMPILE_CKPT_DIR"  # set by the parent test: where checkpoints go


def run_config(preset: str | None, *, compile: bool = True, model: dict | None = None, **parallel_update) -> RunConfig:
    """The config of ``+parallel=<preset>`` (None: one device) with ``train.compile``, validated
    by the trainer's validator (its C++ compiler check included); ``parallel_update`` replaces
    fields of the preset's ``parallel`` section (``pipeline`` is merged)."""
    raw: dict = {"train": {"compile": compile}, "tracking": {"backend": "none"}}
    if model is not None:
        raw["model"] = model
    if preset is not None:
        preset_raw = yaml.safe_load((REPO / f"conf/parallel/{preset}.yaml").read_text())
        parallel = dict(preset_raw["parallel"])
        for key, value in parallel_update.items():
            parallel[key] = {**parallel[key], **value} if key == "pipeline" else value
        raw.update(mesh=preset_raw["mesh"], parallel=parallel)
    return validate_config(raw, check_model=False)


def fresh_dynamo() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def dynamo_stats() -> dict:
    from torch._dynamo.utils import counters

    return {"unique_graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def compiled_check(preset: str | None, *, model: str = "llama", **parallel_update):
    """5 steps of the preset (None: one device) compiled: losses, gradient norms, the evaluation
    loss, the parameter names, the modules compiled and what Dynamo did."""

    def check(*, rank: int, world_size: int) -> dict:
        fresh_dynamo()
        model_raw = MLP_CFG.model_dump(mode="json") if model == "mlp" else None
        cfg = run_config(preset, model=model_raw, **parallel_update)
        pm = build_parallel_model(cfg, CPU)
        result = train(pm, cfg.model)
        fqns = sorted(name for name, _ in pm.named_parameters())
        compiled = sorted(name for part in pm.model_parts for name, m in part.named_modules()
                          if m._compiled_call_impl is not None)
        return {**result, **dynamo_stats(), "fqns": fqns, "compiled": compiled, "mesh_is_none": pm.mesh is None}

    return check


# ----------------------------------------------------------------------------- checkpoints


def _steps(pm, model_cfg, optimizer, which: range) -> list[float]:
    """Optimizer steps on the fixed batches ``which`` (this rank's dp share); reduced losses."""
    loss_fn, losses = loss_fn_for(model_cfg), []
    for inputs, targets in [batches(model_cfg)[i] for i in which]:
        per = inputs.shape[0] // pm.dp_size
        share = slice(pm.dp_rank * per, (pm.dp_rank + 1) * per)
        loss = pm.forward_backward(inputs[share], targets[share], loss_fn)
        pm.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(pm.reduce_loss(loss))
    return losses


def checkpoint_cross_check(*, rank: int, world_size: int) -> dict:
    """fsdp on 2 ranks: 2 steps, save; a fresh model of the other kind (compiled <-> eager) loads
    it and takes steps 3-5; the losses continue the uninterrupted run's. The saved keys are the
    same either way, free of ``_orig_mod``."""
    from trainer.checkpoint.dcp import load_checkpoint, merged_module, save_checkpoint
    from trainer.checkpoint.safe_read import stored_keys

    root = Path(os.environ[CKPT_DIR_ENV])
    out: dict = {}
    for label, save_compiled in (("compiled_to_eager", True), ("eager_to_compiled", False)):
        fresh_dynamo()
        cfg = run_config("fsdp", compile=save_compiled)
        first = build_parallel_model(cfg, CPU)
        optimizer = make_optimizer(first.parameters())
        before = _steps(first, cfg.model, optimizer, range(2))
        saved = save_checkpoint(root / label, 2, model=merged_module(first.model_parts), optimizer=optimizer,
                                extra={"step": 2}, keep=1)
        keys = sorted(stored_keys(saved))

        cfg = run_config("fsdp", compile=not save_compiled)
        second = build_parallel_model(cfg, CPU)
        optimizer = make_optimizer(second.parameters())
        extra = load_checkpoint(saved, model=merged_module(second.model_parts), optimizer=optimizer)
        after = _steps(second, cfg.model, optimizer, range(2, 5))
        out[label] = {"losses": before + after, "keys": keys, "extra_step": extra["step"],
                      "module_keys": sorted(merged_module(second.model_parts).state_dict()), **dynamo_stats()}
    return out


SUITES = {
    "two_rank": [
        ("single", compiled_check(None)),
        ("single_mlp", compiled_check(None, model="mlp")),
        ("fsdp", compiled_check("fsdp")),
        ("fsdp_ac_full", compiled_check("fsdp", activation_checkpointing="full")),
        # Tensor and sequence parallel inside activation checkpointing (every other block): compiled inside the wrapper.
        ("tp_sp_ac_full_every2", compiled_check("tp_sp", activation_checkpointing="full", activation_checkpointing_every=2)),
        ("checkpoint_cross", checkpoint_cross_check),
    ],
    "eight_rank": [
        ("3d", compiled_check("3d")),
    ],
}
