"""The loop's checkpoints: resuming from one before the first step, saving one when it is due.

    checkpointer = Checkpointer(cfg, pm, optimizer, scheduler, loader)
    start = checkpointer.resume(tracker=tracker, progress=progress)     # 0 on a fresh run
    if checkpointer.due(step):
        path = checkpointer.save(step, rank=rank, tracker=tracker, progress=progress)

A checkpoint (DCP, :mod:`trainer.checkpoint.dcp`) holds the model and optimizer state, and beside it
what the run continues from: the step, the schedule's and the loader's state, the RNG, the model
and data config, the fingerprints of what the saving mesh held (checked on the resuming one before
step 1) and where LoRA's frozen base weights, left out, come from.
"""

from __future__ import annotations

import math
import random
import time

import torch

from parallel.engine import ParallelModel
from trainer.checkpoint.dcp import (
    check_model_config,
    checkpoint_bytes,
    load_checkpoint,
    merged_module,
    read_extra,
    resolve_resume,
    save_checkpoint,
)
from trainer.config.schema import OptimConfig, RunConfig
from trainer.data.loader import GlobalBatchLoader
from trainer.models.fingerprint import check_fingerprints, model_fingerprints
from trainer.models.init import canonical_fqn
from trainer.run.disk import naming_a_full_disk, state_bytes
from trainer.run.metrics import NullProgress
from trainer.tracking.tracker import Tracker


class Checkpointer:
    """Saves and restores one run's training state (``train.checkpoint``): the model's parts merged
    into one module with the full model's names, the optimizer, the schedule, the loader and the RNG."""

    def __init__(self, cfg: RunConfig, pm: ParallelModel, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, loader: GlobalBatchLoader) -> None:
        self.cfg, self.pm, self.scheduler, self.loader = cfg, pm, scheduler, loader
        self.model, self.optimizer, self.tied = merged_module(pm.model_parts), optimizer, pm.tied_names
        # LoRA's base: from model.path, train.init_from or the seed again, not the checkpoint
        self.frozen = frozen_names(pm)
        lora = getattr(cfg.model, "lora", None)
        self.skip = self.frozen if lora is not None and lora.enabled and not lora.save_base else set()

    def resume(self, *, tracker: Tracker, progress: NullProgress) -> int:
        """Load ``train.checkpoint.resume``'s checkpoint, if any, and return its step (0 without one)."""
        ckpt = self.cfg.train.checkpoint
        path = resolve_resume(ckpt.resume, ckpt.dir)
        if not path:
            return 0
        check_model_config(path, read_extra(path)["model_config"], self.cfg.model.model_dump(mode="json"))
        extra = load_checkpoint(path, model=self.model, optimizer=self.optimizer, tied=self.tied, may_lack=self.frozen)
        if "fingerprints" in extra:  # what the saving mesh held, checked on this one before step 1
            check_fingerprints(self.pm, extra["fingerprints"], what=f"train.checkpoint.resume ({path})")
        self.scheduler.load_state_dict(extra["scheduler"])
        self.loader.load_state_dict(extra["loader"])
        _set_rng_state(extra["rng"])
        progress.log(f"resumed from {path} at step {int(extra['step'])}")
        if kept := kept_optimizer_settings(self.optimizer, self.scheduler, self.cfg.optim):
            progress.log(f"warning: the checkpoint's optimizer settings continue, not the config's: {', '.join(kept)} "
                         "(a resume keeps AdamW's state and the schedule's base learning rate as saved)")
        tracker.set_tag("resumed_from", str(path))
        return int(extra["step"])

    def due(self, step: int) -> bool:
        """Whether a checkpoint is saved after ``step``: every ``train.checkpoint.every`` steps, and
        after the last one with ``save_final``."""
        ckpt = self.cfg.train.checkpoint
        return bool(ckpt.every and step % ckpt.every == 0) or (ckpt.save_final and step == self.cfg.train.steps)

    def save(self, step: int, *, rank: int, tracker: Tracker, progress: NullProgress) -> str:
        """Save the state after ``step`` (every rank its shards); rank 0 logs its size and time. Returns its path."""
        t, ckpt = self.cfg.train, self.cfg.train.checkpoint
        began = time.perf_counter()
        extra = {"step": step, "scheduler": self.scheduler.state_dict(), "loader": self.loader.state_dict(),
                 "rng": _rng_state(), "model_config": self.cfg.model.model_dump(mode="json"),
                 "data_config": self.cfg.data.model_dump(mode="json"), "fingerprints": model_fingerprints(self.pm),
                 "base": {"seed": t.seed, "init_from": t.init_from}}  # where frozen weights left out come from
        with naming_a_full_disk(ckpt.dir, needed_bytes=state_bytes(self.model, self.optimizer)):
            saved = save_checkpoint(ckpt.dir, step, extra=extra, keep=ckpt.keep, skip=self.skip, model=self.model,
                                    optimizer=self.optimizer, tied=self.tied)
        seconds = time.perf_counter() - began
        if rank == 0:
            nbytes = checkpoint_bytes(saved)["total"]
            figures = {"checkpoint_seconds": seconds, "checkpoint_bytes": nbytes}
            if ckpt.every:  # periodic saves: a chart; the final save alone: one number of the run
                tracker.log_metrics(figures, step=step)
            else:
                tracker.log_summary(figures)
            tracker.set_tag("latest_checkpoint", str(saved.resolve()))
            progress.log(f"checkpoint {saved} ({nbytes / 2**20:.1f} MiB, {seconds:.2f} s)")
        return str(saved.resolve())


def kept_optimizer_settings(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                            optim: OptimConfig) -> list[str]:
    """What a resume kept from the checkpoint against the config (``optim.lr=0.0045 (the checkpoint's 0.003)``):
    the schedule's base learning rate and AdamW's betas, eps and weight decay are loaded with the optimizer's and
    the schedule's state, so a value changed in the config since has no effect, and the run says so."""
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    pairs = [("lr", optim.lr, scheduler.base_lrs[0] if scheduler.base_lrs else optim.lr),
             ("betas", tuple(optim.betas), tuple(group.get("betas", optim.betas))),
             ("eps", optim.eps, group.get("eps", optim.eps)),
             ("weight_decay", optim.weight_decay, group.get("weight_decay", optim.weight_decay))]
    return [f"optim.{name}={_shown(wanted)} (the checkpoint's {_shown(kept)})" for name, wanted, kept in pairs
            if not _same(wanted, kept)]


def _same(a, b) -> bool:
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return len(a) == len(b) and all(math.isclose(float(x), float(y), rel_tol=1e-9, abs_tol=0.0) for x, y in zip(a, b))


def _shown(value) -> str:
    return f"[{', '.join(f'{v:g}' for v in value)}]" if isinstance(value, tuple) else f"{value:g}"


def frozen_names(pm: ParallelModel) -> set[str]:
    """The canonical FQNs of this rank's parameters that do not train (LoRA's base weights)."""
    return {canonical_fqn(name) for part in pm.model_parts
            for name, p in part.named_parameters(remove_duplicate=False) if not p.requires_grad}


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss_next = state["python"]  # lists once stored as JSON; random wants tuples
    random.setstate((version, tuple(internal), gauss_next))
