"""Checks of this host's disk, made by the launcher right before it starts a run, where the run's
relative paths mean what they will mean to the run. Validation does not make them: it also runs where
no run starts from that directory (the control plane's submission, a dry run, a test suite).

    issues = launch_disk_issues(cfg)      # [] or the refusals, each with a fix that works as printed

A new run never destroys another run's checkpoints: a run that starts afresh
(``train.checkpoint.resume=none``) and would save into a ``train.checkpoint.dir`` that already holds
finished checkpoints would replace the one of the same step and, past ``train.checkpoint.keep``, delete
the older ones. It is refused, with the two fixes: continue that run, or give this one its own directory.
"""

from __future__ import annotations

from pathlib import Path

from parallel.errors import ConfigIssue, override
from trainer.checkpoint.layout import SHARED_DIR_EXAMPLE, finished_checkpoints
from trainer.config.schema import RunConfig

def launch_disk_issues(cfg: RunConfig) -> list[ConfigIssue]:
    """What stops ``cfg`` from starting from this directory on this host (none for a plan or a check)."""
    if cfg.dry_run or cfg.validate_only:
        return []
    return check_checkpoint_dir(cfg)


def check_checkpoint_dir(cfg: RunConfig) -> list[ConfigIssue]:
    """A fresh run that would save into a directory holding another run's finished checkpoints."""
    ckpt = cfg.train.checkpoint
    if ckpt.resume != "none" or not (ckpt.every or ckpt.save_final):
        return []
    found = finished_checkpoints(ckpt.dir)
    if not found:
        return []
    names = ", ".join(path.name for _, path in found[-3:]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    return [ConfigIssue(
        "train.checkpoint.dir",
        f"{ckpt.dir!r} already holds another run's checkpoints ({names}); this run starts afresh and would replace "
        "them or, past train.checkpoint.keep, delete them",
        f"continue that run with {override('train.checkpoint.resume', 'auto')}, or give this one a directory of "
        f"its own: {override('train.checkpoint.dir', free_dir(ckpt.dir))}")]


def free_dir(ckpt_dir: str) -> str:
    """``<ckpt_dir>-2`` (or -3, ...): the first such directory holding no finished checkpoint."""
    base = ckpt_dir.rstrip("/") or ckpt_dir
    n = 2
    while finished_checkpoints(f"{base}-{n}"):
        n += 1
    return f"{base}-{n}"


def checkpoint_sharing_warning(cfg: RunConfig) -> str | None:
    """What a run of several nodes with a relative ``train.checkpoint.dir`` should know before it starts
    (None on one node, or with an absolute directory)."""
    ln, ckpt = cfg.launch, cfg.train.checkpoint
    if ln.nnodes == 1 or Path(ckpt.dir).is_absolute() or not (ckpt.every or ckpt.save_final):
        return None
    here = Path(ckpt.dir).resolve()
    return (f"warning: train.checkpoint.dir={ckpt.dir} is relative: each of the {ln.nnodes} nodes saves its own ranks' "
            f"shards under its own working directory ({here} here), so a checkpoint is whole only if that is a disk "
            "every node shares. To resume later, give a directory every node mounts at the same path, "
            f"e.g. train.checkpoint.dir={SHARED_DIR_EXAMPLE}. (The final model in MLflow is gathered over the network "
            "and needs no shared disk.)")
