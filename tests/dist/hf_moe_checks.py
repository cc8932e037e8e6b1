"""Checks of Hugging Face mixture-of-experts checkpoints (a tiny Qwen3-MoE and a tiny Mixtral, written by
the parent test with transformers) on expert parallel, inside the worker processes of one launch
(``dist_harness``).

Each check takes the trainer's road (:func:`build_parallel_model`: built on meta, the experts split
``Shard(0)`` over ep, each rank reading its experts' slices of the per-expert safetensors, the load
checked by fingerprints), saves the step-0 logits of :data:`TOKENS` for the parent to hold against
transformers', then trains ``STEPS`` steps (:func:`expert_checks.train_moe`, the balance loss of the
config.json's ``router_aux_loss_coef`` added) and saves a checkpoint after the last, which the parent
exports back to a Hugging Face directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from expert_checks import OUT_ENV, train_moe
from trainer.config.compose import compose_dict
from trainer.run.build import build_parallel_model
from trainer.validate.checks import validate_config

DIR_ENV = "MESHFLOW_TEST_HF_MOE_DIR"  # set by the parent test: a folder per model_type
KINDS = ("qwen3_moe", "mixtral")
VOCAB = 512


def tokens() -> torch.Tensor:
    """The rows whose step-0 logits are compared: 2 x 32 tokens."""
    return torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))


def run_config(kind: str, overrides: list[str]):
    """The validated RunConfig of the ``kind`` checkpoint under ``overrides`` (none: one device)."""
    return validate_config(compose_dict(["model=hf", f"model.path={Path(os.environ[DIR_ENV]) / kind}", "data=synthetic",
                                         "train.seq_len=32", "train.global_batch_size=8", *overrides]))


def hf_moe_check(kind: str, overrides: list[str]):
    def check(*, rank: int, world_size: int) -> dict:
        cfg = run_config(kind, overrides)
        pm = build_parallel_model(cfg, torch.device("cpu"))
        with torch.no_grad():
            logits = pm.model_parts[0](tokens())
        logits_file = Path(os.environ[OUT_ENV]) / f"{kind}-logits-rank{rank}.pt"
        torch.save(logits, logits_file)
        return {**train_moe(cfg, save_after=5, save_under=kind), "logits_file": str(logits_file)}

    return check


SUITES = {
    "two_rank": [(kind, hf_moe_check(kind, ["+parallel=ep", "mesh=[2]"])) for kind in KINDS],
}
