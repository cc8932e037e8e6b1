"""The conformance matrix's cells, run inside the worker processes of one launch per world size.

Architectures are tiny Hugging Face checkpoints with the shapes real ones have (written by the
parent test with transformers, random weights); layouts are the presets of conf/parallel at their
own meshes. A cell takes the trainer's road: the overrides composed and validated; a refusal's
printed fixes applied exactly as printed (tokenised as a shell would) and validated again; then
the model built, sharded and loaded per rank (:func:`build_parallel_model`) and trained ``STEPS``
steps on :func:`cell_batches` of its config. The parent resolves every cell first and launches one
suite per world size the resolved configs need (a fix may change it: ``mesh=[3,3]`` is 9 ranks),
naming each suite's cells in ``PLAN_ENV``; it compares the losses with one device's on the same batches.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import traceback

import torch

from dist_checks import batches, make_optimizer
from dist_checks import STEPS as DRAWN_STEPS
from parallel.errors import ConfigError
from trainer.config.compose import compose_dict
from trainer.models import decoder_config, loss_fn_for
from trainer.run.build import build_parallel_model
from trainer.validate.checks import validate_config

STEPS, GRAD_CLIP = 3, 1.0
ARCH_DIRS_ENV = "MESHFLOW_TEST_CONFORMANCE_DIRS"  # JSON {arch: model directory}, set by the parent test
PLAN_ENV = "MESHFLOW_TEST_CONFORMANCE_PLAN"  # JSON {world size: ["arch/preset", ...]}, set by the parent test
ARCHS = ["smollm2", "qwen25", "llama32", "mistral", "qwen3"]
PRESETS = ["dp", "zero1", "fsdp", "zero2", "tp", "tp_sp", "pp", "hsdp", "2d", "pp_stages", "tp2d",
           "3d", "hsdp_tp", "pp_stages_cp", "pp_stages_ep", "tp2d_dp", "tp2p5d", "tp3d"]  # the table's column order
MOE_ARCHS = ["qwen3moe"]  # a small table of its own: the mixture-of-experts layouts
MOE_PRESETS = ["ep", "fsdp_ep", "3d_ep", "pp_stages_ep"]
_OVERRIDE = re.compile(r"^[+~]{0,2}[A-Za-z_][\w.\[\]*-]*=")


def arch_dir(arch: str) -> str:
    return json.loads(os.environ[ARCH_DIRS_ENV])[arch]


def overrides_of(arch: str, preset: str | None) -> list[str]:
    common = ["model=hf", f"model.path={arch_dir(arch)}", "data=synthetic", "train.seq_len=32",
              "train.global_batch_size=8"]
    return common + ([f"+parallel={preset}"] if preset else [])


def printed_overrides(fix: str) -> list[str]:
    """The first fix a refusal prints, as a shell would pass it: the overrides of the first of its
    alternatives (", or ") that names any ("use a tp size dividing 3, or X=false and Replicate: 'Y'" is
    X and Y; "'mesh=[1,3,3]' train.global_batch_size=15 (9 ranks), or keep the depth: 'mesh=[2,3,3]' ..."
    is the first mesh and batch), prose words dropped."""
    for alternative in fix.split(", or "):
        try:
            words = shlex.split(alternative)
        except ValueError:
            continue
        if found := [w.rstrip(",;)") for w in words if _OVERRIDE.match(w)]:
            return found
    return []


def resolve_cell(arch: str, preset: str) -> tuple[object | None, dict]:
    """``(the RunConfig to train or None, what validation said)``: a refusal's printed fixes are applied."""
    overrides = overrides_of(arch, preset)
    try:
        return validate_config(compose_dict(overrides)), {"status": "equal"}
    except ConfigError as err:
        refusal = {"status": "refused", "issues": [[i.path, i.reason, i.fix] for i in err.issues]}
    fixes = [o for issue in refusal["issues"] for o in printed_overrides(issue[2] or "")]
    refusal["fixes"] = fixes
    if not fixes:
        return None, refusal
    try:
        return validate_config(compose_dict([*overrides, *fixes])), refusal
    except ConfigError as err:
        refusal["after_fix"] = [[i.path, i.reason, i.fix] for i in err.issues]
        return None, refusal


def all_cells() -> list[str]:
    """Every ``arch/preset`` the two tables hold (one device's excluded)."""
    return [f"{arch}/{preset}" for arch in ARCHS for preset in PRESETS] + [
        f"{arch}/{preset}" for arch in MOE_ARCHS for preset in MOE_PRESETS]


def cell_batches(cfg) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS`` global batches of the config's ``train.global_batch_size`` sequences (a fix may change it:
    a 3 x 3 grid's rows split 9, not 8), drawn as ``dist_checks.batches`` draws its 8."""
    vocab_size, seq_len = decoder_config(cfg.model).vocab_size, cfg.train.seq_len
    tokens = torch.randint(0, vocab_size, (DRAWN_STEPS, cfg.train.global_batch_size, seq_len + 1),
                           generator=torch.Generator().manual_seed(1234))
    return [(t[:, :-1], t[:, 1:]) for t in tokens[:STEPS]]


def train_losses(pm, cfg) -> list[float]:
    """``STEPS`` optimizer steps on this rank's dp share of the config's batches; the global losses."""
    optimizer, loss_fn = pm.shard_optimizer(make_optimizer(pm.parameters())), loss_fn_for(cfg.model)  # zero1: sharded
    losses = []
    for inputs, targets in cell_batches(cfg):
        per = inputs.shape[0] // pm.dp_size
        share = slice(pm.dp_rank * per, (pm.dp_rank + 1) * per)
        loss = pm.forward_backward(inputs[share], targets[share], loss_fn)
        pm.clip_grad_norm_(GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(pm.reduce_loss(loss))
    return losses


def cells_check(*, rank: int, world_size: int) -> dict:
    """The cells the parent planned for this world size, each resolved again and trained."""
    out = {}
    for cell in json.loads(os.environ[PLAN_ENV])[str(world_size)]:
        cfg, result = resolve_cell(*cell.split("/"))
        if cfg is not None:
            result["global_batch_size"] = cfg.train.global_batch_size
            if cfg.world_size != world_size:
                result["note"] = f"the fixed config runs on {cfg.world_size} ranks"
            else:
                try:  # every rank fails alike (same config, same model): the next cell still runs
                    result["losses"] = train_losses(build_parallel_model(cfg, torch.device("cpu")), cfg)
                except Exception as err:  # noqa: BLE001 - reported in the cell
                    result["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                    result["trace"] = traceback.format_exc()[-1500:]
        out[cell] = result
    return out


def head_grads_check(*, rank: int, world_size: int) -> dict:
    """Qwen3's per-head q/k norm weights on tp 2: after one backward (and the engine's per-step
    sums), their gradients are one device's, not each rank's heads' share."""
    cfg = validate_config(compose_dict(overrides_of("qwen3", "tp")))
    one_cfg = validate_config(compose_dict(overrides_of("qwen3", None)))
    pm, one = build_parallel_model(cfg, torch.device("cpu")), build_parallel_model(one_cfg, torch.device("cpu"))
    inputs, targets = batches(decoder_config(cfg.model))[0]
    for model in (pm, one):
        model.forward_backward(inputs, targets, loss_fn_for(cfg.model))
        model.clip_grad_norm_(None)
    want = {name: p.grad for name, p in one.named_parameters() if "_norm." in name and "self_attn" in name}
    got = {name: p.grad for name, p in pm.named_parameters() if name in want}
    return {"names": sorted(got), "max_abs_diff": max(float((got[n] - want[n]).abs().max()) for n in want),
            "max_abs_grad": max(float(g.abs().max()) for g in want.values())}


class _Suites(dict):
    """``world<n>`` -> its checks, for any n: the world sizes come from the parent's plan."""

    def __missing__(self, suite: str) -> list:
        return [("cells", cells_check)]


SUITES = _Suites(world2=[("cells", cells_check), ("head_grads", head_grads_check)])
