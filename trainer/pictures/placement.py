"""The placement picture: for each parameter group and pipeline stage, which rank holds which slice.

    paths = write_placement(cfg, plan, Path("meshflow-plan"))
    # {"png": meshflow-plan/placement.png, "json": meshflow-plan/placement.json}

``python -m trainer +examples=stages_dp_x_tp dry_run=true`` writes both under ``meshflow-plan/`` in
the current directory (Hydra's run directory is ``.``) and prints their paths; a training run
is meant to log the same two files as MLflow artifacts. ``tracking.pictures=false`` skips them.

One row per parameter group (``layers.*.attn.wq.weight``: the same role in every block, one
placement) and stage. On the left the stage's mesh as a grid of ranks, labelled as the user
wrote them (explicit ``mesh`` rank ids, else torch ranks), axes named by the mesh's dim names;
on the right the tensor as a rectangle (rows x columns; a 1-D tensor as a bar) cut into the
blocks the ranks hold, as OneFlow draws split(0) / broadcast and PaddlePaddle a ProcessMesh's
shards. A block and the grid cells of the ranks holding it share a colour; a block held by
several ranks (replicas) is hatched and names all of them. The slices come from
:mod:`parallel.plan.placement_map` and are also written as ``placement.json``.

Limits, so the figure stays legible: up to ``MAX_SEPARATE`` rows each (group, stage) gets its
own row; past that, groups of one stage whose blocks are the same fractions of their tensor
(identical placements) share a row; at most ``MAX_ROWS`` rows are drawn, the rest are named in
a footnote (every group is in the JSON). Rank labels are written while a grid has at most
``MAX_LABELLED`` cells and a tensor at most ``MAX_LABELLED_BLOCKS`` blocks; larger ones are
drawn in colour only (a [64, 8, 8] mesh draws, but reads as colour bands).
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from parallel.plan.placement_map import (
    PlacementGroup,
    Slices,
    StageGrid,
    placement_groups,
    placement_table,
    stage_grids,
)
from parallel.plan.spec import ParallelPlan
from trainer.config.schema import RunConfig
from trainer.models.skeleton import meta_model

DRY_RUN_DIR = Path("meshflow-plan")  # under the current directory: next to checkpoints/ and mlflow.db
MAX_SEPARATE = 8
MAX_ROWS = 16
MAX_LABELLED = 64  # grid cells with a rank label
MAX_LABELLED_BLOCKS = 16  # tensor blocks with the labels of their ranks (a 1-D bar: half as many)
_EMPTY = (0.92, 0.92, 0.92, 1.0)  # a rank whose shard is empty (FSDP's last ranks on a short dim 0)


@dataclass(frozen=True)
class _Row:
    groups: tuple[PlacementGroup, ...]  # drawn with the first one's shape; the others share its pattern
    grid: StageGrid


def placement_report(cfg: RunConfig, plan: ParallelPlan) -> tuple[list[PlacementGroup], dict]:
    """The parameter groups of ``cfg``'s model under ``plan`` and their JSON table (what
    ``placement.json`` holds, and what a REST plan can return)."""
    model = meta_model(cfg.model)
    groups = placement_groups(plan, {name: tuple(p.shape) for name, p in model.named_parameters()})
    return groups, placement_table(plan, groups)


def write_placement(cfg: RunConfig, plan: ParallelPlan, out_dir: str | Path) -> dict[str, Path]:
    """Write ``placement.png`` and ``placement.json`` into ``out_dir`` (created); their paths by kind."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups, table = placement_report(cfg, plan)
    json_path = out_dir / "placement.json"
    json_path.write_text(json.dumps(table, indent=1 if cfg.world_size <= 64 else None))  # big meshes: compact
    dims = list(cfg.parallel.dims) if cfg.parallel else []
    title = (f"placement: {cfg.model.arch} model on mesh {cfg.mesh if cfg.mesh is not None else [1]} "
             f"({cfg.world_size} rank{'s' if cfg.world_size > 1 else ''}), dims {dims}")
    png_path = draw_placement(groups, stage_grids(plan), out_dir / "placement.png", title=title)
    return {"png": png_path, "json": json_path}


def draw_placement(groups: Sequence[PlacementGroup], grids: Sequence[StageGrid], path: str | Path, *,
                   title: str = "placement") -> Path:
    """Draw the picture of ``groups`` (from :func:`parallel.plan.placement_map.placement_groups`) on
    the stage ``grids`` into the PNG ``path``."""
    # start-up: matplotlib only where a picture is drawn. The object API (no pyplot, no global
    # backend state) draws to a file anywhere, in the launcher's picture thread too.
    from matplotlib.figure import Figure

    rows, left_out = _rows(groups, grids)
    colours = _colours(rows)
    top, bottom = 1.3, 0.6 + 0.6 * bool(left_out)  # inches: the title; the axis labels and the footnote
    fig = Figure(figsize=(13, top + bottom + 2.5 * len(rows)))
    spec = fig.add_gridspec(len(rows), 2, width_ratios=[1, 1.7], hspace=0.7, wspace=0.2,
                            top=1 - top / fig.get_figheight(), bottom=bottom / fig.get_figheight())
    fig.suptitle(f"{title}\nleft: each stage's ranks (as named in the mesh) and the slice each holds; right: the "
                 "tensor cut into those slices, coloured by the ranks holding them (hatched: by several)", fontsize=10)
    for i, row in enumerate(rows):
        _draw_grid(fig.add_subplot(spec[i, 0]), row, colours, pipelined=len(grids) > 1)
        _draw_tensor(fig.add_subplot(spec[i, 1]), row, colours)
    if left_out:
        names = ", ".join(f"{g.name} (stage {g.stage})" for r in left_out for g in r.groups)
        note = (f"{len(left_out)} more rows not drawn (at most {MAX_ROWS}); placement.json has every group: "
                f"{names[:400]}{'...' if len(names) > 400 else ''}")
        fig.text(0.01, 0.005, textwrap.fill(note, 180), fontsize=7, va="bottom")
    path = Path(path)
    fig.savefig(path, dpi=90)
    return path


# ----------------------------------------------------------------------------- rows


def _rows(groups: Sequence[PlacementGroup], grids: Sequence[StageGrid]) -> tuple[list[_Row], list[_Row]]:
    """``(rows drawn, rows left out)``: a row per group, or per distinct pattern past MAX_SEPARATE."""
    if len(groups) <= MAX_SEPARATE:
        rows = [_Row((g,), grids[g.stage]) for g in groups]
    else:
        merged: dict[tuple, list[PlacementGroup]] = {}
        for g in groups:
            merged.setdefault((g.stage, _pattern(g)), []).append(g)
        rows = [_Row(tuple(members), grids[stage]) for (stage, _), members in merged.items()]
    return rows[:MAX_ROWS], rows[MAX_ROWS:]


def _pattern(group: PlacementGroup) -> tuple:
    """The blocks as fractions of the tensor, per rank: equal patterns draw the same picture."""
    # a / n are correctly rounded, so two ratios of small ints are equal exactly when the floats are.
    return tuple((rank, tuple((a / n, b / n) if n else (a, b) for (a, b), n in zip(sl, group.shape)))
                 for rank, sl in sorted(group.slices.items()))


def _blocks(slices: Mapping[int, Slices]) -> dict[Slices, list[int]]:
    """Distinct non-empty slices -> the ranks holding them, in order of first holder."""
    out: dict[Slices, list[int]] = {}
    for rank, sl in slices.items():
        if all(b > a for a, b in sl):
            out.setdefault(sl, []).append(rank)
    return out


def _colours(rows: Sequence[_Row]) -> dict[tuple[int, ...], tuple]:
    """A colour per set of ranks holding a block, the same in every row: a rank (or a replica
    group) keeps its colour down the picture."""
    from matplotlib import colormaps

    holders = list(dict.fromkeys(tuple(ranks) for row in rows for ranks in _blocks(row.groups[0].slices).values()))
    n = len(holders)
    cmap = colormaps["tab10" if n <= 10 else "tab20" if n <= 20 else "turbo"]
    return {h: cmap(i if n <= 20 else i / max(1, n - 1)) for i, h in enumerate(holders)}


def _holders_text(labels: list[str]) -> str:
    return ",".join(labels) if len(labels) <= 4 else f"{labels[0]},{labels[1]},..,{labels[-1]} ({len(labels)})"


def _range(a: int, b: int, n: int) -> str:
    return ":" if (a, b) == (0, n) else f"{a}:{b}"


# ----------------------------------------------------------------------------- drawing


def _draw_grid(ax, row: _Row, colours: dict[tuple[int, ...], tuple], *, pipelined: bool) -> None:
    """The stage's ranks as a grid: last mesh axis across, the others down (flattened)."""
    import numpy as np

    grid, group = row.grid, row.groups[0]
    cols = grid.shape[-1] if grid.shape else 1
    num_rows = math.prod(grid.shape[:-1]) if grid.shape else 1
    holders = {rank: tuple(ranks) for ranks in _blocks(group.slices).values() for rank in ranks}
    image = np.ones((num_rows, cols, 4))
    for i, rank in enumerate(grid.ranks):
        image[i // cols, i % cols] = colours[holders[rank]] if rank in holders else _EMPTY
    # Square cells while they are few; a large grid fills its panel instead of a thin strip.
    ax.imshow(image, interpolation="nearest", aspect="equal" if len(grid.ranks) <= MAX_LABELLED else "auto")
    if len(grid.ranks) <= 32 * 32:  # white lines between the cells (not minor ticks: slow by the hundred)
        width = 2 if len(grid.ranks) <= MAX_LABELLED else 0.5
        ax.vlines(np.arange(0.5, cols - 1), -0.5, num_rows - 0.5, colors="white", linewidth=width)
        ax.hlines(np.arange(0.5, num_rows - 1), -0.5, cols - 0.5, colors="white", linewidth=width)
    if len(grid.ranks) <= MAX_LABELLED:
        size = 10 if len(grid.ranks) <= 16 else 7
        for i, rank in enumerate(grid.ranks):
            sl = group.slices[rank]
            held = all(b > a for a, b in sl)
            ax.text(i % cols, i // cols, grid.labels[i], ha="center", va="bottom" if len(grid.ranks) <= 8 else "center",
                    fontsize=size, fontweight="bold")
            if len(grid.ranks) <= 8:  # few ranks: each cell also says which slice (the seeds' figures do)
                text = "[" + ", ".join(_range(a, b, n) for (a, b), n in zip(sl, group.shape)) + "]" if held else "empty"
                ax.text(i % cols, i // cols + 0.08, text, ha="center", va="top", fontsize=7)
    names = grid.dim_names
    ax.set_xticks(range(cols) if cols <= 16 else [])
    ax.set_yticks(range(num_rows) if num_rows <= 16 and len(names) > 1 else [])
    ax.set_xlabel(f"{names[-1]} ({cols})" if names else "one rank")
    if len(names) > 1:
        ax.set_ylabel(" x ".join(f"{n} ({s})" for n, s in zip(names[:-1], grid.shape[:-1])))
    where = f"stage {grid.stage}" if pipelined else "mesh"
    ax.set_title(f"{where}: {_ranks_text(grid)}", fontsize=9)


def _ranks_text(grid: StageGrid) -> str:
    """The stage's ranks as written: nested like its grid when small."""
    ids = grid.labels != tuple(str(r) for r in grid.ranks)  # explicit mesh rank ids: say so
    if len(grid.ranks) > 16:
        return f"{len(grid.ranks)} ranks"
    labels = list(grid.labels)
    if len(grid.shape) >= 2:
        cols = grid.shape[-1]
        nested = "[" + ", ".join("[" + ", ".join(labels[i:i + cols]) + "]" for i in range(0, len(labels), cols)) + "]"
    else:
        nested = "[" + ", ".join(labels) + "]"
    return f"rank ids {nested} (torch ranks {grid.ranks[0]}..{grid.ranks[-1]} row-major)" if ids else f"ranks {nested}"


def _draw_tensor(ax, row: _Row, colours: dict[tuple[int, ...], tuple]) -> None:
    """The tensor as a rectangle (dim 0 down, dim 1 across; a bar for 1-D) cut into its blocks."""
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    group, grid = row.groups[0], row.grid
    shape = group.shape
    num_rows, num_cols = (shape[0], shape[1]) if len(shape) >= 2 else (1, shape[0]) if shape else (1, 1)
    as_2d = lambda sl: (  # noqa: E731
        (sl[0], sl[1]) if len(shape) >= 2 else ((0, 1), sl[0]) if shape else ((0, 1), (0, 1)))
    blocks = _blocks(group.slices)
    labelled = len(blocks) <= (MAX_LABELLED_BLOCKS if len(shape) >= 2 else MAX_LABELLED_BLOCKS // 2)  # a bar is narrow
    # One collection for the blocks one rank holds, one (hatched) for replicated ones: a [64, 8, 8]
    # mesh has hundreds of blocks per tensor, and a patch each takes matplotlib seconds.
    for replicated in (False, True):
        chosen = [(sl, ranks) for sl, ranks in blocks.items() if (len(ranks) > 1) == replicated]
        if not chosen:
            continue
        rects = [Rectangle((c0, r0), c1 - c0, r1 - r0) for (r0, r1), (c0, c1) in (as_2d(sl) for sl, _ in chosen)]
        ax.add_collection(PatchCollection(rects, facecolors=[colours[tuple(ranks)] for _, ranks in chosen],
                                          edgecolors="black", linewidths=1 if len(blocks) <= 256 else 0.2,
                                          hatch="//" if replicated else None))
    for sl, ranks in blocks.items() if labelled else ():
        (r0, r1), (c0, c1) = as_2d(sl)
        ax.text((c0 + c1) / 2, (r0 + r1) / 2, _holders_text([grid.label(r) for r in ranks]), ha="center", va="center",
                fontsize=9 if len(blocks) <= 8 else 6, bbox={"facecolor": "white", "alpha": 0.8, "pad": 1,
                                                             "linewidth": 0})
    num_rows, num_cols = max(num_rows, 1), max(num_cols, 1)  # a zero-size dim still gets an (empty) frame
    ax.set_xlim(0, num_cols)
    ax.set_ylim(num_rows, 0)  # row 0 on top, as a matrix is written
    # Displayed height / width, clamped so that [1024, 4096] and [4, 3] both stay readable.
    ratio = min(2.5, max(0.4, num_rows / num_cols)) if len(shape) >= 2 else 0.08
    ax.set_aspect(ratio * num_cols / num_rows)
    col_edges = sorted({e for sl in blocks for e in as_2d(sl)[1]} | {0, num_cols})
    row_edges = sorted({e for sl in blocks for e in as_2d(sl)[0]} | {0, num_rows})
    ax.set_xticks(col_edges if len(col_edges) <= 5 else [0, num_cols])
    ax.set_yticks(row_edges if len(shape) >= 2 and len(row_edges) <= 9 else [0, num_rows] if len(shape) >= 2 else [])
    ax.tick_params(labelsize=7)
    ax.set_xlabel(f"dim {1 if len(shape) >= 2 else 0} ({num_cols})" if shape else "scalar", fontsize=8)
    if len(shape) >= 2:
        ax.set_ylabel(f"dim 0 ({num_rows})", fontsize=8)
    placements = ", ".join(f"{axis}: {p}" for axis, p in group.placements.items()) or "whole (no mesh axis)"
    title = f"{group.name} {list(shape)}   {placements}"
    if len(shape) > 2:
        title += f"   (dims 2.. {list(shape[2:])} not drawn)"
    empty = [grid.label(r) for r, sl in group.slices.items() if not all(b > a for a, b in sl)]
    others = [f"{g.name} {list(g.shape)}" for g in row.groups[1:]]
    lines = [title]
    if others:
        more = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
        lines.append(f"same pattern: {more}")
    if empty:
        lines.append(f"empty shard on {_holders_text(empty)}")
    ax.set_title("\n".join(textwrap.fill(line, 100, subsequent_indent="    ") for line in lines), fontsize=9,
                 loc="left")


__all__ = ["DRY_RUN_DIR", "draw_placement", "placement_report", "write_placement"]
