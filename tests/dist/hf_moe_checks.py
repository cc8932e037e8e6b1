"""Checks of Hugging Face mixture-of-experts checkpoints (a tiny Qwen3-MoE and a tiny Mixtral, written by
the parent test with transformers) on expert parallel and on context parallel, inside the worker processes
of one launch (``dist_harness``).

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


def hf_moe_check(kind: str, overrides: list[str], name: str | None = None):
    """``kind``'s checkpoint trained 5 steps under ``overrides`` (saved under ``name``, default ``kind``),
    and (unless the layout splits rows over cp ranks, which the full rows of :func:`tokens` are not) its
    step-0 logits on :func:`tokens` from the built model."""
    name = name or kind

    def check(*, rank: int, world_size: int) -> dict:
        cfg = run_config(kind, overrides)
        if cfg.parallel.context_parallel is not None:
            return train_moe(cfg, save_after=5, save_under=name)
        pm = build_parallel_model(cfg, torch.device("cpu"))
        with torch.no_grad():
            logits = pm.model_parts[0](tokens())
        logits_file = Path(os.environ[OUT_ENV]) / f"{name}-logits-rank{rank}.pt"
        torch.save(logits, logits_file)
        return {**train_moe(cfg, save_after=5, save_under=name), "logits_file": str(logits_file)}

    return check


SUITES = {  # ep [2], then cp [2] (each row of 32 tokens in 4 chunks of 8)
    "two_rank": [*((kind, hf_moe_check(kind, ["+parallel=ep", "mesh=[2]"])) for kind in KINDS),
                 *((f"{kind}_cp", hf_moe_check(kind, ["+parallel=cp", "mesh=[2]"], name=f"{kind}_cp")) for kind in KINDS)],
}
