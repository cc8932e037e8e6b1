"""Validation of ``parallel.grid_parallel``: 2-D and 2.5-D tensor parallelism (:mod:`parallel.sharding.tp_grid`).

* the axes: rows and cols (and depth) are mesh axes of their own, and the grid is square (rows as long as cols);
* the layouts a grid is not built with are refused with a fix that drops them: a pipeline, context or expert
  parallelism, 1-D tensor parallelism or placements beside it, hsdp, torch.compile, activation checkpointing;
* the batch: every batch rank's micro-batch splits over the rows;
* the model: every block Linear's inputs split over the rows and its outputs over the columns, the norms' hidden
  and the query and key/value heads over the columns (per-head q/k norms, Qwen3's, stay whole: nothing to split);
  a mixture of experts and LoRA adapters are refused. A grid that cannot split the model is refused with the
  smallest square grid that can (``mesh=[3,3]`` for 9 heads over 3 kv heads), when there is one; on a 2.5-D grid
  first with one layer of depth (``mesh=[1,3,3]``: 9 ranks, not 18), then with the user's depth.
"""

from __future__ import annotations

from torch import nn

from parallel.errors import ConfigIssue, format_path, override
from parallel.plan.units import block_units, pipeline_units
from trainer.config.schema import RunConfig

PATH = "parallel.grid_parallel"
LARGEST_GRID = 16  # the fixes look for a square grid up to this side


def check_grid_axes(par, role: dict[str, str]) -> list[ConfigIssue]:
    """The grid's axes are mesh axes no other role has taken; records them in ``role``."""
    grid = par.grid_parallel
    issues = []
    for field, axis in grid.axes.items():
        path = f"{PATH}.{field}"
        if axis not in par.dims:
            issues.append(ConfigIssue(path, f"axis {axis!r} is not in parallel.dims {par.dims}",
                                      f"use one of {par.dims} or add it to parallel.dims"))
        elif axis in role:
            issues.append(ConfigIssue(path, f"axis {axis!r} is already the {role[axis]} axis",
                                      "give every grid axis its own mesh axis"))
        role[axis] = "grid_parallel"
    return issues


def check_grid(cfg: RunConfig) -> list[ConfigIssue]:
    """The config's side (no model needed): a square grid, the layouts it composes with, the batch."""
    par = cfg.parallel
    if par is None or par.grid_parallel is None or cfg.mesh is None or len(par.dims) != len(cfg.mesh_shape) \
            or any(axis not in par.dims for axis in par.grid_parallel.axes.values()):
        return []
    grid = par.grid_parallel
    rows, cols = cfg.axis_size(grid.rows), cfg.axis_size(grid.cols)
    issues = []
    if rows != cols:
        side = min(rows, cols)
        issues.append(ConfigIssue("mesh", f"the grid {grid.rows} x {grid.cols} is {rows} x {cols}: 2-D tensor "
                                  "parallelism needs a square grid (SUMMA gathers a row's blocks and a column's alike)",
                                  f"make it square: {grid_mesh(cfg, side)}"))
    drop = {"pipeline": "a pipeline", "context_parallel": "context parallelism",
            "expert_parallel": "expert parallelism", "tensor_parallel": "1-D tensor parallelism"}
    for field, what in drop.items():
        if getattr(par, field) is not None:
            issues.append(ConfigIssue(f"parallel.{field}", f"{what} beside a 2-D / 2.5-D grid is not built: the grid "
                                      "partitions every block itself",
                                      f"drop it: {override(f'parallel.{field}', None)}"))
    for field in ("placements", "layouts"):
        if getattr(par, field):
            issues.append(ConfigIssue(f"parallel.{field}", "the grid places every block's Linears and activations "
                                      "itself; other placements beside it are not built",
                                      f"remove parallel.{field} from the config"))
    dp = par.data_parallel
    if dp is not None and dp.mode == "hsdp":
        issues.append(ConfigIssue("parallel.data_parallel.mode", "hsdp beside a grid is not built (FSDP2 takes at "
                                  "most two placements beside its own)",
                                  override("parallel.data_parallel", {"dim": dp.dim_names[0], "mode": "fsdp"})))
    if par.activation_checkpointing != "none":
        issues.append(ConfigIssue("parallel.activation_checkpointing", "activation checkpointing of grid blocks is "
                                  "not built yet", override("parallel.activation_checkpointing", "none")))
    if cfg.train.compile:
        issues.append(ConfigIssue("train.compile", "torch.compile of grid blocks is not built yet (their weights are "
                                  "gathered by hooks replacing each Linear's forward)",
                                  override("train.compile", False)))
    split = cfg.dp_size * cfg.train.grad_accum
    if cfg.train.global_batch_size % split == 0 and (cfg.train.global_batch_size // split) % rows:
        step = split * rows
        good = step * max(1, round(cfg.train.global_batch_size / step))
        per_rank = cfg.train.global_batch_size // split
        issues.append(ConfigIssue("train.global_batch_size", f"each batch rank's {per_rank} sequences do not split "
                                  f"over the grid's {rows} rows (each row holds whole sequences)",
                                  f"use a multiple of {step}, e.g. {override('train.global_batch_size', good)}"))
    return issues


def check_grid_model(cfg: RunConfig, model: nn.Module) -> list[ConfigIssue]:
    """The model's side: the blocks' sizes split over the grid, and nothing the grid does not partition."""
    par = cfg.parallel
    if par is None or par.grid_parallel is None or cfg.mesh is None \
            or any(axis not in par.dims for axis in par.grid_parallel.axes.values()):
        return []
    grid = par.grid_parallel
    if getattr(cfg.model, "moe", None) is not None:
        return [ConfigIssue(PATH, "a mixture of experts on a grid is not built (its experts are no Linears)",
                            f"use a dense model, e.g. {override('model', 'gpt_debug')}")]
    lora = getattr(cfg.model, "lora", None)
    if lora is not None and lora.enabled:
        return [ConfigIssue(PATH, "LoRA adapters on a grid are not built", override("model.lora.rank", 0))]
    by_rows, by_cols, names = grid_sizes(model)
    if not names:
        return [ConfigIssue(PATH, f"model {type(model).__name__} has no transformer blocks for the grid to split",
                            "use a decoder model (the built-in Llama family or a Hugging Face one)")]
    rows, cols = cfg.axis_size(grid.rows), cfg.axis_size(grid.cols)
    bad = sorted({f"{what} {n}" for what, n in by_rows if n % rows}
                 | {f"{what} {n}" for what, n in by_cols if n % cols})
    if not bad:
        return []
    side = next((q for q in range(2, LARGEST_GRID + 1) if all(n % q == 0 for _, n in (*by_rows, *by_cols))), None)
    fix = (grid_fix(cfg, side) if side is not None else "use 1-D tensor parallelism (the tp preset) for this model")
    return [ConfigIssue(PATH, f"the {rows} x {cols} grid cannot split {', '.join(bad)}: each Linear's inputs split "
                        f"over {grid.rows}, its outputs, the hidden and the (kv) heads over {grid.cols}", fix)]


def grid_sizes(model: nn.Module) -> tuple[list[tuple[str, int]], list[tuple[str, int]], set[str]]:
    """What must divide by the rows and by the columns: ``(by_rows, by_cols, kinds found)``, each size with a
    name a user knows (``heads 9``, ``features 192``)."""
    modules = dict(model.named_modules())
    by_rows: list[tuple[str, int]] = []
    by_cols: list[tuple[str, int]] = []
    found: set[str] = set()
    for fqn in block_units(model, pipeline_units(model)):
        # Per-head norms (Qwen3's q/k norms) act on whole heads, their weight whole on every rank: nothing to split.
        per_head = {id(module.get_submodule(p.rpartition(".")[0])) for module in modules[fqn].modules()
                    for p in getattr(module, "head_parameters", ())}
        for module in modules[fqn].modules():
            if id(module) in per_head:
                found.add("qk_norm")
            elif isinstance(module, nn.Linear):
                by_rows.append(("input features", module.in_features))
                by_cols.append(("output features", module.out_features))
                found.add("linear")
            elif isinstance(module, nn.RMSNorm) and module.weight is not None and module.weight.dim() == 1:
                by_cols.append(("hidden", module.weight.shape[0]))
            names, head_dim = getattr(module, "_names", None), getattr(module, "head_dim", None)
            if names is not None and head_dim:
                by_cols.append(("heads", getattr(module, names.q).out_features // head_dim))
                by_cols.append(("kv heads", getattr(module, names.k).out_features // head_dim))
    return by_rows, by_cols, found


def grid_fix(cfg: RunConfig, side: int) -> str:
    """The fix for a grid too small or too large for the model: the square grid of ``side``. With a 2.5-D depth
    the smallest run that works comes first: depth 1 (Tesseract with one layer is the 2-D grid, still on the
    depth axis, so the preset's dims stay as they are), then the depth the user chose."""
    assert cfg.parallel is not None and cfg.parallel.grid_parallel is not None, "a grid's fix"
    grid = cfg.parallel.grid_parallel
    fix = f"use a square grid of side {side}, which splits them: "
    depth = cfg.axis_size(grid.depth) if grid.depth is not None else 1
    if depth == 1:
        return fix + grid_mesh(cfg, side)
    others = cfg.world_size // (depth * cfg.axis_size(grid.rows) * cfg.axis_size(grid.cols))
    return (fix + f"{grid_mesh(cfg, side, depth=1)} ({others * side * side} ranks: one layer of depth), or keep "
            f"the depth of {depth}: {grid_mesh(cfg, side)} ({others * depth * side * side} ranks)")


def grid_mesh(cfg: RunConfig, side: int, *, depth: int | None = None) -> str:
    """``mesh=[...]`` with the grid's rows and cols of ``side`` ranks (and its depth axis of ``depth``, when given),
    the other axes as they are, and a global batch size whose share per batch rank splits over ``side`` rows where
    the config's does not."""
    par = cfg.parallel
    assert par is not None and par.grid_parallel is not None, "a grid's fix"
    grid = par.grid_parallel
    new = {grid.rows: side, grid.cols: side, **({grid.depth: depth} if grid.depth and depth is not None else {})}
    shape = [new.get(name, size) for name, size in zip(par.dims, cfg.mesh_shape)]
    fix = override("mesh", shape)
    dp_size = cfg.dp_size if depth is None or grid.depth is None else \
        cfg.dp_size // cfg.axis_size(grid.depth) * depth  # the depth splits the batch as a dp axis does
    step = dp_size * cfg.train.grad_accum * side
    if cfg.train.global_batch_size % step:
        fix += " " + override("train.global_batch_size", step * max(1, round(cfg.train.global_batch_size / step)))
    return fix


__all__ = ["check_grid", "check_grid_axes", "check_grid_model", "format_path"]
