"""Deterministic, sharding-independent parameter initialisation.

Every parameter's initial value is a function of ``(seed, canonical FQN, full shape)`` only.
Each parameter gets its own ``torch.Generator`` seeded from a stable hash of the seed and its
FQN, so the value does not depend on construction order, on which other modules exist (a
pipeline stage holding only ``layers.2`` and ``layers.3``), or on how the parameter is sharded
(a DTensor's shard is the same block of the same full value, computed on its own without the
full tensor: :func:`initial_block`). This is what lets the same config give the same losses on
any mesh, and a model built on the meta device be initialised shard by shard.

Used by both models' ``init_weights``::

    full = init_parameter((256, 256), "layers.0.attn.wq.weight", seed=0, std=0.02)
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

import torch

InitKind = Literal["normal", "uniform", "ones", "zeros"]
# Maps a parameter FQN to how it is initialised: (kind, std).
InitRule = Callable[[str], tuple[InitKind, float]]

# Wrappers that insert a path segment without changing the model: activation checkpointing,
# torch.compile and FSDP1. The hash must see the FQN the user's config names.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def canonical_fqn(fqn: str) -> str:
    """``fqn`` with wrapper segments removed, e.g. ``layers.0._checkpoint_wrapped_module.attn.wq.weight``
    -> ``layers.0.attn.wq.weight``."""
    return ".".join(part for part in fqn.split(".") if part not in _WRAPPER_SEGMENTS)


def stable_seed(seed: int, fqn: str) -> int:
    """A 63-bit generator seed from ``(seed, fqn)``, identical in every process and Python run.

    Python's ``hash()`` is salted per process (PYTHONHASHSEED), so ranks would disagree; a
    cryptographic digest is stable and, unlike a 32-bit CRC, makes collisions irrelevant.
    """
    digest = hashlib.blake2b(f"{seed}:{canonical_fqn(fqn)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def init_parameter(
    shape: Sequence[int] | torch.Size,
    fqn: str,
    seed: int,
    std: float,
    *,
    kind: InitKind = "normal",
) -> torch.Tensor:
    """The full (unsharded) initial value of parameter ``fqn``: a CPU fp32 tensor of ``shape``.

    ``kind="normal"`` draws N(0, std) from a generator seeded by :func:`stable_seed`, ``"uniform"``
    U(-std, std) (LoRA's kaiming-uniform ``lora_A``: small, so a shard slices the full value);
    ``"ones"``/``"zeros"`` ignore ``std`` and the seed. Generation is always on CPU in fp32 so
    the values do not depend on the device or the parameter dtype.
    """
    shape = tuple(int(s) for s in shape)
    if kind == "ones":
        return torch.ones(shape, dtype=torch.float32, device="cpu")
    if kind == "zeros":
        return torch.zeros(shape, dtype=torch.float32, device="cpu")
    generator = torch.Generator(device="cpu").manual_seed(stable_seed(seed, fqn))
    if kind == "uniform":
        return torch.rand(shape, generator=generator, dtype=torch.float32, device="cpu") * (2 * std) - std
    return torch.normal(0.0, std, size=shape, generator=generator, dtype=torch.float32, device="cpu")


def local_box(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(global offset, local shape)`` of the block of the full parameter this rank holds: the
    whole tensor for a plain one, the DTensor's shard (any mix of Shard, FSDP's strided shard
    and Replicate over its mesh) otherwise."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        return (0,) * param.dim(), tuple(param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(offset), tuple(shape)


# Values are drawn in chunks of this many elements (a multiple of 16, see _normal_block).
_CHUNK = 1 << 20


def _normal_block(shape: tuple[int, ...], offset: tuple[int, ...], local: tuple[int, ...], fqn: str, seed: int,
                  std: float) -> torch.Tensor:
    """The block ``[offset, offset + local)`` of ``init_parameter(shape, fqn, seed, std)``, drawn
    without ever holding the full tensor: at most one chunk and one row of dim 0 at a time.

    Why it can: torch's CPU normal sampler fills a tensor with uniforms from the generator in
    order, then turns each aligned group of 16 into normals (Box-Muller), and when the size is
    not a multiple of 16 redraws the last 16 from 16 further uniforms. Drawing the same stream in
    pieces that are multiples of 16, the last piece holding the final 16 elements whole, gives the
    same values bit for bit (``tests/unit/test_init.py`` checks it). The stream is drawn only up to
    the last row of the block; rows before it are drawn and dropped (time, not memory).
    """
    n = math.prod(shape)
    if n < 16 or not shape:
        full = init_parameter(shape, fqn, seed, std)
        return full[tuple(slice(o, o + k) for o, k in zip(offset, local))].clone()
    row = n // shape[0]
    first, last = offset[0], offset[0] + local[0]  # rows of dim 0 this block spans
    end = last * row
    # Stop early on a group-of-16 boundary, unless the block reaches the redrawn tail.
    target = n if n - _ceil16(end) < 32 else _ceil16(end)
    inner = (slice(None),) + tuple(slice(o, o + k) for o, k in zip(offset[1:], local[1:]))
    out = torch.empty(local, dtype=torch.float32)
    generator = torch.Generator(device="cpu").manual_seed(stable_seed(seed, fqn))
    carry = torch.empty(0, dtype=torch.float32)
    pos = 0
    while pos < target:
        size = min(_CHUNK, target - pos)
        if target == n and 0 < n - (pos + size) < 16:
            size = n - pos  # the last piece must hold the redrawn tail whole
        values = torch.normal(0.0, std, size=(size,), generator=generator, dtype=torch.float32)
        buf = torch.cat([carry, values]) if carry.numel() else values
        start_row = (pos - carry.numel()) // row
        whole = buf.numel() // row
        a, b = max(start_row, first), min(start_row + whole, last)
        if a < b:
            rows = buf[: whole * row].view(whole, *shape[1:])
            out[a - first: b - first] = rows[a - start_row: b - start_row][inner]
        carry = buf[whole * row:].clone()
        pos += size
    return out


def _ceil16(n: int) -> int:
    return -(-n // 16) * 16


def initial_block(shape: Sequence[int] | torch.Size, offset: Sequence[int], local: Sequence[int], fqn: str,
                  seed: int, std: float, *, kind: InitKind = "normal") -> torch.Tensor:
    """The block at ``offset`` of shape ``local`` of :func:`init_parameter`'s value (a CPU fp32
    tensor), computed without the full tensor."""
    shape, offset, local = (tuple(int(s) for s in x) for x in (shape, offset, local))
    if kind == "ones":
        return torch.ones(local, dtype=torch.float32)
    if kind == "zeros":
        return torch.zeros(local, dtype=torch.float32)
    if any(k == 0 for k in local):
        return torch.empty(local, dtype=torch.float32)
    if kind == "uniform":
        full = init_parameter(shape, fqn, seed, std, kind=kind)
        return full[tuple(slice(o, o + k) for o, k in zip(offset, local))].clone()
    return _normal_block(shape, offset, local, fqn, seed, std)


def init_parameter_into(param: torch.Tensor, fqn: str, seed: int, std: float, *, kind: InitKind = "normal") -> None:
    """Fill ``param`` (plain or DTensor, on any device) with its share of the initial value of
    ``fqn``: the same numbers :func:`init_parameter` gives the full tensor, but only this rank's
    block is ever computed, so a sharded parameter is never held whole."""
    offset, local = local_box(param)
    target = _local(param)
    if tuple(target.shape) != local:
        raise ValueError(f"{fqn}: local shard {tuple(target.shape)} is not the block {local} its placements give")
    with torch.no_grad():
        target.copy_(initial_block(param.shape, offset, local, fqn, seed, std, kind=kind))


def _local(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


def init_named_parameters(
    named_params: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    seed: int,
    rule: InitRule,
) -> None:
    """Initialise each ``(fqn, param)`` in sorted FQN order; ``rule(fqn) -> (kind, std)`` picks how.

    Sorting is not needed for correctness (each parameter has its own generator) but keeps the
    order reproducible for anyone stepping through it.
    """
    items = dict(named_params)
    for fqn in sorted(items):
        param = items[fqn]
        kind, std = rule(fqn)
        init_parameter_into(param, fqn, seed, std, kind=kind)
