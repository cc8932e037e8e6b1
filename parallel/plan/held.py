"""How much of each parameter a rank holds under 2-D / 2.5-D (``parallel.grid_parallel``) and 3-D
(``parallel.tensor_parallel_3d``) tensor parallelism, in the placement map's terms, so that
:meth:`parallel.topology.Topology.holding` answers for them as for every other layout.

    placements = {**plan.placements, **layout_placements(plan, model)}
    tp_div, dp_div, expert = plan.topology.holding(fqn, placements.get(fqn, {}))

The grid's and cube's modules are placed by their own code (:mod:`parallel.sharding.tp_grid`,
:mod:`parallel.sharding.tp_cube`), not by the plan's placement map; these are the same splits:

* grid (rows r, cols c): a block's ``nn.Linear`` weight ``[out, in]`` ``(Shard(1), Shard(0))`` (``in out / q^2``
  per rank), its bias and the block norms' weights ``Shard(0)`` over c (``h / q``);
* cube (a, b, c): a Linear taking the 3-D matmul's roles holds ``in out / q^3`` (its weight block cut over all
  three axes), its bias ``out / q``, a norm ``H / q`` (the hidden split over b).

Everything else (embedding, final norm, head) stays whole, as both layouts keep it.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from parallel.placements import PlacementSpec
from parallel.plan.spec import ParallelPlan

Placements = Mapping[str, Mapping[str, PlacementSpec]]

_CACHE: dict[tuple[int, object, object, tuple[str, ...]], dict[str, dict[str, PlacementSpec]]] = {}


def layout_placements(plan: ParallelPlan, model: nn.Module) -> Placements:
    """``{parameter FQN: {axis: placement}}`` of the grid's or cube's parameters; empty without either."""
    if plan.grid is None and plan.cube is None:
        return {}
    key = (id(model), plan.grid, plan.cube, tuple(plan.blocks))
    if key not in _CACHE:
        _CACHE[key] = _grid(plan, model) if plan.grid is not None else _cube(plan, model)
    return _CACHE[key]


def _shard(dim: int) -> PlacementSpec:
    return PlacementSpec("shard", dim)


def _grid(plan: ParallelPlan, model: nn.Module) -> dict[str, dict[str, PlacementSpec]]:
    grid = plan.grid
    assert grid is not None, "called for a plan with a grid"
    modules = dict(model.named_modules())
    out: dict[str, dict[str, PlacementSpec]] = {}
    for block in plan.blocks:
        if block not in modules:
            continue
        for name, module in modules[block].named_modules():
            prefix = f"{block}.{name}" if name else block
            if isinstance(module, nn.Linear):
                out[f"{prefix}.weight"] = {grid.rows: _shard(1), grid.cols: _shard(0)}
                if module.bias is not None:
                    out[f"{prefix}.bias"] = {grid.cols: _shard(0)}
            elif isinstance(module, nn.RMSNorm) and module.weight is not None:
                out[f"{prefix}.weight"] = {grid.cols: _shard(0)}
    return out


def _cube(plan: ParallelPlan, model: nn.Module) -> dict[str, dict[str, PlacementSpec]]:
    cube = plan.cube
    assert cube is not None, "called for a plan with a cube"
    a, b, c = cube.dims
    out: dict[str, dict[str, PlacementSpec]] = {}
    for name in (*cube.first, *cube.second):
        out[f"{name}.weight"] = {a: _shard(1), b: _shard(0), c: _shard(0)}  # in x out / q^3
        out[f"{name}.bias"] = {b: _shard(0)}
    for name in cube.norms:
        out[f"{name}.weight"] = {b: _shard(0)}
    return out


__all__ = ["layout_placements"]
