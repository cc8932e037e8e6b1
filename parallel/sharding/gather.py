"""A model's full weights on rank 0, from any layout, over the process group (no file is read).

    state = full_state_on_rank0(merged_module(pm.model_parts))   # {fqn: CPU tensor} on rank 0, None elsewhere

Each rank takes its part's state dict with torch's state-dict helper (``get_model_state_dict``:
the model's own names, compile and activation-checkpointing wrappers left out). Every DTensor is
made whole by the ranks of its mesh together, one tensor at a time and offloaded to the CPU at
once, so a device never holds more than one whole tensor beyond the model. The lowest rank holding
a name owns it; the owners other than rank 0 (a pipeline's later stages) send theirs to rank 0 as
raw bytes, point to point. So it works on every layout (dp, FSDP, HSDP, tp, pp and per-stage
meshes, cp, ep) and whether or not the nodes share a disk.

Why not ``StateDictOptions(full_state_dict=True, cpu_offload=True)`` alone: with ``cpu_offload``
torch keeps the gathered tensors on global rank 0 only, so a pipeline stage rank 0 does not hold
would be dropped; without it every rank keeps its whole stage on its device.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor


def full_state_on_rank0(module: nn.Module) -> dict[str, torch.Tensor] | None:
    """``module``'s whole tensors by name, on the CPU of rank 0 (every tensor of every rank's part);
    None on the other ranks. A collective: every rank calls it, each with its own part. Without a
    process group: the module's own tensors, on the CPU."""
    # a module's state: tensors (DTensor shards under FSDP, tp, ep), nothing nested
    local = cast(dict[str, torch.Tensor], get_model_state_dict(module, options=StateDictOptions()))
    if not (dist.is_available() and dist.is_initialized()):
        return {name: _whole(value).cpu() for name, value in local.items()}
    rank, world = dist.get_rank(), dist.get_world_size()
    held: list[list[str] | None] = [None] * world
    dist.all_gather_object(held, list(local))
    owner: dict[str, int] = {}
    for holder, names in enumerate(held):
        for name in names or []:
            owner.setdefault(name, holder)
    mine = {}
    for name, value in local.items():  # the ranks of a DTensor's mesh hold the same part: same names, same order
        whole = _whole(value)
        if owner[name] == rank:
            mine[name] = whole.cpu()
        del whole
    return _to_rank0(mine, rank, world)


def _whole(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor().detach() if isinstance(value, DTensor) else value.detach()


def _to_rank0(mine: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor] | None:
    """Every owner's tensors at rank 0: each sent as its bytes (any dtype, on gloo and NCCL alike)."""
    shapes = [(name, tuple(t.shape), t.dtype) for name, t in mine.items()]
    everyone: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(shapes, everyone, dst=0)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    if rank != 0:
        for tensor in mine.values():
            if tensor.numel():
                dist.send(_bytes_of(tensor).to(device), dst=0)
        return None
    state = dict(mine)
    for source in range(1, world):
        for name, shape, dtype in everyone[source]:  # type: ignore[index]
            empty = torch.empty(shape, dtype=dtype)
            if empty.numel():
                buffer = torch.empty(empty.numel() * empty.element_size(), dtype=torch.uint8, device=device)
                dist.recv(buffer, src=source)
                empty = buffer.cpu().view(dtype).reshape(shape)
            state[name] = empty
    return state


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)
