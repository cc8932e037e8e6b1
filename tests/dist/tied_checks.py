"""Checks of a tied-embedding model (SmolLM2's shape: ``tie_word_embeddings``, 9 heads over 3 kv
heads) on every kind of layout, run inside the worker processes of one launch (``dist_harness``).

Each check takes the trainer's road: the config composed from overrides and validated, the model
built on meta, sharded and split, the safetensors read per rank (:func:`build_parallel_model`);
then it trains ``STEPS`` steps on the batches of ``dist_checks`` and saves a checkpoint. The parent
compares the losses with one device and reads the checkpoint back into one process.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from dist_checks import train
from trainer.checkpoint.dcp import merged_module, save_checkpoint
from trainer.config.compose import compose_dict
from trainer.models import decoder_config
from trainer.run.build import build_parallel_model
from trainer.validate.checks import validate_config

DIR_ENV, OUT_ENV = "MESHFLOW_TEST_TIED_DIR", "MESHFLOW_TEST_TIED_OUT"  # set by the parent test


def run_config(overrides: list[str], *, stages: list[dict] | None = None):
    """The validated RunConfig of the tied model under ``overrides`` (``stages``: per-stage layouts)."""
    raw = compose_dict(["model=hf", f"model.path={os.environ[DIR_ENV]}", "data=synthetic", "train.seq_len=32",
                        "train.global_batch_size=8", *overrides])
    if stages is not None:
        raw["parallel"]["pipeline"]["stages"] = stages
    return validate_config(raw)


def tie_sums(pm) -> dict[str, float]:
    """fp64 sums of this rank's tied copies, whole (a DTensor gathered over its mesh)."""
    held = {}
    for part in pm.model_parts:
        held.update(dict(part.named_parameters(remove_duplicate=False)))
    out = {}
    for names in pm.tied_names:
        for name in names:
            if name in held:
                p = held[name]
                out[name] = float((p.full_tensor() if isinstance(p, DTensor) else p.detach()).double().sum())
    return out


def tied_check(name: str, overrides: list[str], *, grad_accum: int = 1, stages: list[dict] | None = None):
    def check(*, rank: int, world_size: int) -> dict:
        cfg = run_config(overrides, stages=stages)
        pm = build_parallel_model(cfg, torch.device("cpu"))
        decoder = decoder_config(cfg.model)
        result = train(pm, decoder, grad_accum=grad_accum)
        optimizer = torch.optim.AdamW(list(pm.parameters()))  # an optimizer of the right shape for the save
        out = Path(os.environ[OUT_ENV]) / name
        save_checkpoint(out, 1, model=merged_module(pm.model_parts), optimizer=optimizer, extra={"step": 1,
                        "model_config": cfg.model.model_dump(mode="json")}, keep=1, tied=pm.tied_names)
        held = {}
        for part in pm.model_parts:
            held.update(dict(part.named_parameters(remove_duplicate=False)))
        # Each end of the tie this rank holds: its placements, and whether both names are one parameter here.
        ends = {name: [str(p) for p in getattr(held[name], "placements", ())] for names in pm.tied_names
                for name in names if name in held}
        one = [len({id(held[n]) for n in names if n in held}) == 1 for names in pm.tied_names]
        return {"losses": result["losses"], "grad_norms": result["grad_norms"], "tie_sums": tie_sums(pm),
                "stages": pm.stage_indices, "loss_parallel": pm.loss_parallel, "tie_ends": ends, "tie_is_one": one}

    return check


def corrupt_load_check(*, rank: int, world_size: int) -> dict:
    """A load in which one rank's slice is wrong (rank 1 holds rank 0's rows of one weight, as a wrong
    offset would give it) is refused before training, naming that parameter, on every rank."""
    from safetensors import safe_open

    from trainer.models.fingerprint import LoadMismatch
    from trainer.run.build import check_loaded

    cfg = run_config(["+parallel=tp", "mesh=[3]"])
    pm = build_parallel_model(cfg, torch.device("cpu"))  # checked: the right load passes
    name = "model.layers.0.mlp.up_proj.weight"
    param = pm.model_parts[0].get_parameter(name)
    if rank == 1:
        with safe_open(os.path.join(os.environ[DIR_ENV], "model.safetensors"), framework="pt") as f, torch.no_grad():
            local = param.to_local()
            local.copy_(f.get_slice(name)[: local.shape[0]])
    try:
        check_loaded(pm, cfg)
    except LoadMismatch as err:
        return {"refused": err.names, "message": str(err)}
    return {"refused": []}


# The embedding's stage fully sharded, the head's replicated: the two copies have different layouts.
STAGES = [{"ranks": [0, 1], "dims": ["dp"], "data_parallel": {"dim": "dp", "mode": "fsdp"}},
          {"ranks": [2, 3], "dims": ["dp"], "data_parallel": {"dim": "dp", "mode": "ddp"}}]

SUITES = {
    "two_rank": [
        ("pp_1F1B", tied_check("pp_1F1B", ["+parallel=pp", "mesh=[2]"])),
        ("pp_1F1B_grad_accum", tied_check("pp_1F1B_grad_accum", ["+parallel=pp", "mesh=[2]"], grad_accum=2)),
        ("pp_Interleaved1F1B", tied_check("pp_Interleaved1F1B", ["+parallel=pp", "mesh=[2]", "parallel.pipeline.schedule=Interleaved1F1B",
                                                                 "parallel.pipeline.stages_per_rank=2"])),
        ("pp_ZBV", tied_check("pp_ZBV", ["+parallel=pp", "mesh=[2]", "parallel.pipeline.schedule=ZBV",
                                         "parallel.pipeline.stages_per_rank=2"])),
    ],
    "three_rank": [
        ("tp", tied_check("tp", ["+parallel=tp", "mesh=[3]"])),
        ("corrupt_load", corrupt_load_check),
    ],
    "four_rank": [
        ("pp_stages", tied_check("pp_stages", ["+parallel=pp_stages"], stages=STAGES)),
    ],
    "six_rank": [
        ("3d_tp3", tied_check("3d_tp3", ["+parallel=3d", "mesh=[1,2,3]"])),
    ],
}
