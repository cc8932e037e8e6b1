"""Atomic, sharding-aware checkpoints on torch.distributed.checkpoint (DCP).

A checkpoint is ONE directory ``<ckpt_dir>/step_<step:08d>`` holding DCP's files
(``.metadata`` plus one ``__<rank>_<n>.distcp`` per writing rank) and a ``COMPLETE`` marker.
It is written under a hidden ``.tmp-step_<step>-<random>`` name and renamed into place only
after every rank has finished, so a crash mid-save never leaves something that looks like a
checkpoint: only a ``step_*`` directory with ``COMPLETE`` counts.

Model and optimizer state come from ``get_state_dict`` (plain tensors on one device, DTensor
shards under FSDP2/TP), so the same code saves and reshards on load across mesh shapes.
``extra`` (step, scheduler/dataloader state, RNG states, the config) is written by rank 0 beside
DCP's files as JSON plus tensors (:mod:`trainer.checkpoint.extra_state`), so ``extra`` is rank 0's
on every rank after a load (per-rank state must be gathered into it by the caller). Nothing in a
checkpoint is unpickled beyond plain data (:mod:`trainer.checkpoint.safe_read`): a crafted
checkpoint is refused, never run. Saving and loading also work without a process group (DCP's ``no_dist`` mode).

    from trainer.checkpoint.dcp import save_checkpoint, resolve_resume, load_checkpoint
    path = save_checkpoint("checkpoints", step, model=model, optimizer=opt, extra={"step": step}, keep=3)
    extra = load_checkpoint(resolve_resume("auto", "checkpoints"), model=model, optimizer=opt)
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pydantic import TypeAdapter, ValidationError
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from parallel.sharding.ties import first_names
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.extra_state import read_extra_state, serialize, write_extra_state
from trainer.checkpoint.layout import COMPLETE_MARKER, latest_checkpoint, step_dir_name  # noqa: F401 - re-exported
from trainer.checkpoint.layout import finished_checkpoints as _finished_checkpoints
from trainer.checkpoint.safe_read import load_dcp, quiet_dcp, stored_keys
from trainer.config.schema import ModelConfig
from trainer.checkpoint.tied_keys import load_view, restore_aliases, without_aliases

# Flattened optimizer state keys every entry by parameter FQN (``param_groups.<fqn>.lr``). The
# nested form keys param groups by list index with the saving rank's FQN list, so a checkpoint
# written by pipeline ranks (each holding other parameters) would lose the groups' lr/betas on
# load under another pipeline split.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_TMP_PREFIX = ".tmp-"
_RESUME_FIX = ("use `auto` (newest checkpoint in train.checkpoint.dir, if any), `none`, or the path of a step_<n> "
               "directory")


# ------------------------------------------------------------------------------ finding


def _why_unfinished(path: Path) -> str | None:
    """Why ``path`` is not a finished checkpoint, or None when it is one."""
    if not path.exists():
        return "it does not exist"
    if not path.is_dir():
        return "it is not a directory"
    if not (path / COMPLETE_MARKER).is_file():
        return f"it has no {COMPLETE_MARKER} marker (an interrupted save, or not a checkpoint)"
    if not (path / ".metadata").is_file():
        return "its DCP .metadata file is missing"
    return None


def resolve_resume(resume: str, ckpt_dir: str | Path) -> Path | None:
    """Turn ``train.checkpoint.resume`` into a checkpoint path (None: start fresh).

    ``none`` -> None; ``auto`` -> the latest finished checkpoint in ``ckpt_dir`` or None;
    anything else is a path (relative ones are tried as given, then inside ``ckpt_dir``)
    that must be a finished checkpoint, else :class:`CheckpointError`.
    """
    if resume == "none":
        return None
    if resume == "auto":
        return latest_checkpoint(ckpt_dir)
    path = Path(resume)
    if not path.is_absolute() and not path.exists() and (Path(ckpt_dir) / path).exists():
        path = Path(ckpt_dir) / path
    reason = _why_unfinished(path)
    if reason is not None:
        raise CheckpointError(f"train.checkpoint.resume: {str(path)!r} is not a finished checkpoint: {reason}",
                              fix=_RESUME_FIX)
    return path


# ------------------------------------------------------------------------------- saving


def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _is_dist() else 0


def _barrier() -> None:
    if _is_dist():
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    # Makes a rename durable: the directory entry, not just the file data, must reach disk.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


def _remove_dir(path: Path) -> None:
    """Delete a directory so that a crash halfway never leaves a loadable-looking checkpoint."""
    doomed = path.parent / f"{_TMP_PREFIX}delete-{path.name}-{secrets.token_hex(4)}"
    os.replace(path, doomed)  # atomic: the step_* name disappears first
    shutil.rmtree(doomed, ignore_errors=True)


def _publish(tmp: Path, final: Path, step: int) -> None:
    """Rank 0: mark ``tmp`` complete and rename it to ``final`` atomically."""
    marker = tmp / COMPLETE_MARKER
    with open(marker, "w") as f:
        json.dump({"step": step, "time": time.time(), "world_size": dist.get_world_size() if _is_dist() else 1}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # re-saving a step after resuming from an older checkpoint
        _remove_dir(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def _prune(ckpt_dir: Path, keep: int, just_saved: Path) -> None:
    """Rank 0: keep the newest ``keep`` finished checkpoints; drop leftovers of crashed saves."""
    for _, path in _finished_checkpoints(ckpt_dir)[:-keep]:
        # After resuming from an older step, newer checkpoints of the abandoned attempt may
        # outrank the one just written; never delete what this call promised to return.
        if path != just_saved:
            _remove_dir(path)
    for child in ckpt_dir.iterdir():
        # Only this job saves here, and its current save is already renamed: any .tmp-* is stale.
        if child.name.startswith(_TMP_PREFIX) and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)


def save_checkpoint(
    ckpt_dir: str | Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    keep: int,
    tied: list[list[str]] | None = None,
    skip: set[str] | frozenset[str] = frozenset(),
) -> Path:
    """Save model, optimizer and ``extra`` as ``<ckpt_dir>/step_<step:08d>``; return that path.

    Collective when a process group is initialised: every rank calls it with the same step.
    Afterwards only the newest ``keep`` finished checkpoints remain. ``tied``: the model's tied
    names (first name first); a tie is stored under its first name only
    (:mod:`trainer.checkpoint.tied_keys`). ``skip``: model entries left out (LoRA's frozen base
    weights, which come from their own source again: :func:`load_checkpoint`'s ``may_lack``).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    extra_bytes = serialize(extra)  # on every rank, before any collective: a bad value fails them all alike
    ckpt_dir = Path(ckpt_dir)
    final = ckpt_dir / step_dir_name(step)
    names = [f"{_TMP_PREFIX}{final.name}-{secrets.token_hex(4)}"]
    if _is_dist():  # every rank must write into the same temporary directory
        dist.broadcast_object_list(names, src=0)
    tmp = ckpt_dir / names[0]
    if _rank() == 0:
        tmp.mkdir(parents=True)
    _barrier()

    model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
    model_state = {k: v for k, v in model_state.items() if k not in skip}
    aliases = first_names(tied or [])
    state: dict[str, Any] = {"model": without_aliases(model_state, aliases),
                             "optim": without_aliases(optim_state, aliases)}
    try:
        if _rank() == 0:
            write_extra_state(tmp, extra_bytes)
        with quiet_dcp():
            dcp.save(state, checkpoint_id=tmp)
        _barrier()
        if _rank() == 0:
            _publish(tmp, final, step)
    except BaseException:
        if _rank() == 0:  # a half-written save is never a checkpoint; tidy it now if we still can
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if _rank() == 0:
        _prune(ckpt_dir, keep, final)
    _barrier()  # no rank returns before the checkpoint is visible under its final name
    if _rank() != 0 and os.environ.get("LOCAL_RANK", "0") == "0" and tmp.is_dir():
        _keep_node_shards(tmp, final, keep)
    return final


def _keep_node_shards(tmp: Path, final: Path, keep: int) -> None:
    """A node whose disk is not rank 0's (``tmp`` still here after rank 0 renamed its own): its ranks'
    shards take the checkpoint's name, unfinished (no ``COMPLETE``: rank 0's node holds the metadata),
    so that copying the nodes' ``step_*`` folders into one directory makes the checkpoint whole; the
    node keeps ``keep`` of them, as rank 0 does."""
    try:
        if final.exists():
            _remove_dir(final)
        os.replace(tmp, final)
    except FileNotFoundError:  # another node on this disk (not rank 0's) renamed them first
        return
    numbered = sorted((int(m[1]), child) for child in final.parent.iterdir()
                      if (m := re.fullmatch(r"step_(\d+)", child.name)) and child.is_dir())
    for _, path in numbered[:-keep]:
        if path != final:
            _remove_dir(path)


# ------------------------------------------------------------------------------ loading


def load_checkpoint(path: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    tied: list[list[str]] | None = None,
                    may_lack: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
    """Load a finished checkpoint into ``model`` and ``optimizer`` in place; return its ``extra``.

    Resharding is DCP's: the target state (from ``get_state_dict``) decides the layout read; a
    tied parameter's every copy reads its first name's entries (``tied``, as for saving).
    ``may_lack``: model entries the checkpoint may not hold (LoRA's frozen base weights, saved
    without them); those keep the values the model has.
    Raises :class:`CheckpointError` naming the path when it is missing, unfinished or corrupt,
    or does not match the model (missing keys, different shapes).
    """
    path = Path(path)
    reason = _why_unfinished(path)
    if reason is not None:
        raise CheckpointError(f"cannot load checkpoint {str(path)!r}: {reason}")
    model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
    options = _OPTIONS
    if may_lack:
        held = stored_model_keys(path)
        model_state = {k: v for k, v in model_state.items() if k in held or k not in may_lack}
        options = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
    aliases = first_names(tied or [])
    (model_view, model_links), (optim_view, optim_links) = load_view(model_state, aliases), load_view(optim_state,
                                                                                                      aliases)
    state: dict[str, Any] = {"model": model_view, "optim": optim_view}
    load_dcp(state, path)
    extra = read_extra_state(path)
    try:
        model_state.update({k: v for k, v in state["model"].items() if k in model_state})
        optim_state.update({k: v for k, v in state["optim"].items() if k in optim_state})
        restore_aliases(model_state, state["model"], model_links)
        restore_aliases(optim_state, state["optim"], optim_links)
        state["model"], state["optim"] = model_state, optim_state
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=options)
    except Exception as exc:  # noqa: BLE001 - the model does not take the state: say which checkpoint
        raise CheckpointError(f"cannot load checkpoint {str(path)!r}: {type(exc).__name__}: {exc}") from exc
    return extra


def stored_model_keys(path: str | Path) -> set[str]:
    """The model entries (parameter FQNs) a finished checkpoint holds, from its metadata alone (read
    through the restricted reader: :func:`trainer.checkpoint.safe_read.stored_keys`)."""
    return {k.removeprefix("model.") for k in stored_keys(path) if k.startswith("model.")}


def read_extra(path: str | Path) -> dict[str, Any]:
    """Only the ``extra`` state of a finished checkpoint (step, model config, ...), no model tensors.

    Lets a caller check that a checkpoint fits the run before loading weights into it.
    """
    path = Path(path)
    if (reason := _why_unfinished(path)) is not None:
        raise CheckpointError(f"cannot load checkpoint {str(path)!r}: {reason}")
    return read_extra_state(path)


def check_model_config(path: str | Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse a checkpoint whose model config differs from the run's, naming the keys. A key the
    checkpoint's config lacks (saved before the key existed) counts as its default."""
    try:
        saved = TypeAdapter(ModelConfig).validate_python(saved).model_dump(mode="json")
    except ValidationError:
        pass  # compared as saved: the differing keys are named below
    keys = sorted(k for k in saved.keys() | current.keys() if saved.get(k) != current.get(k))
    if keys:
        diffs = ", ".join(f"model.{k}: checkpoint {saved.get(k)!r} vs run {current.get(k)!r}" for k in keys)
        raise CheckpointError(
            f"train.checkpoint.resume: checkpoint {str(path)!r} was saved from another model ({diffs})",
            fix="resume with the model config it was saved with, or start fresh with train.checkpoint.resume=none",
        )


def checkpoint_bytes(path: str | Path) -> dict[str, int]:
    """Bytes on disk of a checkpoint: total and per writing rank (DCP's ``__<rank>_*.distcp`` files)."""
    per_rank: dict[str, int] = {}
    total = 0
    for f in Path(path).iterdir():
        size = f.stat().st_size
        total += size
        if m := re.match(r"^__(\d+)_\d+\.distcp$", f.name):
            per_rank[m.group(1)] = per_rank.get(m.group(1), 0) + size
    return {"total": total, **{f"rank{r}": n for r, n in sorted(per_rank.items(), key=lambda kv: int(kv[0]))}}


def merged_module(parts: list[torch.nn.Module]) -> torch.nn.Module:
    """One module over several pipeline stages of one model, keeping the full model's FQNs.

    DCP's ``get_state_dict`` takes one module, and a rank with interleaved stages holds
    several. The stages are FQN-preserving pieces of one model (``layers.0`` here,
    ``layers.2`` there; in Hugging Face's layout both under ``model``), so a module two stages
    both hold a piece of becomes a holder of both pieces' children, level by level; a module one
    stage alone holds is used as it is. Nothing is copied.
    """
    if len(parts) == 1:
        return parts[0]
    return _merged(parts)


def _merged(modules: list[torch.nn.Module]) -> torch.nn.Module:
    distinct = list({id(m): m for m in modules}.values())
    if len(distinct) == 1:
        return distinct[0]
    holder = torch.nn.Module()
    for module in distinct:
        for name, param in module.named_parameters(recurse=False):
            holder.register_parameter(name, param)
        for name, buf in module.named_buffers(recurse=False):
            holder.register_buffer(name, buf, persistent=name not in module._non_persistent_buffers_set)
    names = list(dict.fromkeys(name for module in distinct for name, _ in module.named_children()))
    for name in names:
        holder.add_module(name, _merged([child for m in distinct if (child := m._modules.get(name)) is not None]))
    return holder
