"""Which rank holds which slice of every parameter: the plan's placements as arithmetic.

From a resolved :class:`~parallel.plan.spec.ParallelPlan` and the model's parameter shapes (a meta
model is enough), no process group: for every parameter and every rank of the world, the
``[start, stop)`` range per tensor dim of the global tensor that rank's local shard covers, or
nothing where another pipeline stage holds the parameter. It includes what the engine does
beyond the config's placements: FSDP / zero2 / hsdp shard dim 0 over the (flattened) sharding dp
axes in torch.chunk style (the last ranks may get less, or an empty shard), and where tensor
parallelism already splits dim 0 FSDP splits each tp shard (torch's ``_StridedShard``). The
ranges come from DTensor's own local-shape/offset arithmetic, fed each rank's mesh coordinate
and the placements the engine gives the parameter (no process group, no device mesh)::

    plan = resolve_plan(cfg.parallel, cfg.mesh, meta_model)
    shapes = {name: tuple(p.shape) for name, p in meta_model.named_parameters()}
    held = param_slices(plan, shapes)
    held["w1"].slices          # {2: ((0, 8), (0, 3)), 3: ((0, 8), (3, 6))}: stages_dp_then_tp, stage 1
    groups = placement_groups(plan, shapes)       # layers.0..n-1 of one role -> "layers.*.attn.wq.weight"
    table = placement_table(plan, groups)         # JSON-ready; placement_groups_from_table(table) == groups

Ranks are torch ranks (row-major positions in the mesh); :class:`StageGrid` carries the labels a
user wrote (explicit rank ids) for display.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


from parallel.placements import PlacementSpec
from parallel.plan.spec import AxisSpecs, ParallelPlan
from parallel.topology import MeshSpec

Slices = tuple[tuple[int, int], ...]  # [start, stop) per tensor dim


@dataclass(frozen=True)
class StageGrid:
    """The ranks one pipeline stage is spread over, as the grid a picture draws.

    ``ranks``: torch ranks, row-major over ``shape``; ``labels``: what the user calls them (the
    explicit ``mesh`` rank ids, else the torch rank). A uniform pipeline's stage grid is the
    world mesh without its pp axis, at that stage's pp coordinate; with per-stage layouts it is
    the stage's own sub-mesh."""

    stage: int
    dim_names: tuple[str, ...]
    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    labels: tuple[str, ...]

    def label(self, rank: int) -> str:
        return self.labels[self.ranks.index(rank)]


@dataclass(frozen=True)
class ParamSlices:
    """One parameter: its stage, its placement per grid axis (``"Shard(0)"``, ``"Replicate()"``;
    FSDP's dp axes included, several sharding dp axes as one flattened axis named as torch
    names it, ``dp_a_dp_b``) and ``slices``: torch rank -> the ranges its shard covers, for the
    ranks holding the parameter only."""

    fqn: str
    shape: tuple[int, ...]
    stage: int
    placements: Mapping[str, str]
    slices: Mapping[int, Slices]


@dataclass(frozen=True)
class PlacementGroup:
    """Parameters of one role (``layers.*.attn.wq.weight``) on one stage with one shape and
    placements, hence the same slices per rank."""

    name: str
    stage: int
    shape: tuple[int, ...]
    placements: Mapping[str, str]
    params: tuple[str, ...]
    slices: Mapping[int, Slices]


def stage_grids(plan: ParallelPlan) -> list[StageGrid]:
    """One :class:`StageGrid` per pipeline stage (one, stage 0, without a pipeline)."""
    mesh, pp = plan.mesh, plan.pipeline

    def label(r: int) -> str:  # explicit ids as written, else the torch rank
        return str(mesh.rank_id(r))

    if pp is not None and pp.stages:  # per-stage layouts: each stage its own sub-mesh of torch ranks
        return [StageGrid(s, tuple(st.layout.mesh.dim_names), tuple(st.layout.mesh.shape), st.ranks,
                          tuple(label(r) for r in st.ranks)) for s, st in enumerate(pp.stages)]
    names, shape = tuple(mesh.dim_names), tuple(mesh.shape) if mesh.dim_names else ()  # () : one device
    coords = [_unravel(r, shape) for r in range(mesh.world_size)]
    if pp is None:
        return [StageGrid(0, names, shape, tuple(range(mesh.world_size)),
                          tuple(label(r) for r in range(mesh.world_size)))]
    axis = names.index(pp.dim)
    keep = [i for i in range(len(shape)) if i != axis]  # none: a pipeline-only mesh, one rank per stage
    grids = []
    for s, pp_rank in enumerate(pp.stage_ranks):  # interleaved / V schedules: several stages per pp rank
        ranks = tuple(r for r in range(mesh.world_size) if coords[r][axis] == pp_rank)
        grids.append(StageGrid(s, tuple(names[i] for i in keep), tuple(shape[i] for i in keep), ranks,
                               tuple(label(r) for r in ranks)))
    return grids


def param_slices(plan: ParallelPlan, param_shapes: Mapping[str, Sequence[int]]) -> dict[str, ParamSlices]:
    """Every parameter of ``param_shapes`` (FQN -> global shape, e.g. a meta model's
    ``named_parameters``): its stage, placements and the slices of every rank holding it."""
    grids = stage_grids(plan)
    stage_of = plan.stage_of
    # Slices depend on the shape, the placements and the grid's geometry, not on the stage: the
    # blocks of every stage of a uniform pipeline share them (a [64, 8, 8] mesh: 8 times fewer).
    cache: dict[tuple[Any, ...], tuple[dict[str, str], list[Slices]]] = {}
    out = {}
    for fqn, shape in param_shapes.items():
        shape = tuple(int(n) for n in shape)
        stage = stage_of(fqn)
        layout = plan.pipeline.stages[stage].layout if plan.pipeline is not None and plan.pipeline.stages else plan
        # The topology's rule: an expert Shard(0) over ep; FSDP over the dp axes and cp (and ep beside experts).
        topology, grid = layout.topology, grids[stage]
        axes, fsdp_axes = topology.placed(fqn, layout.placements.get(fqn, {})), topology.fsdp_axes(fqn)
        key = (shape, tuple(sorted((a, repr(p)) for a, p in axes.items())), grid.dim_names, grid.shape, fsdp_axes)
        if key not in cache:
            cache[key] = _layout_slices(shape, grid, axes, fsdp_axes)
        placements, by_position = cache[key]
        out[fqn] = ParamSlices(fqn, shape, stage, placements, dict(zip(grid.ranks, by_position)))
    return out


def group_name(fqn: str) -> str:
    """The role of a parameter across repeated blocks: numeric path parts become ``*``
    (``layers.3.attn.wq.weight`` -> ``layers.*.attn.wq.weight``)."""
    return ".".join("*" if part.isdigit() else part for part in fqn.split("."))


def placement_groups(plan: ParallelPlan, param_shapes: Mapping[str, Sequence[int]]) -> list[PlacementGroup]:
    """:func:`param_slices` grouped by role, stage, shape and placements, in model order
    (blocks split over stages give one group per stage)."""
    merged: dict[tuple[Any, ...], list[ParamSlices]] = {}
    for p in param_slices(plan, param_shapes).values():
        merged.setdefault((group_name(p.fqn), p.stage, p.shape, tuple(p.placements.items())), []).append(p)
    return [PlacementGroup(name, stage, shape, dict(placements), tuple(p.fqn for p in members), members[0].slices)
            for (name, stage, shape, placements), members in merged.items()]


def placement_table(plan: ParallelPlan, groups: Sequence[PlacementGroup]) -> dict[str, Any]:
    """The JSON-ready table (``placement.json``): the mesh, every stage's grid, and per group
    name a list with one entry per (stage, shape, placements): ``{stage, params, shape,
    placements, ranks: {torch rank: [[start, stop], ...]}}`` (ranks holding nothing absent)."""
    table: dict[str, Any] = {
        "mesh": {"shape": list(plan.mesh.shape), "dim_names": list(plan.mesh.dim_names),
                 "rank_ids": plan.mesh.rank_ids},
        "stages": [{"stage": g.stage, "dim_names": list(g.dim_names), "shape": list(g.shape), "ranks": list(g.ranks),
                    "labels": list(g.labels)} for g in stage_grids(plan)],
        "groups": {},
    }
    for g in groups:
        table["groups"].setdefault(g.name, []).append({
            "stage": g.stage, "params": list(g.params), "shape": list(g.shape), "placements": dict(g.placements),
            "ranks": {str(r): [list(s) for s in sl] for r, sl in g.slices.items()}})
    return table


def placement_groups_from_table(table: Mapping[str, Any]) -> list[PlacementGroup]:
    """The groups of a :func:`placement_table` (e.g. read back from ``placement.json``)."""
    return [PlacementGroup(name, e["stage"], tuple(e["shape"]), dict(e["placements"]), tuple(e["params"]),
                           {int(r): tuple(tuple(s) for s in sl) for r, sl in e["ranks"].items()})
            for name, entries in table["groups"].items() for e in entries]


# --------------------------------------------------------------------------- arithmetic


def _layout_slices(shape: tuple[int, ...], grid: StageGrid, axes: AxisSpecs,
                   fsdp_axes: tuple[str, ...]) -> tuple[dict[str, str], list[Slices]]:
    """``(placement per grid axis, slices per grid position)`` of a parameter of ``shape`` placed
    ``axes`` on ``grid`` and sharded by FSDP over ``fsdp_axes`` (:meth:`~parallel.topology.Topology.fsdp_axes`).

    The shards are the engine's: the config's placements on tensor-parallel axes, then FSDP2's
    dim-0 shard over the (flattened) sharding dp axes cut from each rank's tp shard, since
    ``fully_shard`` chunks the local tensor it is given. Torch writes that as
    ``_StridedShard(0, split_factor=<tp shards of dim 0>)`` on the dp axis placed first; DTensor's
    arithmetic gives the same ranges for it as for a plain ``Shard(0)`` applied after the tp
    shards (placements apply left to right), which is how it is computed here: the strided form
    builds an index tensor per rank, thousands of times slower on a [64, 8, 8] mesh.
    (tests/dist/test_examples.py holds both against FSDP's real shards.)"""
    # start-up: DTensor (torch.distributed.tensor, about 1.4 s) only once a picture is drawn; the CLI,
    # the launcher and the control plane import this module without paying for it.
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    ndim = len(shape)
    tp = [(a, _dim_of(axes[a], ndim)) for a in grid.dim_names if a in axes and axes[a].is_shard]
    shard_axes = tuple(a for a in fsdp_axes if a in grid.dim_names) if ndim else ()
    size = dict(zip(grid.dim_names, grid.shape))
    names = [(a,) for a, _ in tp] + ([shard_axes] if shard_axes else [])
    torch_placements = [Shard(d) for _, d in tp] + ([Shard(0)] if shard_axes else [])
    mesh_shape = [MeshSpec(grid.shape, grid.dim_names).size(group) for group in names]
    slices: list[Slices] = []
    for position in range(len(grid.ranks)):
        coord = dict(zip(grid.dim_names, _unravel(position, grid.shape)))
        my_coordinate = [_flat_index([coord[a] for a in group], [size[a] for a in group]) for group in names]
        local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, my_coordinate, torch_placements)
        slices.append(tuple((o, o + n) for o, n in zip(offset, local)))

    placements = {}
    for a in grid.dim_names:
        if a not in shard_axes:
            placements[a] = str(axes.get(a, PlacementSpec("replicate")))
        elif a == shard_axes[0]:
            placements["_".join(shard_axes)] = "Shard(0)"  # several dp axes: torch's name of their flattened axis
    return placements, slices


def _dim_of(placement: PlacementSpec, ndim: int) -> int:
    assert placement.dim is not None, "a shard placement has a dim"
    return placement.dim + ndim if placement.dim < 0 else placement.dim


def _flat_index(coord: Sequence[int], sizes: Sequence[int]) -> int:
    index = 0
    for c, n in zip(coord, sizes):
        index = index * n + c
    return index


def _unravel(index: int, shape: Sequence[int]) -> tuple[int, ...]:
    coord = []
    for n in reversed(shape):
        index, c = divmod(index, n)
        coord.append(c)
    return tuple(reversed(coord))


__all__ = ["ParamSlices", "PlacementGroup", "Slices", "StageGrid", "group_name", "param_slices",
           "placement_groups", "placement_groups_from_table", "placement_table", "stage_grids"]
