"""A checkpoint's extra state (step, scheduler, loader, RNG, configs, fingerprints): JSON plus tensors.

It is the file ``extra.safetensors`` in the checkpoint directory: the plain values as JSON in the
file's header metadata, each tensor in it (the torch RNG state) as a safetensors tensor that the
JSON names by ``{"__tensor__": key}``. Reading it parses JSON and raw tensor bytes, nothing else,
so a checkpoint from anywhere cannot run code. Tuples come back as lists; dict keys must be
strings (a value JSON cannot hold is refused when saving, naming where it sits).

Checkpoints of earlier versions kept the extra state as a pickled DCP item; they are still read,
with ``torch.load(weights_only=True)`` (tensors and plain containers only), and one holding
anything more is refused.

    write_extra_state(directory, serialize({"step": 3, "rng": {"torch": torch.get_rng_state()}}))
    extra = read_extra_state(directory)     # {"step": 3, "rng": {"torch": tensor([...], dtype=torch.uint8)}}
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.safe_read import UnsafeCheckpoint, load_dcp, load_plain, refused, stored_keys

EXTRA_FILE = "extra.safetensors"
_FORMAT = "meshflow-extra/1"
_TENSOR = "__tensor__"
_LEGACY_KEY = "extra"  # the DCP item earlier versions pickled the extra state into


def encode(extra: dict[str, Any]) -> tuple[str, dict[str, torch.Tensor]]:
    """``(JSON text, {key: tensor})`` for ``extra``; TypeError naming the entry JSON cannot hold."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensors[where] = value.detach().cpu().contiguous().clone()  # safetensors refuses shared storage
            return {_TENSOR: where}
        if isinstance(value, dict):
            for key in value:
                if not isinstance(key, str) or key == _TENSOR:
                    raise TypeError(f"checkpoint extra state: {where or 'the top level'} has the key {key!r}; "
                                    f"keys must be strings other than {_TENSOR!r}")
            return {key: walk(item, f"{where}.{key}" if where else key) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(item, f"{where}.{i}") for i, item in enumerate(value)]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"checkpoint extra state: {where} is a {type(value).__name__}; "
                        "store JSON values (dict, list, str, int, float, bool, None) and tensors only")

    if not isinstance(extra, dict):
        raise TypeError(f"checkpoint extra state must be a dict, got {type(extra).__name__}")
    return json.dumps(walk(extra, "")), tensors


def decode(text: str, tensors: dict[str, torch.Tensor]) -> Any:
    """The value :func:`encode` took apart; ValueError when the JSON names a tensor not there."""

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {_TENSOR}:
                if value[_TENSOR] not in tensors:
                    raise ValueError(f"the JSON names the tensor {value[_TENSOR]!r}, which the file does not hold")
                return tensors[value[_TENSOR]]
            return {key: walk(item) for key, item in value.items()}
        if isinstance(value, list):
            return [walk(item) for item in value]
        return value

    return walk(json.loads(text))


def serialize(extra: dict[str, Any]) -> bytes:
    """The bytes of ``extra.safetensors`` for ``extra``; TypeError naming an entry JSON cannot hold."""
    from safetensors.torch import save

    text, tensors = encode(extra)
    return save(tensors, metadata={"format": _FORMAT, "extra": text})


def write_extra_state(directory: str | Path, data: bytes) -> Path:
    """Write :func:`serialize`'s ``data`` as ``<directory>/extra.safetensors`` (flushed to disk); return its path."""
    path = Path(directory) / EXTRA_FILE
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return path


def read_extra_state(directory: str | Path) -> dict[str, Any]:
    """The extra state of the checkpoint ``directory``; :class:`CheckpointError` naming it when
    the state is missing, unreadable, or (an earlier version's pickle) more than plain data."""
    from safetensors import safe_open

    path = Path(directory) / EXTRA_FILE
    if not path.is_file():
        return _read_legacy(Path(directory))
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            header = f.metadata() or {}
            if header.get("format") != _FORMAT or "extra" not in header:
                raise ValueError(f"its header says format {header.get('format')!r}, not {_FORMAT!r}")
            extra = decode(header["extra"], {key: f.get_tensor(key) for key in f.keys()})
        if not isinstance(extra, dict):
            raise ValueError(f"it holds a {type(extra).__name__}, not a dict")
    except Exception as exc:  # noqa: BLE001 - a damaged file fails in many ways; each is reported with the path
        raise CheckpointError(f"cannot load checkpoint {str(directory)!r}: its {EXTRA_FILE} is unreadable: "
                              f"{type(exc).__name__}: {exc}", fix="use another checkpoint") from exc
    return extra


def _read_legacy(directory: Path) -> dict[str, Any]:
    """An earlier version's extra state: a DCP bytes item holding ``torch.save(extra)``."""
    if _LEGACY_KEY not in stored_keys(directory):
        raise CheckpointError(f"cannot load checkpoint {str(directory)!r}: it has no {EXTRA_FILE} (the step, "
                              "scheduler, data position and model config)", fix="use another checkpoint")
    state: dict[str, Any] = {_LEGACY_KEY: None}
    load_dcp(state, directory)  # the outer pickle (DCP's) is read with weights_only=True too
    blob = state[_LEGACY_KEY]
    try:
        if not isinstance(blob, bytes):
            raise UnsafeCheckpoint(f"its item {_LEGACY_KEY!r} is a {type(blob).__name__}, not the bytes it should be")
        extra = load_plain(blob, what=f"its item {_LEGACY_KEY!r} (an earlier version's extra state)")
        if not isinstance(extra, dict):
            raise UnsafeCheckpoint(f"its item {_LEGACY_KEY!r} holds a {type(extra).__name__}, not a dict")
    except UnsafeCheckpoint as exc:
        raise refused(directory, exc) from None
    return extra
