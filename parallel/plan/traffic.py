"""Bytes a rank sends per pass under 2-D / 2.5-D (Optimus / Tesseract, :mod:`parallel.sharding.tp_grid`) and
3-D (:mod:`parallel.sharding.tp_cube`) tensor parallelism, per mesh axis: the dry run's traffic and the
benches' analytic column (tests/bench/bench_tp_grids.py, tests/bench/bench_tp_cube.py) are these formulas.

    grid_traffic(linears, layers=4, norms=2, hidden=64, side=2, tokens=1024)   # {"col": B, "row": B}
    layout_traffic(plan, model, tokens=1024)                                   # per axis, grid or cube

Data parallelism's gradient reduce over dp (or a 2.5-D depth) is priced with the other dp modes
(:func:`trainer.planner.numbers.plan_numbers`), on the grid blocks a rank holds (:mod:`parallel.plan.held`).
"""

from __future__ import annotations

from torch import nn

from parallel.plan.cube import cube_traffic
from parallel.plan.spec import ParallelPlan


def grid_traffic(linears: list[tuple[int, int]], *, layers: int, norms: int, hidden: int, side: int, tokens: int,
                 dtype_bytes: int = 4) -> dict[str, float]:
    """Bytes one rank of a ``side`` x ``side`` grid sends in one forward and backward of ``tokens`` token rows
    (the grid's share of the batch: a dp rank's, or one Tesseract layer's), over its cols (c) and rows (r).

    ``linears``: one block's Linears as ``(in, out)``; ``layers`` blocks, each with ``norms`` norms of width
    ``hidden``. Optimus (Xu et al. 2021, sec. 3, on SUMMA), with N = tokens / q per rank and k = (q - 1) / q:

    * each Linear all-gathers ``X_i.`` over c (``k N in``) and ``W_.j`` over r (``k in out / q``) in forward,
      and reduce-scatters ``dX`` and ``dW`` of the same sizes in backward;
    * each norm all-reduces its ``N`` row statistics over c in forward and, in backward, reduce-scatters the
      one term of its input gradient DTensor keeps Partial (``N x h``); its weight gradient is all-reduced
      over r (``h / q``);
    * the stream leaving the grid (forward) and its gradient entering it (backward) are gathered over c
      (``N x h`` after) and then over r (``N q x h`` after)."""
    q = side
    n, k, h = tokens // q, (q - 1) / q, hidden
    col = layers * sum(2 * k * n * i for i, _ in linears) + layers * norms * (2 * k * n + k * n * h) + 2 * k * n * h
    row = layers * sum(2 * k * i * o / q for i, o in linears) + layers * norms * 2 * k * h / q + 2 * k * n * q * h
    return {"col": col * dtype_bytes, "row": row * dtype_bytes}


def _grid_shapes(plan: ParallelPlan, model: nn.Module) -> tuple[list[tuple[int, int]], int, int]:
    """``(one block's Linears as (in, out), norms per block, their width)`` of the grid's blocks."""
    modules = dict(model.named_modules())
    block = modules[plan.blocks[0]]
    linears = [(m.in_features, m.out_features) for m in block.modules() if isinstance(m, nn.Linear)]
    norms = [m for m in block.modules() if isinstance(m, nn.RMSNorm) and m.weight is not None]
    return linears, len(norms), int(norms[0].weight.shape[0]) if norms else 0


def layout_traffic(plan: ParallelPlan, model: nn.Module, *, tokens: int, dtype_bytes: int = 4) -> dict[str, float]:
    """Bytes one rank sends over the grid's or cube's axes in one forward and backward of ``tokens`` token rows
    (a dp rank's micro-batch, a Tesseract layer's under 2.5-D): ``{axis: bytes}``, the grid's over its cols
    and rows, the cube's over its three axes together (``"a,b,c"``, :func:`parallel.plan.cube.cube_traffic`).
    Empty without a grid or cube."""
    if plan.grid is not None and plan.blocks:
        grid = plan.grid
        linears, norms, hidden = _grid_shapes(plan, model)
        side = plan.mesh.size(grid.rows)
        sent = grid_traffic(linears, layers=len(plan.blocks), norms=norms,
                            hidden=hidden, side=side, tokens=tokens, dtype_bytes=dtype_bytes)
        return {grid.cols: sent["col"], grid.rows: sent["row"]} if side > 1 else {}
    if plan.cube is not None:
        side = plan.mesh.size(plan.cube.dims[0])
        terms = cube_traffic(plan.cube, model, side=side, tokens=tokens, dtype_bytes=dtype_bytes)
        return {",".join(plan.cube.dims): sum(terms.values())} if side > 1 else {}
    return {}


def layout_calls(plan: ParallelPlan, model: nn.Module) -> dict[str, int]:
    """Collectives one rank runs over each axis of :func:`layout_traffic` in one forward and backward (so a
    pricer splits the bytes into calls of their size): per Linear a gather and a reduce-scatter on each of its
    axes, per norm its statistics' two and its weight's reduce, and the stream's entry and exit."""
    if plan.grid is not None and plan.blocks:
        linears, norms, _ = _grid_shapes(plan, model)
        layers = len(plan.blocks)
        return {plan.grid.cols: layers * (2 * len(linears) + 2 * norms) + 2,
                plan.grid.rows: layers * (2 * len(linears) + norms) + 2}
    if plan.cube is not None:
        return {",".join(plan.cube.dims): 6 * (len(plan.cube.first) + len(plan.cube.second))
                + 4 * len(plan.cube.norms) + 2}
    return {}


__all__ = ["grid_traffic", "layout_calls", "layout_traffic"]
