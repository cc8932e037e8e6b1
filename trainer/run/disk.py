"""A full disk named as one: a save that fails for lack of space says ``disk full at PATH``.

    with naming_a_full_disk(ckpt.dir, needed_bytes=state_bytes(model, optimizer)):
        save_checkpoint(ckpt.dir, step, ...)

torch's zip writer loses the errno: a checkpoint written to a full disk fails with
``[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598`` (or ``file write failed``),
wrapped by DCP in a ``CheckpointException`` that holds every rank's traceback. So a failed write is
a full disk when an ``ENOSPC`` / ``EDQUOT`` error is anywhere in the chain, or when the writer failed
and the filesystem has less room than the save needed (what it holds now: DCP removes the
half-written files before the error arrives here).
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

MIB = 2**20
WRITER_FAILED = ("unexpected pos", "file write failed", "No space left on device", "Disk quota exceeded")


class DiskFullError(OSError):
    """A write ran out of space; the message names where, how much is free and what to do."""


def _chain(err: BaseException) -> Iterator[BaseException]:
    """``err``, its causes and contexts, and the per-rank failures a DCP ``CheckpointException`` holds."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo += [current.__cause__, current.__context__]
        for failure in (getattr(current, "failures", None) or {}).values():  # {rank: (exception, traceback)}
            todo.append(failure[0] if isinstance(failure, tuple) else failure)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def disk_full_error(err: BaseException, path: str | Path, needed_bytes: int) -> DiskFullError | None:
    """A :class:`DiskFullError` for ``err`` when it is a write that ran out of space under ``path``; else None."""
    causes = list(_chain(err))
    space = [c for c in causes if isinstance(c, OSError) and c.errno in (errno.ENOSPC, errno.EDQUOT)]
    try:
        usage = shutil.disk_usage(_existing(Path(path)))
    except OSError:  # the filesystem is gone too: nothing to add to the original error
        return None
    writer_failed = any(marker in str(c) for c in causes for marker in WRITER_FAILED)
    if not space and not (writer_failed and usage.free < needed_bytes):
        return None
    where = space[0].filename if space and space[0].filename else path
    return DiskFullError(errno.ENOSPC, f"disk full at {where}: {usage.free / MIB:.1f} MiB free of "
                         f"{usage.total / MIB:.1f} MiB, the save needed about {needed_bytes / MIB:.1f} MiB "
                         "(free space there, lower train.checkpoint.keep, save less often with "
                         "train.checkpoint.every, or give train.checkpoint.dir on a larger disk)")


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameters and optimizer state: about what its part of a checkpoint writes."""
    tensors = list(model.parameters()) + [t for state in optimizer.state.values() for t in state.values()
                                          if isinstance(t, torch.Tensor)]
    local = (getattr(t, "_local_tensor", t) for t in tensors)  # a DTensor writes its local shard
    return sum(t.numel() * t.element_size() for t in local)


@contextmanager
def naming_a_full_disk(path: str | Path, *, needed_bytes: int) -> Iterator[None]:
    """Re-raise a failure of the block that ran out of space under ``path`` as :class:`DiskFullError`."""
    try:
        yield
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        if (full := disk_full_error(err, path, needed_bytes)) is not None:
            raise full from err
        raise
