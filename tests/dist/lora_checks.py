"""Checks of LoRA runs (``model.lora.rank=8``) on every kind of layout, inside the worker processes
of one launch (``dist_harness``).

Each check takes the trainer's road: the config composed from overrides and validated, the model
built on meta with its adapters, sharded and split, the base read per rank from the tiny Llama's
safetensors (or the seed, for the built-in decoder) (:func:`build_parallel_model`); then it trains
``STEPS`` steps on the batches of ``dist_checks`` with AdamW over the parameters that train, as the
loop does. It reports the losses, whether every base weight this rank holds is bit for bit what it
was before training, and how far the adapters moved; ``checkpoint`` also saves the adapters alone
and resumes them into a fresh model.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from dist_checks import GRAD_CLIP, batches, make_optimizer
from trainer.checkpoint.dcp import load_checkpoint, merged_module, save_checkpoint, stored_model_keys
from trainer.config.compose import compose_dict
from trainer.models import decoder_config, loss_fn_for
from trainer.models.fingerprint import model_fingerprints
from trainer.models.lora import is_adapter
from trainer.run.build import build_parallel_model
from trainer.run.loop import frozen_names
from trainer.validate.checks import validate_config

DIR_ENV, OUT_ENV = "MESHFLOW_TEST_LORA_DIR", "MESHFLOW_TEST_LORA_OUT"  # set by the parent test
LORA = ["model.lora.rank=8", "model.lora.alpha=16"]


def run_config(model: str, overrides: list[str]):
    """The validated RunConfig of a LoRA run of the tiny Llama directory (``model="hf"``) or the
    built-in ``gpt_debug`` under ``overrides``."""
    base = ["model=hf", f"model.path={os.environ[DIR_ENV]}"] if model == "hf" else ["model=gpt_debug"]
    raw = compose_dict([*base, *LORA, "data=synthetic", "train.seq_len=32", "train.global_batch_size=8", *overrides])
    return validate_config(raw)


def _local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if isinstance(p, DTensor) else p).detach()


def train_lora(pm, decoder) -> dict:
    """``STEPS`` steps on this rank's dp share, AdamW over the parameters that train; losses and
    pre-clip gradient norms as every rank sees them."""
    trainable = [p for p in pm.parameters() if p.requires_grad]
    optimizer, loss_fn = make_optimizer(trainable), loss_fn_for(decoder)
    losses, norms = [], []
    for inputs, targets in batches(decoder):
        per = inputs.shape[0] // pm.dp_size
        share = slice(pm.dp_rank * per, (pm.dp_rank + 1) * per)
        loss = pm.forward_backward(inputs[share], targets[share], loss_fn)
        norms.append(pm.clip_grad_norm_(GRAD_CLIP))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(pm.reduce_loss(loss))
    return {"losses": losses, "grad_norms": norms, "optimizer": optimizer}


def lora_check(name: str, model: str, overrides: list[str], *, checkpoint: bool = False):
    def check(*, rank: int, world_size: int) -> dict:
        cfg = run_config(model, overrides)
        pm = build_parallel_model(cfg, torch.device("cpu"))
        named = dict(pm.named_parameters())
        base_before = {n: _local(p).clone() for n, p in named.items() if not p.requires_grad}
        result = train_lora(pm, decoder_config(cfg.model))
        changed = [n for n, before in base_before.items() if not torch.equal(_local(named[n]), before)]
        # The base's bytes, not just its values: bit-identical also for -0.0 and NaN payloads.
        changed += [n for n, before in base_before.items()
                    if _local(named[n]).numpy().tobytes() != before.numpy().tobytes() and n not in changed]
        out = {"losses": result["losses"], "grad_norms": result["grad_norms"], "base_changed": changed,
               "num_base": len(base_before), "trainable": sorted(n for n, p in named.items() if p.requires_grad),
               "frozen_grads": [n for n, p in named.items() if not p.requires_grad and p.grad is not None],
               "adapter_max": max(float(_local(p).abs().max()) for n, p in named.items()
                                  if n.endswith("lora_B.weight") and _local(p).numel()), "stages": pm.stage_indices}
        if checkpoint:
            out.update(_checkpoint_round_trip(name, cfg, pm, result["optimizer"]))
        return out

    return check


def _checkpoint_round_trip(name: str, cfg, pm, optimizer) -> dict:
    """Save the adapters alone (as the loop does by default), build the model afresh and resume:
    every parameter, base and adapters, fingerprints as before the save."""
    out_dir = Path(os.environ[OUT_ENV]) / name
    frozen = frozen_names(pm)
    extra = {"step": 1, "model_config": cfg.model.model_dump(mode="json"), "fingerprints": model_fingerprints(pm),
             "base": {"seed": cfg.train.seed, "init_from": None}}
    path = save_checkpoint(out_dir, 1, model=merged_module(pm.model_parts), optimizer=optimizer, extra=extra, keep=1,
                           tied=pm.tied_names, skip=frozen)
    fresh = build_parallel_model(cfg, torch.device("cpu"))
    fresh_optimizer = make_optimizer([p for p in fresh.parameters() if p.requires_grad])
    load_checkpoint(path, model=merged_module(fresh.model_parts), optimizer=fresh_optimizer, tied=fresh.tied_names,
                    may_lack=frozen_names(fresh))
    before, after = extra["fingerprints"], model_fingerprints(fresh)
    return {"saved_keys": sorted(stored_model_keys(path)), "resumed_equal": sorted(n for n in before if before[n] == after[n]),
            "resumed_differ": sorted(n for n in before if before[n] != after[n]),
            "adapters_saved": all(is_adapter(k) for k in stored_model_keys(path))}


SUITES = {
    "two_rank": [
        ("fsdp", lora_check("fsdp", "hf", ["+parallel=fsdp", "mesh=[2]"], checkpoint=True)),
        ("tp", lora_check("tp", "hf", ["+parallel=tp", "mesh=[2]"])),
        ("pp", lora_check("pp", "hf", ["+parallel=pp", "mesh=[2]"])),
        ("tp_builtin", lora_check("tp_builtin", "gpt_debug", ["+parallel=tp", "mesh=[2]"])),
        # Sequence parallel: lora_A reads the gathered norm output beside the base weight, kept as its shard.
        ("tp_sp", lora_check("tp_sp", "hf", ["+parallel=tp_sp", "mesh=[2]"])),
        ("fsdp_bf16", lora_check("fsdp_bf16", "hf", ["+parallel=fsdp", "mesh=[2]", "train.precision=bf16"])),
    ],
    "four_rank": [
        ("2d", lora_check("2d", "hf", ["+parallel=2d", "mesh=[2,2]"], checkpoint=True)),
        ("2d_builtin", lora_check("2d_builtin", "gpt_debug", ["+parallel=2d", "mesh=[2,2]"])),
    ],
}
