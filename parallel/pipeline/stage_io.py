"""How an activation crosses the boundary between two stages with layouts of their own.

Each stage's ranks are numbered row-major; the ``i``-th rank of every stage forms lane ``i``
(:mod:`parallel.plan.stages`). Between stages an activation travels along the lanes as its
*transfer layout*: lane ``i`` holds the ``i``-th of ``k`` row blocks of the micro-batch
(``Shard(0)`` over the stage's ranks in lane order). Inside a stage the activation has the
stage's own layout: split over the batch on its data-parallel and expert-parallel axes, over the
sequence on its context-parallel axis (each cp rank its load-balanced head and tail chunks of every
row: the sequence is reordered by :func:`cp_order` so that ``Shard(1)`` is that split), whole on the
others (tensor-parallel ranks all see the same rows).

A stage converts on the way in and out with one DTensor redistribution on its own mesh
(:func:`attach_boundaries`): ``Shard(0)`` on every axis, which is the transfer layout, to
``Shard(0)`` on the data-parallel axes and ``Replicate`` elsewhere (an all-gather over the
other axes), and back (a local slice). So OneFlow's data-parallel stage 0 -> model-parallel stage 1
moves each row block once to its lane's stage-1 rank, and stage 1's all-gather gives every
tensor-parallel rank the whole micro-batch: the minimum traffic (every stage-1 rank receives the
micro-batch once). Autograd runs the same steps backwards (a slice, and an all-gather of the
gradients), so gradients are split back the same way.

A cp stage's way in is an all-to-all over its cp ranks (``Shard(0)`` -> ``Shard(1)``), each token
moved once; its way out the inverse, and its backward both the other way round, so no gradient is
summed or lost.

Gradients: lane ``i``'s loss is the mean over its rows; the engine divides it by ``k`` so that every
activation gradient that crosses a boundary is that of the micro-batch's mean loss. Inside a
stage each data-parallel rank's parameter gradients cover its rows only (a cp rank's: its tokens) and
must be summed, but FSDP2 and replicate average over the ``d`` ranks of the dp, ep and cp axes (and
gloo has no pre-scaled sum to make them sum); the experts' gradients are divided by the ep size for
the same reason: so the gradient entering a stage's output is multiplied by ``d`` and the one
leaving its input divided by ``d`` again (:class:`_ScaleGrad`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from parallel.context.layout import token_index


def lane_groups(stage_ranks: Sequence[Sequence[int]]) -> list[tuple[list[int], dist.ProcessGroup]]:
    """``[(the lane's ranks in stage order, its process group)]`` for every lane. A collective:
    every rank of the world calls it (``new_group`` is)."""
    lanes = []
    for lane in zip(*stage_ranks):
        lanes.append((list(lane), dist.new_group(sorted(lane))))
    return lanes


def stage_to_group_rank(lane: Sequence[int]) -> dict[int, int]:
    """Stage index -> the lane group's rank of its holder (a group numbers its members in
    increasing global rank, which need not be stage order)."""
    order = sorted(lane)
    return {stage: order.index(rank) for stage, rank in enumerate(lane)}


def stage_placements(mesh: DeviceMesh, dp_axes: Sequence[str], cp_axis: str | None = None) -> list[Placement]:
    """The layout of an activation inside a stage: split by rows over its data-parallel (and expert-parallel)
    axes, by tokens over its cp axis (``Shard(1)`` of the sequence in :func:`cp_order`), whole over the others."""
    assert mesh.mesh_dim_names is not None, "the engine's meshes name their axes"
    return [Shard(0) if name in dp_axes else Shard(1) if name == cp_axis else Replicate()
            for name in mesh.mesh_dim_names]


def cp_order(seq_len: int, cp_size: int, device: torch.device) -> torch.Tensor:
    """The sequence's tokens reordered so that ``Shard(1)`` over ``cp_size`` ranks gives cp rank ``r`` its
    load-balanced head and tail chunks (:func:`parallel.context.token_index`), in that order."""
    return torch.cat([token_index(seq_len, cp_rank=r, cp_size=cp_size) for r in range(cp_size)]).to(device)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient multiplied by ``factor`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def attach_boundaries(part: nn.Module, mesh: DeviceMesh, *, dp_axes: Sequence[str], cp_axis: str | None = None) -> None:
    """Hooks on a stage module: its input arrives in the transfer layout (on the first stage: the
    lane's rows of the batch, as the data loader gives them) and becomes the stage's own; its
    output goes back to the transfer layout, for the next stage or for the loss on the lane's
    rows of the targets. ``dp_axes``: the axes that split the stage's rows (data and expert parallel);
    ``cp_axis``: the one that splits its sequences (context parallel), whose ranks see the tokens of
    :func:`cp_order`'s split: the sequence is reordered before the redistribution and put back after."""
    transfer = [Shard(0)] * mesh.ndim
    inside = stage_placements(mesh, dp_axes, cp_axis)
    dim_names = mesh.mesh_dim_names
    assert dim_names is not None, "the engine's meshes name their axes"
    split_axes = [*dp_axes, *([cp_axis] if cp_axis else [])]  # FSDP averages gradients over these
    dp_size = math.prod(mesh.size(dim_names.index(name)) for name in split_axes)
    cp_size = mesh.size(dim_names.index(cp_axis)) if cp_axis else 1

    def to_stage(_mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x, *rest = args
        if not isinstance(x, torch.Tensor):
            return args
        if cp_size > 1:
            x = x.index_select(1, cp_order(x.shape[1], cp_size, x.device))
        if transfer != inside:
            x = DTensor.from_local(x, mesh, transfer, run_check=False).redistribute(mesh, inside).to_local()
        if dp_size > 1 and x.requires_grad:
            x = _ScaleGrad.apply(x, 1.0 / dp_size)  # type: ignore[no-untyped-call]  # torch: untyped
        return (x, *rest)

    def to_transfer(_mod: nn.Module, _args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        if isinstance(out, DTensor):  # a stage output left as a DTensor (on its own, e.g. tp, mesh): made whole
            out = out.redistribute(out.device_mesh, [Replicate()] * out.device_mesh.ndim).to_local()
        if dp_size > 1 and out.requires_grad:
            out = _ScaleGrad.apply(out, float(dp_size))  # type: ignore[no-untyped-call]  # torch: untyped
        if transfer != inside:
            out = DTensor.from_local(out, mesh, inside, run_check=False).redistribute(mesh, transfer).to_local()
        if cp_size > 1:
            out = out.index_select(1, cp_order(out.shape[1], cp_size, out.device).argsort())
        return out

    # First in, last out: tensor parallelism's own hooks on the stage module (a raw-parameter stage's
    # input made a Replicate DTensor, its output made whole) must see the stage's layout.
    part.register_forward_pre_hook(to_stage, prepend=True)
    part.register_forward_hook(to_transfer)
