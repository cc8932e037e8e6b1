"""Checks of ``data_parallel.mode: zero1`` run inside the worker processes of one launch (``dist_harness``):
losses and gradient norms of zero1 [2], zero1 x tp [2, 2] and zero1 x pp x tp [2, 2, 2] on the built-in
model, and of a tied-embedding Hugging Face Llama (9 heads over 3 kv heads) on zero1 [2] and zero1 x pp
[2, 2]; the bytes each rank holds (AdamW's moments 1 / dp of the parameters', parameters and gradients
whole); checkpoints saved under one mode and mesh resumed under another.

Every check trains on ``dist_checks``' batches with its optimizer (AdamW, constant lr), sharded by
``ParallelModel.shard_optimizer`` as the trainer's ``build_optimizer`` does.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from dist_checks import GRAD_CLIP, batches, llama_cfg, make_optimizer, parallelize_preset
from parallel.config import ParallelConfig
from parallel.sharding.zero1 import optimizer_state_bytes
from trainer.checkpoint.dcp import load_checkpoint, merged_module, save_checkpoint
from trainer.models import build_model, decoder_config, loss_fn_for

DIR_ENV, OUT_ENV = "MESHFLOW_TEST_ZERO1_TIED_DIR", "MESHFLOW_TEST_ZERO1_OUT"  # set by the parent test
TP = {"dim": "tp"}  # the built-in model's named tensor-parallel plan
ZERO1 = {"dim": "dp", "mode": "zero1"}
LAYOUTS = {
    "zero1": ([2], {"dims": ["dp"], "data_parallel": ZERO1}),
    "fsdp": ([2], {"dims": ["dp"], "data_parallel": {"dim": "dp", "mode": "fsdp"}}),
    "zero1_tp": ([2, 2], {"dims": ["dp", "tp"], "data_parallel": ZERO1, "tensor_parallel": TP}),
    "zero1_4": ([4], {"dims": ["dp"], "data_parallel": ZERO1}),
    # per-stage layouts: stage 0 zero1 over ranks 0-1, stage 1 tensor parallel over ranks 2-3
    "stages_zero1_then_tp": ([4], {"dims": ["pp"], "pipeline": {
        "dim": "pp", "schedule": "1F1B", "microbatches": 4, "boundaries": "auto", "stages": [
            {"ranks": [0, 1], "dims": ["dp"], "data_parallel": ZERO1},
            {"ranks": [2, 3], "dims": ["tp"], "tensor_parallel": TP}]}}),
    "zero1_pp_tp": ([2, 2, 2], {"dims": ["dp", "pp", "tp"], "data_parallel": ZERO1, "tensor_parallel": TP,
                                "pipeline": {"dim": "pp", "schedule": "1F1B", "microbatches": 2,
                                             "boundaries": "auto"}}),
}


def local_bytes(tensors) -> int:
    """Bytes of this rank's share of ``tensors`` (a DTensor's local shard)."""
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def steps(pm, optimizer, model_cfg, indices, *, measure: bool = False) -> dict:
    """Optimizer steps over ``dist_checks``' batches ``indices`` on this rank's dp share; losses and pre-clip
    gradient norms. ``measure``: the bytes of parameters and gradients after the last backward and of
    AdamW's state after the last step."""
    loss_fn, out = loss_fn_for(model_cfg), {"losses": [], "grad_norms": []}
    every = batches(model_cfg)
    for index in indices:
        inputs, targets = every[index]
        per = inputs.shape[0] // pm.dp_size
        share = slice(pm.dp_rank * per, (pm.dp_rank + 1) * per)
        loss = pm.forward_backward(inputs[share], targets[share], loss_fn)
        out["grad_norms"].append(pm.clip_grad_norm_(GRAD_CLIP))
        if measure:
            params = list(pm.parameters())
            out["param_bytes"] = local_bytes(params)
            out["grad_bytes"] = local_bytes(p.grad for p in params if p.grad is not None)
            out["param_count"] = sum(p.numel() for p in params)  # global shapes: this rank's stages
        optimizer.step()
        optimizer.zero_grad()
        out["losses"].append(pm.reduce_loss(loss))
    if measure:
        out["state_bytes"] = optimizer_state_bytes(optimizer)
        out["tensors"] = len(optimizer.state)
        out["moment_placements"] = sorted({str(v.placements) for s in optimizer.state.values() for v in s.values()
                                           if isinstance(v, DTensor)})
    return out


def built_in(layout: str):
    """The built-in model (gpt_debug) on ``LAYOUTS[layout]``, sharded optimizer; its ParallelModel."""
    mesh, raw = LAYOUTS[layout]
    pm = parallelize_preset(build_model(llama_cfg(), device="meta"), mesh, ParallelConfig.model_validate(raw))
    return pm, pm.shard_optimizer(make_optimizer(pm.parameters()))


def parity_check(layout: str):
    """Five steps from the seed: losses, gradient norms and the bytes held."""
    def check(*, rank: int, world_size: int) -> dict:
        pm, optimizer = built_in(layout)
        return {**steps(pm, optimizer, llama_cfg(), range(5), measure=True), "stages": pm.stage_indices}

    return check


def accumulation_check(*, rank: int, world_size: int) -> dict:
    """zero1 [2] with two accumulation passes a step, the first with ``reduce_grads=False``: after it no
    parameter has a reduced gradient yet (FSDP2 keeps the rank's own sum), after the second every one has."""
    cfg = llama_cfg()
    pm, optimizer = built_in("zero1")
    loss_fn, out = loss_fn_for(cfg), {"losses": [], "grad_norms": [], "reduced_after_pass": []}
    for inputs, targets in batches(cfg):
        per = inputs.shape[0] // pm.dp_size
        pieces = zip(inputs[pm.dp_rank * per:(pm.dp_rank + 1) * per].chunk(2),
                     targets[pm.dp_rank * per:(pm.dp_rank + 1) * per].chunk(2))
        loss = None
        for index, (x, y) in enumerate(pieces):
            piece = pm.forward_backward(x, y, loss_fn, loss_scale=0.5, reduce_grads=index == 1)
            loss = piece / 2 if loss is None else loss + piece / 2
            out["reduced_after_pass"].append(sum(p.grad is not None for p in pm.parameters()))
        out["grad_norms"].append(pm.clip_grad_norm_(GRAD_CLIP))
        optimizer.step()
        optimizer.zero_grad()
        out["losses"].append(pm.reduce_loss(loss))
    return out


def resume_check(saved_as: str, resumed_as: str, *, name: str, at: int = 3):
    """``at`` steps under ``saved_as``, a checkpoint, then the rest under ``resumed_as`` (another mode or
    mesh) from that checkpoint: the losses of both halves, to be one device's."""
    def check(*, rank: int, world_size: int) -> dict:
        cfg = llama_cfg()
        pm, optimizer = built_in(saved_as)
        first = steps(pm, optimizer, cfg, range(at))
        path = save_checkpoint(Path(os.environ[OUT_ENV]) / name, at, model=merged_module(pm.model_parts),
                               optimizer=optimizer, extra={"step": at}, keep=1)
        pm, optimizer = built_in(resumed_as)
        load_checkpoint(path, model=merged_module(pm.model_parts), optimizer=optimizer)
        rest = steps(pm, optimizer, cfg, range(at, 5))
        return {"losses": first["losses"] + rest["losses"], "grad_norms": first["grad_norms"] + rest["grad_norms"]}

    return check


def hf_check(overrides: list[str]):
    """The tied Hugging Face Llama on the trainer's road (config composed and validated, built on meta,
    safetensors read per rank), the optimizer the trainer's ``build_optimizer``."""
    def check(*, rank: int, world_size: int) -> dict:
        from trainer.config.compose import compose_dict
        from trainer.run.build import build_optimizer, build_parallel_model
        from trainer.validate.checks import validate_config

        raw = compose_dict(["model=hf", f"model.path={os.environ[DIR_ENV]}", "data=synthetic", "train.seq_len=32",
                            "train.global_batch_size=8", "optim.lr=1e-3", "optim.betas=[0.9,0.95]",
                            "optim.weight_decay=0.1", "optim.schedule=constant", "optim.warmup_steps=0",
                            *overrides])
        cfg = validate_config(raw)
        pm = build_parallel_model(cfg, torch.device("cpu"))
        optimizer, _ = build_optimizer(pm, cfg.optim, total_steps=5)
        return {**steps(pm, optimizer, decoder_config(cfg.model), range(5), measure=True),
                "stages": pm.stage_indices}

    return check


SUITES = {
    "two_rank": [
        ("zero1", parity_check("zero1")),
        ("hf_zero1", hf_check(["+parallel=zero1"])),
        ("resume_zero1_as_fsdp", resume_check("zero1", "fsdp", name="zero1_as_fsdp")),
        ("resume_fsdp_as_zero1", resume_check("fsdp", "zero1", name="fsdp_as_zero1")),
        ("zero1_grad_accum", accumulation_check),
    ],
    "four_rank": [
        ("zero1_tp", parity_check("zero1_tp")),
        ("stages_zero1_then_tp", parity_check("stages_zero1_then_tp")),
        ("hf_zero1_pp", hf_check(["+parallel=3d", "mesh=[2,2,1]", "parallel.data_parallel.mode=zero1"])),
        ("resume_zero1_tp_as_zero1_4", resume_check("zero1_tp", "zero1_4", name="zero1_tp_as_zero1_4")),
    ],
    "eight_rank": [
        ("zero1_pp_tp", parity_check("zero1_pp_tp")),
    ],
}
