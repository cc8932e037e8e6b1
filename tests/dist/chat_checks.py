"""Checks of chat fine-tuning on several layouts, run inside the worker processes of one launch
(``dist_harness``): the trainer's own loop on packed conversations whose rows carry uneven target
counts (so every micro-batch, accumulation batch and rank holds a different share of the targets),
and the logits of packed documents against each document run alone on one device.
"""

from __future__ import annotations

import os

import torch
from torch.distributed.tensor import DTensor

from trainer.config.compose import compose_dict
from trainer.run.metrics import NullProgress
from trainer.tracking.tracker import NullTracker
from trainer.validate.checks import validate_config

DIR_ENV = "MESHFLOW_TEST_CHAT_DIR"  # set by the parent test: model/ (weights, tokenizer, template), chats.jsonl
STEPS = 5


def overrides(extra: list[str]) -> list[str]:
    root = os.environ[DIR_ENV]
    return ["model=hf", f"model.path={root}/model", "data=chat", f"data.paths=[{root}/chats.jsonl]",
            "train.seq_len=64", "train.global_batch_size=8", f"train.steps={STEPS}", "tracking=none",
            "train.checkpoint.save_final=false",
            "tracking.pictures=false", "train.eval_at_start=false", "optim.lr=1e-3", "optim.warmup_steps=0", *extra]


def run_config(extra: list[str]):
    return validate_config(compose_dict(overrides(extra)))


def trained(extra: list[str]):
    """A check: the trainer's loop under ``extra``; its losses, as every rank reports them."""

    def check(*, rank: int, world_size: int) -> dict:
        from trainer.run.loop import train

        result = train(run_config(extra), tracker=NullTracker(), progress=NullProgress(), rank=rank)
        return {"losses": result.losses}

    return check


# A validation split of 7 rows (one conversation each, uneven target counts) in global batches of 4:
# two batches, the second with a padding row; each row must count once, token-weighted.
VALIDATION = ["data.packing=false", "train.global_batch_size=4", "train.eval_batches=4"]


def validation_overrides(extra: list[str]) -> list[str]:
    return [f"data.val_paths=[{os.environ[DIR_ENV]}/val.jsonl]", *VALIDATION, *extra]


def validated(extra: list[str]):
    """A check: the layout's ``val_loss`` of the 7-row validation split (:func:`trainer.run.step.evaluate`)."""

    def check(*, rank: int, world_size: int) -> dict:
        from trainer.data import build_splits
        from trainer.models import decoder_config
        from trainer.run.build import build_parallel_model
        from trainer.run.step import evaluate

        cfg = run_config(validation_overrides(extra))
        splits = build_splits(cfg.data, seq_len=cfg.train.seq_len, model_cfg=decoder_config(cfg.model),
                              model_path=cfg.model.path)
        pm = build_parallel_model(cfg, torch.device("cpu"))
        return {"val_loss": evaluate(pm, splits.val, cfg, torch.device("cpu")), "rows": len(splits.val)}

    return check


def hand_val_loss() -> float:
    """One device, row by row: the validation split's summed cross-entropy over its target count."""
    from trainer.data import build_splits
    from trainer.models import decoder_config

    cfg = run_config(validation_overrides([]))
    val = build_splits(cfg.data, seq_len=cfg.train.seq_len, model_cfg=decoder_config(cfg.model),
                              model_path=cfg.model.path).val
    model, total, count = reference_model(cfg), 0.0, 0
    with torch.no_grad():
        for i in range(len(val)):
            inputs, targets = val[i]
            logits = model(inputs[None])[0]
            total += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))  # -100: ignored
            count += int((targets != -100).sum())
    return total / count


def reference_model(cfg):
    """The whole model with its Hugging Face weights, on this process alone."""
    from trainer.models import build_model
    from trainer.models.hf import load_hf_weights, weight_files

    model = build_model(cfg.model, seed=0)
    load_hf_weights(model, weight_files(cfg.model.path), tied=False)
    return model


def packed_logits(extra: list[str]):
    """A check: the layout's logits of 4 packed rows, each document's against that document alone
    on one device (the largest difference), on the ranks that hold the logits."""

    def check(*, rank: int, world_size: int) -> dict:
        from trainer.data import build_source
        from trainer.models import decoder_config, loss_fn_for
        from trainer.run.build import build_parallel_model

        cfg = run_config(extra)
        pm = build_parallel_model(cfg, torch.device("cpu"))
        source = build_source(cfg.data, seq_len=cfg.train.seq_len, model_cfg=decoder_config(cfg.model),
                              model_path=cfg.model.path)
        inputs, targets, positions = (torch.stack(column) for column in zip(*(source[i] for i in range(4))))
        with torch.no_grad():
            if pm.num_stages == 1:
                logits = pm.model_parts[0](inputs, positions=positions)
            else:  # the schedule's forward-only pass (its last stage computes a loss too), outputs kept
                pm._loss_fn, pm._loss_factor = loss_fn_for(cfg.model, masked=True), 1.0
                args = (inputs,) if pm.is_first_stage else ()
                target = targets if pm.is_last_stage else None
                logits = pm.schedule.eval(*args, target=target, losses=[], positions=positions)
        if logits is None:
            return {"worst": None, "documents": 0}
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        alone_model = reference_model(cfg)
        worst, documents = 0.0, 0
        with torch.no_grad():
            for row in range(4):
                starts = positions[row].eq(0).nonzero().flatten().tolist() + [positions.shape[1]]
                for begin, end in zip(starts[:-1], starts[1:]):
                    alone = alone_model(inputs[row : row + 1, begin:end])[0]
                    worst = max(worst, float((logits[row, begin:end] - alone).abs().max()))
                    documents += 1
        return {"worst": worst, "documents": documents}

    return check


SUITES = {
    "two_rank": [
        ("fsdp", trained(["+parallel=fsdp", "mesh=[2]"])),
        ("tp", trained(["+parallel=tp", "mesh=[2]"])),
        ("pp_grad_accum", trained(["+parallel=pp", "mesh=[2]", "train.grad_accum=2", "parallel.pipeline.microbatches=2"])),
        ("tp_logits", packed_logits(["+parallel=tp", "mesh=[2]"])),
        ("tp_sp_logits", packed_logits(["+parallel=tp_sp", "mesh=[2]"])),
        ("pp_logits", packed_logits(["+parallel=pp", "mesh=[2]"])),
        ("fsdp_val", validated(["+parallel=fsdp", "mesh=[2]"])),
        ("tp_val", validated(["+parallel=tp", "mesh=[2]"])),
        ("pp_val", validated(["+parallel=pp", "mesh=[2]"])),
        ("cp_val", validated(["+parallel=cp", "mesh=[2]"])),
    ],
    "eight_rank": [
        ("3d", trained(["+parallel=3d", "mesh=[2,2,2]"])),
    ],
}
