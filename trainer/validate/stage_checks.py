"""Structure checks of per-stage layouts (``parallel.pipeline.stages``), before the model is built.

With stages, the ``mesh`` is the world's ranks ([N]) and each stage entry places some of them
with its own axes and layout; so the top-level layout keys must be empty, the schedule must run
one stage per rank, every rank must be in exactly one stage (the same number per stage), and each
stage's axes must be used as the top-level ones are (data parallel on its own axes, parameters
placed on the others). Each issue names the path under ``parallel.pipeline.stages[i]``.
"""

from __future__ import annotations

from parallel.errors import ConfigIssue, format_path
from parallel.plan.stages import check_stage_ranks
from trainer.config.schema import RunConfig

ONE_STAGE_SCHEDULES = ("GPipe", "1F1B")


def _plain_shape(cfg: RunConfig) -> tuple[int, ...]:
    """The rank ids' shape when it has an axis per name of parallel.dims, else the world's size."""
    dims = cfg.parallel.dims if cfg.parallel is not None else ()
    return cfg.mesh_shape if len(dims) == len(cfg.mesh_shape) else (cfg.world_size,)


def check_stages(cfg: RunConfig) -> list[ConfigIssue]:
    par = cfg.parallel
    pp = par.pipeline if par is not None else None
    if par is None or pp is None or pp.stages is None or cfg.mesh is None:
        return []  # checks of per-stage layouts: a config without them has none (the mesh's own are elsewhere)
    issues = []
    if not all(isinstance(x, int) for x in cfg.mesh):
        issues.append(ConfigIssue("mesh", "explicit rank ids with parallel.pipeline.stages: the stages already say "
                                  "which ranks hold what", "give the mesh as its shape, "
                                                           f"mesh=[{','.join(map(str, _plain_shape(cfg)))}]"))
    for key in ("data_parallel", "tensor_parallel", "placements", "layouts"):
        if getattr(par, key):
            issues.append(ConfigIssue(f"parallel.{key}", "with parallel.pipeline.stages each stage has its own layout; "
                                      "a top-level one would be ambiguous",
                                      f"move it into each stage that needs it (parallel.pipeline.stages[i].{key})"))
    if pp.schedule not in ONE_STAGE_SCHEDULES or pp.stages_per_rank != 1:
        issues.append(ConfigIssue("parallel.pipeline.schedule", f"{pp.schedule} with stages_per_rank "
                                  f"{pp.stages_per_rank}: per-stage layouts run one stage per rank",
                                  "use parallel.pipeline.schedule=1F1B parallel.pipeline.stages_per_rank=1 (or GPipe)"))
    issues += check_stage_ranks(pp.stages, cfg.world_size)
    for index, stage in enumerate(pp.stages):
        issues += _check_stage_axes(stage, ("parallel", "pipeline", "stages", index))
    return issues


def _check_stage_axes(stage, prefix: tuple) -> list[ConfigIssue]:
    """A stage's axes: unique names; data parallelism on its own axes (hsdp on two); tensor
    parallelism and placements on the others; no Partial parameter."""
    issues = []
    dims = stage.dims

    def unknown(path: str, name: str) -> ConfigIssue:
        return ConfigIssue(path, f"axis {name!r} is not one of this stage's dims {dims}",
                           f"use one of {dims} or add it to {format_path(*prefix, 'dims')}")

    for i, name in enumerate(dims):
        if not name.isidentifier() or dims.index(name) != i:
            issues.append(ConfigIssue(format_path(*prefix, "dims", i), f"{name!r} is not a valid, unique axis name",
                                      "give every axis of the stage its own short identifier, e.g. dp, tp"))
    dp_axes: list[str] = []
    if dp := stage.data_parallel:
        dp_axes = dp.dim_names
        want = 2 if dp.mode == "hsdp" else 1
        path = format_path(*prefix, "data_parallel", "dim")
        if len(dp_axes) != want or len(set(dp_axes)) != len(dp_axes):
            issues.append(ConfigIssue(path, f"mode {dp.mode} takes {want} different axis name(s), got {dp_axes}",
                                      "give two axes [replicate_axis, shard_axis] for hsdp, else one"))
        issues += [unknown(path, name) for name in dp_axes if name not in dims]
    if tp := stage.tensor_parallel:
        path = format_path(*prefix, "tensor_parallel", "dim")
        if tp.dim not in dims:
            issues.append(unknown(path, tp.dim))
        elif tp.dim in dp_axes:
            issues.append(ConfigIssue(path, f"axis {tp.dim!r} is already the stage's data-parallel axis",
                                      "give tensor parallelism its own axis of the stage"))
    for glob, axes in stage.placements.items():
        for axis, placement in axes.items():
            path = format_path(*prefix, "placements", glob, axis)
            if axis not in dims:
                issues.append(unknown(path, axis))
            elif axis in dp_axes:
                issues.append(ConfigIssue(path, f"axis {axis!r} is the stage's data-parallel axis; parameters are "
                                          "placed on it by its data_parallel", "place parameters only on "
                                                                               "the other axes"))
            elif placement.kind == "partial":
                issues.append(ConfigIssue(path, f"{placement} on a parameter: a parameter's value must be whole",
                                          "use Shard(d) or Replicate; put Partial in the stage's layouts outputs"))
    for glob, layout in stage.layouts.items():
        for side in ("input", "output"):
            for axis in getattr(layout, side) or {}:
                if axis not in dims:
                    issues.append(unknown(format_path(*prefix, "layouts", glob, side, axis), axis))
    return issues
