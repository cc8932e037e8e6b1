"""Reading a DCP checkpoint without running code from it.

A checkpoint directory may come from anyone (a shared disk, a download), and DCP trusts it:
torch's ``FileSystemReader`` unpickles ``.metadata`` with plain :mod:`pickle`, and DCP's default
load planner reads every non-tensor item (a flattened optimizer's ``lr``, ``betas``...) with
``torch.load(weights_only=False)``. A crafted file would run any command as the user who loads it.
Here the metadata goes through an unpickler that resolves only what DCP metadata is made of
(:data:`_ALLOWED`, the dataclasses of ``torch.distributed.checkpoint.metadata``, torch dtypes),
non-tensor items through ``torch.load(weights_only=True)``, and a data file must lie inside the
checkpoint. Anything else is refused with a :class:`CheckpointError` naming the path and what
was refused. Every load of a checkpoint in the project goes through :func:`load_dcp`.

    load_dcp({"model": model_state}, path)      # fills the tensors in place, as dcp.load does
    keys = stored_keys(path)                    # the saved keys, read from the metadata alone
"""

from __future__ import annotations

import importlib
import io
import pickle
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from trainer.checkpoint.errors import CheckpointError

METADATA_FILE = ".metadata"  # DCP's name for it (torch.distributed.checkpoint.filesystem._metadata_fn)
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# Besides the metadata module's own classes and torch dtypes: what DCP's writer puts in .metadata.
_ALLOWED = frozenset({
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name: torch.strided
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
})
_UNSAFE_FIX = ("it was not written by Meshflow's trainer or was altered after: do not load it; use a checkpoint "
               "you or the service wrote")


class UnsafeCheckpoint(pickle.UnpicklingError):
    """Something in a checkpoint that a checkpoint never holds (a global, a path outside it)."""


def _allowed(module: str, name: str) -> bool:
    if (module, name) in _ALLOWED:
        return True
    if module == _METADATA_MODULE:  # its dataclasses and the memory-format enum; nothing imported into it
        obj = getattr(importlib.import_module(module), name, None)
        return isinstance(obj, type) and obj.__module__ == module
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise UnsafeCheckpoint(f"its {METADATA_FILE} asks for the global {module}.{name}, which DCP "
                                   "metadata never holds")
        return super().find_class(module, name)


def read_metadata_file(stream: BinaryIO) -> Metadata:
    """DCP metadata from an open ``.metadata`` file, or :class:`UnsafeCheckpoint`."""
    metadata = _MetadataUnpickler(stream).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"its {METADATA_FILE} holds a {type(metadata).__name__}, not DCP Metadata")
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        # DCP opens <checkpoint>/<relative_path>: a path with a directory in it could read any file.
        if not isinstance(relative, str) or Path(relative).name != relative or relative in ("", ".", ".."):
            raise UnsafeCheckpoint(f"its {METADATA_FILE} points at the data file {relative!r}, outside the checkpoint")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read by :func:`read_metadata_file`, never plain pickle."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = self.fs.concat_path(self.path, METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}")
        with self.fs.create_stream(path, "rb") as stream:  # a file opened "rb" (typed only as an IOBase)
            metadata = read_metadata_file(cast(BinaryIO, stream))
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()  # as FileSystemReader does
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class _FirstGlobal(Exception):
    pass


class _GlobalProbe(pickle.Unpickler):
    """Finds the first global a pickle asks for, and stops there: nothing is imported or called."""

    def find_class(self, module: str, name: str) -> Any:
        raise _FirstGlobal(f"{module}.{name}")


def _refusal_detail(err: Exception, raw: bytes) -> str:
    # torch's message advises weights_only=False, exactly what must not happen here: name the global instead.
    if found := re.search(r"GLOBAL ([\w.]+)", str(err)):
        return f"it asks for the global {found.group(1)}"
    try:  # a bare pickle, not torch.save's zip: torch names only the opcode it stopped at
        _GlobalProbe(io.BytesIO(raw)).load()
    except _FirstGlobal as first:
        return f"it asks for the global {first}"
    except Exception:  # noqa: BLE001 - no global found; torch's own words follow
        pass
    return " ".join(str(err).split("WeightsUnpickler error:")[-1].split())[:200]


def load_plain(data: bytes | BinaryIO, *, what: str) -> Any:
    """``torch.load(weights_only=True)``: tensors and plain containers only, or :class:`UnsafeCheckpoint`."""
    raw = data if isinstance(data, bytes) else data.read()
    try:
        with warnings.catch_warnings():  # "pickle protocol 4 in the checkpoint": refused or read, never run
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpoint(f"{what} is a pickle of more than tensors and plain values "
                               f"({_refusal_detail(err, raw)})") from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` reading non-tensor items with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = load_plain(value, what=f"its item {fqn!r}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


@contextmanager
def quiet_dcp() -> Iterator[None]:
    # DCP warns on every call without a process group; that is the intended single-process mode.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def root_cause(exc: BaseException) -> BaseException:
    # CheckpointException's str() is every rank's full traceback; the root cause reads better.
    if isinstance(exc, CheckpointException) and exc.failures:
        return next(iter(exc.failures.values()))[0]
    return exc


def refused(path: str | Path, exc: UnsafeCheckpoint) -> CheckpointError:
    return CheckpointError(f"refusing checkpoint {str(path)!r}: {exc}", fix=_UNSAFE_FIX)


def load_dcp(state: dict[str, Any], path: str | Path, *, no_dist: bool = False) -> None:
    """``dcp.load(state, checkpoint_id=path)`` without unpickling anything but plain data; a
    collective when a process group is up (unless ``no_dist``). Raises :class:`CheckpointError`
    naming ``path``: refused (unsafe content) or unreadable (the root cause)."""
    stored_keys(path)  # DCP would swallow a refusal of the metadata into "metadata is None"
    try:
        with quiet_dcp():
            dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=no_dist)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        cause = root_cause(exc)
        if isinstance(cause, UnsafeCheckpoint):
            raise refused(path, cause) from None
        raise CheckpointError(f"cannot load checkpoint {str(path)!r}: {type(cause).__name__}: {cause}") from exc


def stored_keys(path: str | Path) -> set[str]:
    """The keys a checkpoint holds (``model.<fqn>``, ``optim.<key>``...), from its metadata alone."""
    try:
        return set(SafeFileSystemReader(path).read_metadata().state_dict_metadata)
    except UnsafeCheckpoint as exc:
        raise refused(path, exc) from None
    except Exception as exc:  # noqa: BLE001 - a damaged file fails in many ways; each is reported with the path
        raise CheckpointError(f"cannot load checkpoint {str(path)!r}: {type(exc).__name__}: {exc}") from exc
