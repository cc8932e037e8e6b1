"""ZeRO-1: the optimizer's state sharded over the data-parallel axes; parameters and gradients stay whole
on every rank (Megatron-LM's distributed optimizer, DeepSpeed's stage 1, PaddlePaddle's
``shard_optimizer(opt, ShardingStage1)``).

    apply_data_parallel(model, mesh, mode="zero1", dim_names=["dp"])   # replicated, as ddp
    optimizer = shard_optimizer_state(torch.optim.AdamW(model.parameters()), dim_names=["dp"])

The model is wrapped as ``ddp`` is (FSDP2's ``replicate``: ``Replicate`` DTensors on the dp axis, gradients
averaged by an all-reduce in backward). The optimizer is torch's own, left whole (its hyper-parameters, its
``state_dict`` and the schedule's ``param_groups`` are untouched); two step hooks make it step on shards:

* before ``step``, each parameter is swapped in ``param_groups`` for its dp shard: a DTensor whose dp
  placement is ``Shard(d)`` instead of ``Replicate`` (``redistribute``: a local slice, no communication),
  its gradient the same slice of the (already averaged) gradient; the parameter's state moves to it. On the
  first step AdamW creates its moments ``zeros_like`` the shard, so each rank holds 1 / dp of them;
* after ``step``, every updated shard is redistributed back to the parameter's placements (an all-gather over
  dp, DTensor's) into the parameter, and the state moves back under the parameter.

Why this and not the other building blocks torch has:

* FSDP2 ``fully_shard(reshard_after_forward=False)`` shards the parameters and gradients between steps as
  well (that is ``zero2`` here): ZeRO-1 keeps them whole, which is what lets it skip the per-micro-batch
  reduce-scatter and the gather before every forward.
* ``ZeroRedundancyOptimizer`` assigns *whole parameters* to ranks (an uneven share on a model whose embedding
  dominates), broadcasts plain tensors (not DTensors: no tensor parallelism beside it) and its
  ``state_dict`` needs a consolidation onto one rank, which DCP's ``get_state_dict`` does not drive.

Here every moment is a DTensor with an exact 1 / dp share of each parameter (uneven sizes as ``torch.chunk``
cuts them), so DCP saves and loads it as it does FSDP2's state, and a checkpoint resumes on any other mesh
and mode. The update is elementwise, so the shards' values are bit for bit a whole AdamW's.

The shard dim is the first tensor dim no other mesh axis already shards (a column-parallel weight's dim 1, a
row-parallel one's dim 0), so the slice is local; a tensor with no such dim (a 1-D column-parallel bias) keeps
its state whole. Communication per step: the all-reduce of gradients (as ddp) and one all-gather of the
parameters, (n-1)/n of them each way: 3 (n-1)/n of the parameters in all, one collective per parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement


def shard_placements(param: DTensor, dim_names: Sequence[str]) -> tuple[Placement, ...] | None:
    """``param``'s placements with its data-parallel mesh axis (one of ``dim_names``, or those axes
    flattened into one) as ``Shard(d)`` on the first tensor dim no other axis shards; ``None`` when
    ``param`` has no replicated dp axis or no free tensor dim (its state then stays whole)."""
    names = list(param.device_mesh.mesh_dim_names or ())
    axis = next((names.index(n) for n in (*dim_names, "_".join(dim_names)) if n in names), None)
    if axis is None or not isinstance(param.placements[axis], Replicate):
        return None
    taken = {p.dim for p in param.placements if isinstance(p, Shard)}
    dim = next((d for d in range(param.ndim) if d not in taken), None)
    if dim is None:
        return None
    return (*param.placements[:axis], Shard(dim), *param.placements[axis + 1:])


class _ShardedSteps:
    """The pre- and post-step hooks of one optimizer (see the module docstring)."""

    def __init__(self, dim_names: Sequence[str]) -> None:
        self.dim_names = list(dim_names)
        self.swapped: list[tuple[dict[str, Any], int, DTensor, DTensor]] = []  # (group, index, parameter, its shard)

    def to_shards(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        for group in optimizer.param_groups:
            for index, param in enumerate(group["params"]):
                if not isinstance(param, DTensor) or param.grad is None:
                    continue  # no gradient: AdamW leaves it (and its state) alone
                placements = shard_placements(param, self.dim_names)
                if placements is None:
                    continue
                shard = cast(DTensor, param.detach()).redistribute(param.device_mesh, placements)
                shard.grad = cast(DTensor, param.grad).redistribute(param.device_mesh, placements)
                if param in optimizer.state:
                    optimizer.state[shard] = optimizer.state.pop(param)
                group["params"][index] = shard
                self.swapped.append((group, index, param, shard))

    @torch.no_grad()
    def to_params(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        swapped, self.swapped = self.swapped, []
        for group, index, param, shard in swapped:
            param.copy_(shard.redistribute(param.device_mesh, param.placements))  # the all-gather over dp
            if shard in optimizer.state:
                optimizer.state[param] = optimizer.state.pop(shard)
            group["params"][index] = param


def shard_optimizer_state(optimizer: torch.optim.Optimizer, *, dim_names: Sequence[str]) -> torch.optim.Optimizer:
    """Make ``optimizer`` (over parameters replicated on the mesh axes ``dim_names``) keep each rank's
    1 / dp share of its state and update only that share, gathering the updated parameters after each
    step; returns it (modified in place, still the same optimizer class)."""
    steps = _ShardedSteps(dim_names)
    optimizer.register_step_pre_hook(steps.to_shards)
    optimizer.register_step_post_hook(steps.to_params)
    return optimizer


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of optimizer state this rank holds (each DTensor's local shard; scalar step counts too)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if isinstance(value, DTensor) else value
                total += local.numel() * local.element_size()
    return total
