"""Expert parallelism: a module of stacked experts split ``Shard(0)`` over one mesh axis, each expert's
rows sent to the rank holding it and brought back by all-to-all.

    apply_expert_parallel(model, mesh, axis="ep", module_fqns=["layers.0.mlp.experts", ...])

The module's contract (the built-in :class:`trainer.models.moe.GroupedExperts`): every parameter is
``[num_experts, ...]``, and ``forward(x, counts)`` takes rows sorted by expert, ``counts[e]`` rows for
expert ``e``, and returns one row per row. Sharded here, it computes its own experts only, so around
its forward:

* **dispatch** (a forward pre-hook): the counts go to every rank by one all-to-all of ``n * E_local``
  integers; the rows by an all-to-all with variable splits (each rank sends each other rank the rows
  of that rank's experts), then arrive grouped by source rank and are regrouped by local expert;
* **combine** (a forward hook): the inverse regrouping, and the reverse all-to-all.

The row all-to-alls are torch's autograd-aware functional collective (``all_to_all_single_autograd``),
whose backward is the all-to-all with the splits swapped, so gradients reach the tokens' ranks. The
counts travel by plain ``all_to_all_single``: integers, no gradient; ranks need them before the rows
(DTensor has no placement for "each rank's rows of its experts", hence the hand-written dispatch).

Every rank of the axis holds its own rows of the batch (the axis splits the batch like a
data-parallel one), so an expert's gradient sums the contributions of every rank's loss; the
losses are per-rank means, so the gradient is divided by the axis size: by FSDP2's gradient divide
factor where data parallelism wraps the experts (:mod:`parallel.sharding.data_parallel`), else by a
hook on the parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

from parallel.mesh import submesh


def apply_expert_parallel(module: nn.Module, mesh: DeviceMesh, *, axis: str,
                          module_fqns: Sequence[str]) -> list[nn.Module]:
    """Split each module of ``module_fqns`` found in ``module`` (a pipeline stage may hold some)
    ``Shard(0)`` over the mesh axis ``axis`` and route its rows there and back; returns the modules.
    Their gradients still want dividing by the axis size: by data parallelism, or
    :func:`divide_expert_grads`."""
    ep_mesh = submesh(mesh, axis)
    size = ep_mesh.size()
    modules = dict(module.named_modules())
    done = []
    for fqn in module_fqns:
        if fqn not in modules:
            continue
        experts = modules[fqn]
        for name, param in experts.named_parameters():
            if param.shape[0] % size:
                raise ValueError(f"{fqn}.{name}: {param.shape[0]} experts do not split over {axis} size {size}")
        dispatch = _Dispatch(ep_mesh)
        # torch types input_fn and output_fn as returning None, but uses what they return (new inputs, output).
        distribute_module(experts, ep_mesh, _shard_dim0, dispatch.send, dispatch.bring_back)  # type: ignore[arg-type]
        done.append(experts)
    return done


def divide_expert_grads(experts: Sequence[nn.Module], size: int) -> None:
    """Divide the experts' gradients by ``size`` (the expert-parallel axis's) as autograd computes them,
    where no data parallelism wraps the experts to do it. Hooks on the parameters as they will train:
    registered after the module is materialised (``to_empty`` swaps a DTensor parameter's tensor, and
    its hooks with it)."""
    if size > 1:
        for unit in experts:
            for param in unit.parameters():
                param.register_hook(lambda grad, n=size: grad / n)  # type: ignore[no-untyped-call]  # torch: untyped


def _shard_dim0(_name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for pname, param in list(module.named_parameters(recurse=False)):
        dt = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=None)
        module.register_parameter(pname, nn.Parameter(dt, requires_grad=param.requires_grad))


class _Dispatch:
    """One experts module's all-to-all: :meth:`send` before its forward, :meth:`bring_back` after it;
    what the second needs of the first (splits, the regrouping) is kept between the two (a forward
    runs whole before the next one starts, activation checkpointing's recompute included)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.group = mesh.get_group()
        self.size = mesh.size()
        self.pending: dict[str, Any] = {}

    def send(self, _module: nn.Module, inputs: tuple[Any, ...], _mesh: DeviceMesh) -> tuple[Any, ...]:
        x, counts = inputs[0], inputs[1]
        per_rank = counts.shape[0] // self.size
        sent = counts.view(self.size, per_rank)  # [destination rank, its local expert]
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=self.group)  # [source rank, my local expert]
        input_splits, output_splits = sent.sum(dim=1).tolist(), received.sum(dim=1).tolist()
        rows = all_to_all_single_autograd(x.contiguous(), output_splits, input_splits, self.group)
        regroup = _by_expert(received)
        self.pending = {"splits": (input_splits, output_splits), "regroup": regroup}
        return (rows[regroup], received.sum(dim=0), *inputs[2:])

    def bring_back(self, _module: nn.Module, output: torch.Tensor, _mesh: DeviceMesh) -> torch.Tensor:
        input_splits, output_splits = self.pending["splits"]
        by_source = output[self.pending["regroup"].argsort()]
        self.pending = {}
        return all_to_all_single_autograd(by_source.contiguous(), input_splits, output_splits, self.group)


def _by_expert(received: torch.Tensor) -> torch.Tensor:
    """Row indices regrouping rows that arrived ordered by (source rank, local expert), ``received[s, e]``
    rows per segment, into (local expert, source rank) order: each expert's rows together, and within
    an expert the sources in rank order (on one device: the batch's token order)."""
    sizes = received.flatten()
    starts = torch.cumsum(sizes, dim=0) - sizes  # where each (source, expert) segment begins
    by_expert = torch.arange(sizes.numel(), device=sizes.device).view(received.shape).T.flatten()
    sizes, starts = sizes[by_expert], starts[by_expert]
    out_starts = torch.cumsum(sizes, dim=0) - sizes
    total = int(sizes.sum())
    return torch.repeat_interleave(starts - out_starts, sizes, output_size=total) + torch.arange(total,
                                                                                                 device=sizes.device)


__all__ = ["apply_expert_parallel"]
