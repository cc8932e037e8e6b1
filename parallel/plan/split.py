"""How much of a block's compute and activations one rank does and keeps under 2-D / 2.5-D
(``parallel.grid_parallel``) and 3-D (``parallel.tensor_parallel_3d``) tensor parallelism, as shares of what
the whole block does: the memory and time models' meta pass runs the blocks whole (the grid's and cube's
modules are placed by their own code, not by the plan's placement map) and prices each op at these shares.

    shares = layout_shares(plan, model)     # None without a grid or cube
    shares.block, shares.linears["layers.0.attn.wq"], shares.row_stats
    split_key(plan)                          # what they depend on beside the model, for a cache key

The splits, on a grid's side q (:mod:`parallel.sharding.tp_grid`) or a cube's (:mod:`parallel.sharding.tp_cube`):

* every op of a block works on the rank's block of the activations: a grid's batch rows over r and hidden over c,
  ``1 / q^2`` (2.5-D's depth splits the batch as data parallelism does: the micro-batch is already its share);
  a cube's rows over a then b (or c) and hidden over the other, ``1 / q^3``; a cube whose heads do not split over
  its side gathers q/k/v over c, so its attention core runs on ``1 / q^2``;
* each Linear keeps its own gathered input and weight for backward, not the block's one copy: a grid's input
  ``X_i.`` (its batch rows, the hidden whole: ``1 / q``) and weight ``W_.j`` (``1 / q``), a cube's input block
  ``[m / q, k / q]`` and weight block ``[n / q, k / q]`` (``1 / q^2`` each, :func:`parallel.plan.cube.cube_memory`);
* a norm keeps its input, its normalised input and a scale per row (the rows a rank holds: ``1 / q`` on a grid,
  ``1 / q^2`` on a cube), where torch's fused ``rms_norm`` keeps the input and the scales.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from parallel.plan.spec import ParallelPlan


@dataclass(frozen=True)
class LayoutShares:
    """Shares of a whole block's work and saved bytes one rank of a grid or cube does and keeps (module docstring).

    ``blocks``: the units whose ops are split; ``block``: an op's share there; ``core``: the attention kernel's;
    ``linears``: ``{Linear FQN: (its saved input's share, its weight's share)}``; ``norms``: the norms that keep
    their normalised input beside their input; ``row_stats``: the share of a norm's per-row scale."""

    blocks: frozenset[str]
    block: float
    core: float
    row_stats: float
    linears: dict[str, tuple[float, float]] = field(default_factory=dict)
    norms: frozenset[str] = frozenset()


def layout_shares(plan: ParallelPlan, model: nn.Module) -> LayoutShares | None:
    """The :class:`LayoutShares` of ``plan``'s grid or cube on ``model``; None without either (or of side 1)."""
    modules = dict(model.named_modules())
    blocks = [b for b in plan.blocks if b in modules]
    if plan.grid is not None and blocks:
        q = plan.mesh.size(plan.grid.rows)
        if q == 1:
            return None
        inside = [(f"{b}.{n}", m) for b in blocks for n, m in modules[b].named_modules() if n]
        linears = {name: (1 / q, 1 / q) for name, m in inside if isinstance(m, nn.Linear)}
        norms = frozenset(name for name, m in inside if isinstance(m, nn.RMSNorm) and m.weight is not None)
        return LayoutShares(frozenset(blocks), 1 / q**2, 1 / q**2, 1 / q, linears, norms)
    if plan.cube is not None and blocks:
        cube = plan.cube
        q = plan.mesh.size(cube.dims[0])
        if q == 1:
            return None
        # (a planner's two-block model holds some of the cube's modules)
        linears = {name: (1 / q**2, 1 / q**2) for name in (*cube.first, *cube.second) if name in modules}
        norms = frozenset(name for name in cube.norms if name in modules)
        core = 1 / q**3 if cube.split_heads else 1 / q**2
        return LayoutShares(frozenset(blocks), 1 / q**3, core, 1 / q**2, linears, norms)
    return None


def split_key(plan: ParallelPlan) -> tuple[object, ...]:
    """What :func:`layout_shares` depends on beside the model (a cache key's part): the grid or cube and its side."""
    if plan.grid is not None:
        return plan.grid.rows, plan.grid.cols, plan.mesh.size(plan.grid.rows)
    if plan.cube is not None:
        return plan.cube, plan.mesh.size(plan.cube.dims[0])
    return ()


__all__ = ["LayoutShares", "layout_shares", "split_key"]
