"""The transfer plan of a mesh-to-mesh reshard: who sends which box of a tensor to whom.

Pure arithmetic on shapes and rank ids, no process group: :func:`parallel.reshard.transfer.reshard` runs
the plan, the unit tests check it, the benchmark reports its bytes. A layout is a mesh of global
rank ids (any shape, any order, any subset of the world) plus one DTensor placement per mesh axis::

    src = MeshLayout([[0, 1], [2, 3]], (Shard(0), Replicate()))
    dst = MeshLayout([4, 5, 6, 7], (Shard(1),))
    plan = plan_reshard(global_shape=(8, 6), src=src, dst=dst, itemsize=4)
    plan.bytes_moved == minimum_bytes(global_shape=(8, 6), src=src, dst=dst, itemsize=4)   # True

Shard sizes and offsets are DTensor's own (torch.chunk-like, later shards smaller or empty;
several mesh axes on one tensor dim nest in mesh-axis order), taken from torch's helper.

Partial (sum) on the source: the value is the sum of one *contribution* per partial index (the
coordinates on the Partial axes); the destination receives every contribution of its region and
adds them. Partial on the destination: in each group of ranks that differ only on the Partial axes,
the rank at coordinate 0 of those axes holds the value and the others hold zeros. (DTensor's own
Replicate -> Partial divides the value by the group size instead; zeros keep integer values exact
and cost no traffic.)

The minimum the plan reaches (:func:`minimum_bytes`): each destination rank that holds a value
needs ``num_contributions x |its region|`` elements (``num_contributions`` = 1 without Partial
source), of which it already holds the piece of its own source contribution that falls in its
region; the rest must arrive from other ranks. That is the least any one-hop plan (senders are
holders, no reduction on the way) can move. A two-hop plan that first reduces Partial
contributions on the source side can move less when many destination ranks need the same region;
this plan does not.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement


@dataclass(frozen=True)
class MeshLayout:
    """A tensor's layout: a mesh of global rank ids and one placement per mesh axis.

    Args:
        ranks: global rank ids shaped like the mesh (nested lists or a tensor), outermost axis
            first, e.g. ``[[2, 4, 5], [0, 1, 3]]`` for a 2 x 3 mesh; a rank appears at most once.
        placements: one ``Shard(d)``, ``Replicate()`` or ``Partial()`` (sum) per mesh axis.

    Example::

        MeshLayout([[0, 1], [2, 3]], (Shard(0), Partial()))
    """

    ranks: Any
    placements: tuple[Placement, ...]
    mesh_shape: tuple[int, ...] = field(init=False)
    flat_ranks: tuple[int, ...] = field(init=False)  # row-major, position i has coordinate unravel(i)

    def __post_init__(self) -> None:
        rank_tensor = torch.as_tensor(self.ranks, dtype=torch.long)
        flat_ranks = tuple(int(r) for r in rank_tensor.flatten().tolist())
        placements = tuple(self.placements)
        if rank_tensor.dim() == 0 or not flat_ranks:
            raise ValueError(f"MeshLayout needs a non-empty mesh of rank ids, got {self.ranks!r}")
        if len(set(flat_ranks)) != len(flat_ranks):
            raise ValueError(f"MeshLayout ranks {self.ranks!r} repeat a rank id")
        if len(placements) != rank_tensor.dim():
            raise ValueError(f"{len(placements)} placements for a {rank_tensor.dim()}-D mesh "
                             f"{tuple(rank_tensor.shape)}")
        for placement in placements:
            # Exact types: _StridedShard and _MaskPartial carry state this plan does not model.
            if type(placement) not in (Shard, Replicate, Partial):
                raise ValueError(f"placement {placement!r} is not Shard(d), Replicate() or Partial()")
            if isinstance(placement, Partial) and placement.reduce_op != "sum":
                raise ValueError(f"only Partial('sum') can be resharded, got {placement!r}")
        # Nested tuples keep the layout hashable, so plans can be cached by layout.
        object.__setattr__(self, "ranks", _nested_tuple(rank_tensor.tolist()))
        object.__setattr__(self, "placements", placements)
        object.__setattr__(self, "mesh_shape", tuple(rank_tensor.shape))
        object.__setattr__(self, "flat_ranks", flat_ranks)

    @classmethod
    def from_device_mesh(cls, mesh: DeviceMesh, placements: Sequence[Placement]) -> MeshLayout:
        """The layout of a DTensor on ``mesh`` (a ``DeviceMesh``) with ``placements``."""
        return cls(mesh.mesh.tolist(), tuple(placements))

    def coordinates(self) -> list[tuple[int, ...]]:
        """Mesh coordinate of each position of :attr:`flat_ranks`."""
        return list(itertools.product(*(range(n) for n in self.mesh_shape)))

    def axes_of(self, kind: type) -> tuple[int, ...]:
        return tuple(axis for axis, p in enumerate(self.placements) if isinstance(p, kind))

    def __repr__(self) -> str:
        nested_ranks = torch.tensor(self.flat_ranks).reshape(self.mesh_shape).tolist()
        return f"MeshLayout({nested_ranks}, {list(self.placements)})"


def _nested_tuple(value: Any) -> Any:
    return tuple(_nested_tuple(v) for v in value) if isinstance(value, list) else value


@dataclass(frozen=True)
class Box:
    """A rectangular region of the global tensor: ``offset`` and ``shape`` per dim."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def intersect(self, other: Box) -> Box:
        starts = tuple(max(a, b) for a, b in zip(self.offset, other.offset, strict=True))
        stops = tuple(min(a + n, b + m) for a, n, b,
                      m in zip(self.offset, self.shape, other.offset, other.shape, strict=True))
        return Box(starts, tuple(max(0, stop - start) for start, stop in zip(starts, stops, strict=True)))

    def slices_within(self, outer: Box) -> tuple[slice, ...]:
        """Index of this box inside a tensor that holds ``outer``."""
        return tuple(slice(a - o, a - o + n) for a, o, n in zip(self.offset, outer.offset, self.shape, strict=True))


@dataclass(frozen=True)
class Transfer:
    """One piece of the plan: ``src_rank`` gives ``box`` (global coordinates) to ``dst_rank``.
    ``src_rank == dst_rank`` is a local copy, which moves no bytes."""

    src_rank: int
    dst_rank: int
    box: Box
    num_bytes: int

    @property
    def is_local(self) -> bool:
        return self.src_rank == self.dst_rank


@dataclass(frozen=True)
class ReshardPlan:
    """Every transfer of one reshard, grouped by destination rank in ``dst.flat_ranks`` order.

    ``dst_boxes`` maps each destination rank to the region it holds; ``value_holders`` are the
    destination ranks that get the value (all of them unless ``dst`` has Partial axes, whose
    other ranks get zeros). ``sum_contributions``: the source is Partial, pieces are added."""

    transfers: tuple[Transfer, ...]
    src_boxes: dict[int, Box]
    dst_boxes: dict[int, Box]
    value_holders: frozenset[int]
    sum_contributions: bool

    @property
    def bytes_moved(self) -> int:
        return sum(t.num_bytes for t in self.transfers if not t.is_local)

    def bytes_sent_by(self, rank: int) -> int:
        return sum(t.num_bytes for t in self.transfers if t.src_rank == rank and not t.is_local)

    def bytes_received_by(self, rank: int) -> int:
        return sum(t.num_bytes for t in self.transfers if t.dst_rank == rank and not t.is_local)


def layout_boxes(global_shape: Sequence[int], layout: MeshLayout) -> dict[int, Box]:
    """The region of the global tensor each rank of ``layout`` holds (whole tensor along
    Replicate and Partial axes), computed by DTensor's own helper so uneven and nested shards
    match DTensor exactly."""
    shape = tuple(global_shape)
    # The public compute_local_shape_and_global_offset needs a DeviceMesh holding the calling rank;
    # a plan is made for every rank of meshes this process may not belong to, so it calls the
    # plain-data helper behind it (same code, mesh shape and coordinate given explicitly).
    boxes = {}
    for rank, coordinate in zip(layout.flat_ranks, layout.coordinates(), strict=True):
        local_shape, offset = _compute_local_shape_and_global_offset(shape, layout.mesh_shape, list(coordinate),
                                                                     layout.placements)
        boxes[rank] = Box(tuple(offset), tuple(local_shape))
    return boxes


def _check_dims(global_shape: Sequence[int], layout: MeshLayout) -> MeshLayout:
    """The layout with negative Shard dims counted from the end; out-of-range dims refused."""
    ndim = len(global_shape)
    placements = []
    for placement in layout.placements:
        if isinstance(placement, Shard):
            if not -ndim <= placement.dim < ndim:
                raise ValueError(f"{placement!r} in {layout!r} does not fit a {ndim}-D tensor of shape "
                                 f"{tuple(global_shape)}")
            placement = Shard(placement.dim % ndim)
        placements.append(placement)
    return MeshLayout(layout.ranks, tuple(placements))


def minimum_bytes(*, global_shape: Sequence[int], src: MeshLayout, dst: MeshLayout, itemsize: int) -> int:
    """The analytic minimum of bytes a one-hop reshard moves (see the module docstring),
    computed without the plan's choice of senders."""
    src, dst = _check_dims(global_shape, src), _check_dims(global_shape, dst)
    src_boxes, dst_boxes = layout_boxes(global_shape, src), layout_boxes(global_shape, dst)
    num_contributions = math.prod(src.mesh_shape[axis] for axis in src.axes_of(Partial))
    total = 0
    for rank in _value_holders(dst):
        needed = dst_boxes[rank]
        held = needed.intersect(src_boxes[rank]).numel if rank in src_boxes else 0
        total += num_contributions * needed.numel - held
    return total * itemsize


def _value_holders(dst: MeshLayout) -> list[int]:
    partial_axes = dst.axes_of(Partial)
    return [rank for rank, coordinate in zip(dst.flat_ranks, dst.coordinates(), strict=True)
            if all(coordinate[axis] == 0 for axis in partial_axes)]


def plan_reshard(*, global_shape: Sequence[int], src: MeshLayout, dst: MeshLayout, itemsize: int) -> ReshardPlan:
    """The transfers that turn ``(src mesh, src placements)`` into ``(dst mesh, dst placements)``
    for a tensor of ``global_shape`` with ``itemsize`` bytes per element.

    A destination rank takes locally whatever it holds in ``src``; every other piece comes from
    the least-loaded of its holders (replicas along Replicate axes), so copies spread the sending.
    Cached: a pipeline boundary reshards the same activation shape every micro-batch."""
    return _plan_cached(tuple(int(n) for n in global_shape), src, dst, int(itemsize))


@functools.lru_cache(maxsize=256)
def _plan_cached(global_shape: tuple[int, ...], src: MeshLayout, dst: MeshLayout, itemsize: int) -> ReshardPlan:
    src, dst = _check_dims(global_shape, src), _check_dims(global_shape, dst)
    src_boxes, dst_boxes = layout_boxes(global_shape, src), layout_boxes(global_shape, dst)
    # A source piece is identified by its coordinates on the Shard axes (which region) and the
    # Partial axes (which contribution); ranks differing only on Replicate axes hold the same piece.
    piece_axes = src.axes_of(Shard) + src.axes_of(Partial)
    holders: dict[tuple[int, ...], list[int]] = {}
    for rank, coordinate in zip(src.flat_ranks, src.coordinates(), strict=True):
        if src_boxes[rank].numel:
            holders.setdefault(tuple(coordinate[axis] for axis in piece_axes), []).append(rank)
    pieces = sorted(holders.items())  # fixed order: sender and receiver pack one buffer the same way
    bytes_sent = dict.fromkeys(src.flat_ranks, 0)
    transfers = []
    value_holders = _value_holders(dst)
    for dst_rank in value_holders:
        needed = dst_boxes[dst_rank]
        for _, piece_holders in pieces:
            overlap = needed.intersect(src_boxes[piece_holders[0]])
            if not overlap.numel:
                continue
            num_bytes = overlap.numel * itemsize
            if dst_rank in piece_holders:
                sender = dst_rank
            else:
                sender = min(piece_holders, key=lambda rank: bytes_sent[rank])  # ties: first in mesh order
                bytes_sent[sender] += num_bytes
            transfers.append(Transfer(sender, dst_rank, overlap, num_bytes))
    return ReshardPlan(tuple(transfers), src_boxes, dst_boxes, frozenset(value_holders), bool(src.axes_of(Partial)))
