"""Deterministic, sharding-independent parameter initialisation.

Every parameter's initial value is a function of ``(seed, canonical FQN, full shape)`` only.
Each parameter gets its own ``torch.Generator`` seeded from a stable hash of the seed and its
FQN, so the value does not depend on construction order, on which other modules exist (a
pipeline stage holding only ``layers.2`` and ``layers.3``), or on how the parameter is sharded
(a DTensor is filled from the same full tensor, then sliced locally). This is what lets the
same config give the same losses on any mesh.

Used by both models' ``init_weights``::

    full = init_parameter((256, 256), "layers.0.attn.wq.weight", seed=0, std=0.02)
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Literal

import torch

InitKind = Literal["normal", "ones", "zeros"]
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

    ``kind="normal"`` draws N(0, std) from a generator seeded by :func:`stable_seed`;
    ``"ones"``/``"zeros"`` ignore ``std`` and the seed. Generation is always on CPU in fp32 so
    the values do not depend on the device or the parameter dtype.
    """
    shape = tuple(int(s) for s in shape)
    if kind == "ones":
        return torch.ones(shape, dtype=torch.float32, device="cpu")
    if kind == "zeros":
        return torch.zeros(shape, dtype=torch.float32, device="cpu")
    generator = torch.Generator(device="cpu").manual_seed(stable_seed(seed, fqn))
    return torch.normal(0.0, std, size=shape, generator=generator, dtype=torch.float32, device="cpu")


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full value ``full`` into ``param``, which may be a plain tensor or a DTensor.

    For a DTensor (tensor parallel, FSDP2) every rank generated the same ``full``, so each one
    slices its own shard locally (``src_data_rank=None``: no communication).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(param, DTensor):
            local = distribute_tensor(
                full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None
            ).to_local()
            param.to_local().copy_(local)
        else:
            if tuple(param.shape) != tuple(full.shape):
                raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs initial value {tuple(full.shape)}")
            param.copy_(full)


def init_named_parameters(
    named_params: Sequence[tuple[str, torch.Tensor]] | dict[str, torch.Tensor],
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
        copy_full_into(param, init_parameter(param.shape, fqn, seed, std, kind=kind))
