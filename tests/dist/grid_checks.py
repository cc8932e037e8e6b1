"""Checks of 2-D (``+parallel=tp2d``) and 2.5-D (``+parallel=tp2p5d``) tensor parallelism, run inside the
worker processes of one launch (``dist_harness``). Each takes the trainer's road: the config composed from
overrides and validated, the model built on meta, partitioned over the grid and initialised shard by shard
(:func:`build_parallel_model`); then it trains ``STEPS`` steps on the batches of ``dist_checks``. The parent
compares the losses and gradient norms with one device.
"""

from __future__ import annotations

import os

import torch
from torch.distributed.tensor import DTensor

import dist_checks
from dist_checks import train
from trainer.config.compose import compose_dict
from trainer.models import decoder_config
from trainer.run.build import build_parallel_model
from trainer.validate.checks import validate_config

HF_ENV, SMOL_ENV = "MESHFLOW_TEST_GRID_HF_DIR", "MESHFLOW_TEST_GRID_SMOL_DIR"  # set by the parent test
QWEN3_ENV = "MESHFLOW_TEST_GRID_QWEN3_DIR"  # a Qwen3-like model: per-head q/k norms, head_dim 24
SMOL_FIX, SMOL_BATCH = ["mesh=[3,3]", "train.global_batch_size=15"], 15  # tests/conf/test_grid_configs.py checks it
SMOL_2P5D_FIX = ["mesh=[1,3,3]", "train.global_batch_size=15"]  # the first (smallest) fix of tp2p5d's refusal, alike
BASE = ["data=synthetic", "train.seq_len=32", "train.global_batch_size=8", "tracking=none"]


def model_overrides(model: str) -> list[str]:
    """``builtin``: the built-in gpt_debug; ``hf``: a tied 4-head Llama; ``smol``: SmolLM2's 9 / 3 heads, tied;
    ``qwen3``: Qwen3's per-head q/k norms, 4 / 2 heads of width 24, untied."""
    if model == "builtin":
        return ["model=gpt_debug"]
    return ["model=hf", f"model.path={os.environ[{'hf': HF_ENV, 'smol': SMOL_ENV, 'qwen3': QWEN3_ENV}[model]]}"]


def grid_check(model: str, overrides: list[str], *, global_batch: int | None = None):
    """``global_batch``: sequences per step when the grid's rows do not split ``dist_checks``' 8 (the parent's
    reference trains on the same)."""

    def check(*, rank: int, world_size: int) -> dict:
        if global_batch is not None:
            dist_checks.GLOBAL_BATCH = global_batch
        cfg = validate_config(compose_dict([*model_overrides(model), *BASE, *overrides]))
        pm = build_parallel_model(cfg, torch.device("cpu"))
        (part,) = pm.model_parts
        params = dict(part.named_parameters())
        q_name = next(n for n in params if n.endswith(("attn.wq.weight", "self_attn.q_proj.weight")))
        q = params[q_name]
        seen: list = []
        attention = part.get_submodule(q_name.rsplit(".", 2)[0])
        attention.register_forward_pre_hook(
            lambda _m, args: seen.append(list(args[0].to_local().shape) if isinstance(args[0], DTensor) else None))
        result = train(pm, decoder_config(cfg.model))
        q_norm = next((p for n, p in params.items() if n.endswith("q_norm.weight")), None)
        return {"losses": result["losses"], "grad_norms": result["grad_norms"], "eval_loss": result["eval_loss"],
                "q_norm_placements": [str(p) for p in q_norm.placements] if isinstance(q_norm, DTensor) else None,
                "q_placements": [str(p) for p in getattr(q, "placements", ())],
                "q_local_shape": list((q.to_local() if isinstance(q, DTensor) else q).shape),
                "q_shape": list(q.shape), "attn_input_local_shape": seen[0] if seen else None,
                "dp_size": pm.dp_size, "report": {k: v for k, v in pm.placement_report.items()
                                                     if k.endswith(("layers.0", "layers.0.self_attn.q_norm"))}}

    return check


SUITES = {
    "four_rank": [
        ("tp2d", grid_check("builtin", ["+parallel=tp2d"])),
        ("tp2d_hf", grid_check("hf", ["+parallel=tp2d"])),
        ("tp2d_qwen3", grid_check("qwen3", ["+parallel=tp2d"])),
    ],
    "eight_rank": [
        ("tp2d_dp", grid_check("builtin", ["+parallel=tp2d_dp"])),
        ("tp2d_fsdp", grid_check("builtin", ["+parallel=tp2d_dp", "parallel.data_parallel.mode=fsdp"])),
        ("tp2p5d", grid_check("builtin", ["+parallel=tp2p5d"])),
        ("tp2p5d_hf", grid_check("hf", ["+parallel=tp2p5d"])),
        ("tp2d_dp_qwen3", grid_check("qwen3", ["+parallel=tp2d_dp"])),
        ("tp2p5d_qwen3", grid_check("qwen3", ["+parallel=tp2p5d"])),
    ],
    # The printed fixes for SmolLM2's 9 heads on a 2 x 2 grid and on tp2p5d's 2 x 2 x 2, applied as printed.
    "nine_rank": [
        ("tp2d_smol_3x3", grid_check("smol", ["+parallel=tp2d", *SMOL_FIX], global_batch=SMOL_BATCH)),
        ("tp2p5d_smol_1x3x3", grid_check("smol", ["+parallel=tp2p5d", *SMOL_2P5D_FIX], global_batch=SMOL_BATCH)),
    ],
}
