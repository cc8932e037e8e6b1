"""The run's final weights, gathered from every rank over the process group and logged by rank 0 as
the MLflow run's ``model/`` artifacts (``tracking.log_model``): no checkpoint is read back, so it
works whether or not the nodes of a run share a disk.

    if logs_final_model(cfg):                       # the same answer on every rank: a collective follows
        log_final_model(cfg, module, tracker=tracker, progress=progress)

``model/model.safetensors`` is :mod:`trainer.export`'s file (``train.init_from`` starts a run from
it); ``model/hf/`` a Hugging Face directory (``config.json``, ``model.safetensors``, the run's
tokenizer) for a model that has that layout (:func:`trainer.export.hf.hf_layout_refusal`).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from parallel.sharding.gather import full_state_on_rank0
from parallel.sharding.ties import alias_names
from trainer.config.schema import RunConfig
from trainer.export.hf import hf_layout_refusal
from trainer.export.sources import Source, template_text
from trainer.export.weights import export_model
from trainer.models import build_model
from trainer.run.metrics import NullProgress
from trainer.tracking.tracker import Tracker


def logs_final_model(cfg: RunConfig) -> bool:
    """Whether the run logs its final weights (every rank answers alike: it gathers them)."""
    return cfg.tracking.backend == "mlflow" and cfg.tracking.log_model is not False


def log_final_model(cfg: RunConfig, module: torch.nn.Module, *, tracker: Tracker, progress: NullProgress) -> None:
    """Gather ``module``'s weights (this rank's part: every rank calls this) to rank 0, which writes
    and logs them; the other ranks return once they sent theirs."""
    began = time.perf_counter()
    state = full_state_on_rank0(module)
    if state is None:
        return
    model = plain_model(cfg, state)
    with tempfile.TemporaryDirectory(prefix="meshflow-model-") as tmp:
        file = Path(tmp) / "model.safetensors"
        written = export_model(model, cfg.model, file, step=cfg.train.steps)
        tracker.log_artifact(file, "model")
        logged = ["model/model.safetensors"]
        if hf_layout_refusal(cfg.model) is None:
            export_model(model, cfg.model, Path(tmp) / "hf", format="hf", **run_tokenizer(cfg))
            for path in sorted((Path(tmp) / "hf").iterdir()):
                tracker.log_artifact(path, "model/hf")
            logged.append("model/hf/")
    progress.log(f"final model: {' and '.join(logged)} in the MLflow run ({written['bytes'] / 2**20:.1f} MiB, "
                 f"{time.perf_counter() - began:.2f} s)")


def run_tokenizer(cfg: RunConfig) -> dict:
    """The run's own tokenizer and chat template for its Hugging Face directory: the user's config names
    them (``data.tokenizer``, ``data.template``), so, unlike a checkpoint's metadata, it is trusted as the
    export's ``--tokenizer`` and ``--template`` are."""
    named, template = getattr(cfg.data, "tokenizer", None), getattr(cfg.data, "template", None)
    return {"tokenizer": Source(Path(named)) if named and Path(named).exists() else None,
            "template": template_text("", {}, None, given=template) if template else None}


def plain_model(cfg: RunConfig, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The model on one device (the CPU) holding ``state``, every tensor of the trained model."""
    model = build_model(cfg.model, seed=cfg.train.seed)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = sorted(set(missing) - alias_names(model))  # a tie's other name shares the loaded tensor
    if missing or unexpected:
        raise ValueError(f"the gathered weights do not fit the model: missing {missing[:4]}, unexpected "
                         f"{sorted(unexpected)[:4]}")
    return model
