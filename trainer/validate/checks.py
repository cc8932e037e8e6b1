"""Validate a resolved config before any worker starts.

Three layers, all run by :func:`validate_config`:

1. schema: pydantic (types, ranges, enums, unknown keys) -> :class:`~parallel.errors.ConfigIssue` s
   (:mod:`trainer.validate.schema_issues`);
2. structure: mesh vs dims, which axis does what, schedules, batch arithmetic;
3. model-aware (:mod:`trainer.validate.model_checks`): the model is built on the meta device and every
   placement, boundary and head count is checked against its real parameters.

Every issue names the config path, the reason and a fix; all issues are reported at once.
``+parallel=auto`` is resolved before validation (:func:`trainer.planner.auto.plan.resolve_and_validate`),
so validation never starts the planner.
"""

from __future__ import annotations

import os
import shutil
from typing import Any
from urllib.parse import urlsplit

from pydantic import ValidationError

from parallel.config import INTERLEAVED_SCHEDULES, SPLIT_BACKWARD_SCHEDULES
from parallel.topology import mesh_shape_of
from parallel.errors import ConfigError, ConfigIssue, format_path
from parallel.plan.spec import ParallelPlan
from trainer.config.schema import RunConfig
from trainer.validate.context_checks import check_context
from trainer.validate.cube_checks import check_cube, cube_axes
from trainer.validate.expert_checks import check_experts
from trainer.validate.grid_checks import check_grid, check_grid_axes
from trainer.validate.hardware_checks import check_hardware, plans_elsewhere
from trainer.validate.launch_checks import check_launch
from trainer.validate.model_checks import check_against_model
from trainer.validate.schema_issues import schema_issues
from trainer.validate.stage_checks import check_stages
from trainer.validate.weights_checks import check_init_from


def validate_config(raw: dict[str, Any], *, check_model: bool = True) -> RunConfig:
    """Turn a plain dict into a frozen :class:`RunConfig`, or raise :class:`ConfigError`."""
    return validate_with_plan(raw, check_model=check_model)[0]


def validate_with_plan(raw: dict[str, Any], *, check_model: bool = True) -> tuple[RunConfig, ParallelPlan | None]:
    """:func:`validate_config` and the parallel plan it resolved on the way (None without ``check_model``)."""
    if not isinstance(raw, dict):
        raise ConfigError([ConfigIssue("<root>", f"expected a mapping, got {type(raw).__name__}", "pass a YAML mapping")])
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(schema_issues(err, raw)) from None
    issues = _check_mesh(cfg.mesh, cfg.parallel)
    if issues:  # every later check reads the mesh's shape
        raise ConfigError(issues)
    axis_issues = _check_axes(cfg)
    issues = axis_issues + _check_run(cfg)
    plan = None
    if check_model and not axis_issues:  # the plan is read along the axes: they must hold first
        plan, model_issues = check_against_model(cfg, predict_memory=not issues)
        issues += model_issues
    if issues:
        raise ConfigError(issues)
    return cfg, plan


# --------------------------------------------------------------------- structure


def check_structure(cfg: RunConfig) -> list[ConfigIssue]:
    """Cross-field checks that need no model: mesh, axes, schedules, batch arithmetic."""
    return _check_mesh(cfg.mesh, cfg.parallel) or _check_axes(cfg) + _check_run(cfg)


def _check_axes(cfg: RunConfig) -> list[ConfigIssue]:
    """The mesh's axes and who uses them (data parallel, pipeline, placements, stages): what the
    model's plan is resolved along, so model checks wait for these (and only these) issues."""
    issues = _check_parallel(cfg)
    if cfg.stages:
        issues += check_stages(cfg)
    return issues


def _check_run(cfg: RunConfig) -> list[ConfigIssue]:
    """Checks independent of the axes' roles: batch arithmetic, launch, seeds, checkpoints, compile."""
    issues = []
    par = cfg.parallel
    if par is None or (cfg.mesh is not None and len(par.dims) == len(cfg.mesh_shape)):
        issues += _check_batch(cfg)  # axis sizes (dp size) are only defined once dims match the mesh
    issues += _check_misc(cfg) + check_context(cfg) + check_experts(cfg) + check_grid(cfg) + check_cube(cfg)
    if cfg.train.compile:
        issues += _check_compile(cfg)
    return issues


def _check_mesh(mesh: Any, par: Any) -> list[ConfigIssue]:
    if mesh is None:
        return []
    # the example fix has one size per axis the layout names (two without a layout), so it runs as printed
    example = f"mesh=[{','.join(['2'] * (len(par.dims) if par is not None else 2))}]"
    if not mesh:
        return [ConfigIssue("mesh", "is empty", f"give one size per axis, e.g. {example}, or null for one device")]
    if not any(isinstance(x, list) for x in mesh):  # a shape: one size per axis
        issues = []
        for i, x in enumerate(mesh):
            if isinstance(x, bool) or not isinstance(x, int):
                issues.append(ConfigIssue(format_path("mesh", i), f"axis size must be an int, got {x!r}",
                                          f"give one positive int per axis, e.g. {example}"))
            elif x < 1:
                issues.append(ConfigIssue(format_path("mesh", i), f"axis size must be >= 1, got {x}", "use a positive size"))
        return issues
    return _check_rank_ids(mesh)


def _check_rank_ids(mesh: list) -> list[ConfigIssue]:
    """Explicit rank ids: a rectangular nested list holding each of 0..n-1 once, in any order (an
    id names the device a worker binds to, not its torch rank: see :mod:`parallel.mesh`)."""
    shape = mesh_shape_of(mesh)
    flat: list[Any] = []

    def walk(node: Any, depth: int, path: tuple) -> str | None:
        if depth == len(shape):
            if not isinstance(node, int) or isinstance(node, bool):
                return f"{format_path('mesh', *path)} is {node!r}, expected a rank id (int)"
            flat.append(node)
            return None
        if not isinstance(node, list) or len(node) != shape[depth]:
            return f"{format_path('mesh', *path)} has {len(node) if isinstance(node, list) else 'no'} entries, expected {shape[depth]}"
        for i, child in enumerate(node):
            if problem := walk(child, depth + 1, (*path, i)):
                return problem
        return None

    if problem := walk(mesh, 0, ()):
        return [ConfigIssue("mesh", f"explicit rank ids must form a rectangular nested list: {problem}",
                            "write every row with the same length, e.g. [[2,4,5],[0,1,3]]")]
    n = len(flat)
    if n == 0:
        return [ConfigIssue("mesh", f"explicit rank ids {mesh} hold no rank id: the mesh would have 0 devices",
                            "give at least one rank id per row, e.g. [[0,1],[2,3]], or null for one device")]
    if sorted(flat) != list(range(n)):
        return [ConfigIssue("mesh", f"explicit rank ids {sorted(flat)} are not each of 0..{n - 1} exactly once",
                            f"use every rank id from 0 to {n - 1} once, in any order")]
    return []


def _check_parallel(cfg: RunConfig) -> list[ConfigIssue]:
    par, shape = cfg.parallel, cfg.mesh_shape
    if par is None:
        if cfg.world_size > 1:
            preset = {1: "+parallel=fsdp", 2: "+parallel=2d", 3: "+parallel=3d"}.get(len(shape))  # one with as many axes
            example = f"e.g. {preset}" if preset else f"one naming {len(shape)} axes"
            return [ConfigIssue("mesh", f"{list(shape)} has {cfg.world_size} devices but there is no parallel section",
                                f"add a preset, {example}, or drop mesh for one device")]
        return []
    if cfg.mesh is None:
        return [ConfigIssue("mesh", "the parallel section needs a mesh",
                            f"set mesh to one size per axis of parallel.dims {par.dims}, "
                            f"e.g. mesh=[{','.join(['2'] * len(par.dims))}]")]
    issues: list[ConfigIssue] = []
    if len(par.dims) != len(shape):
        return [ConfigIssue("parallel.dims", f"names {len(par.dims)} axes {par.dims} but mesh {cfg.mesh} has {len(shape)}",
                            "give one name per mesh axis, or change mesh")]
    for i, name in enumerate(par.dims):
        if not name.isidentifier():
            issues.append(ConfigIssue(format_path("parallel", "dims", i), f"{name!r} is not a valid axis name",
                                      "use a short identifier such as dp, pp, tp"))
        if par.dims.index(name) != i:
            issues.append(ConfigIssue(format_path("parallel", "dims", i), f"axis name {name!r} is used twice",
                                      "give every mesh axis its own name"))
    role: dict[str, str] = {}
    if dp := par.data_parallel:
        names = dp.dim_names
        want = 2 if dp.mode == "hsdp" else 1
        if len(names) != want:
            fix = ("give two axes: dim: [replicate_axis, shard_axis]" if dp.mode == "hsdp"
                   else "give one axis name, or use mode: hsdp for two")
            issues.append(ConfigIssue("parallel.data_parallel.dim", f"mode {dp.mode} takes {want} axis name(s), got {names}", fix))
        elif len(set(names)) != len(names):
            issues.append(ConfigIssue("parallel.data_parallel.dim", f"names axis {names[0]!r} twice: {names}",
                                      "give two different axes: dim: [replicate_axis, shard_axis]"))
        for name in names:
            if name not in par.dims:
                issues.append(_unknown_axis("parallel.data_parallel.dim", name, par.dims))
            role[name] = "data_parallel"
    if pp := par.pipeline:
        issues += _check_own_axis("pipeline", pp.dim, par.dims, role, "the pipeline")
        role[pp.dim] = "pipeline"
        issues += _check_schedule(pp, cfg.pp_size)  # the plan's stage split reads stages_per_rank
    if cp := par.context_parallel:
        issues += _check_own_axis("context_parallel", cp.dim, par.dims, role, "context parallelism")
        role[cp.dim] = "context_parallel"
    if tp := par.tensor_parallel:
        issues += _check_own_axis("tensor_parallel", tp.dim, par.dims, role, "tensor parallelism")
    if ep := par.expert_parallel:
        issues += _check_own_axis("expert_parallel", ep.dim, par.dims, role, "expert parallelism")
        role[ep.dim] = "expert_parallel"
    if par.grid_parallel is not None:
        issues += check_grid_axes(par, role)
    issues += _check_placements(par, role)
    used = set(role) | {a for p in par.placements.values() for a in p}
    used |= {par.tensor_parallel.dim} if par.tensor_parallel else set()
    used |= set(cube_axes(cfg))
    used |= {a for lay in par.layouts.values() for side in (lay.input, lay.output) if side for a in side}
    for name, size in zip(par.dims, shape):
        if size > 1 and name not in used:
            issues.append(ConfigIssue(format_path("parallel", "dims", par.dims.index(name)),
                                      f"axis {name!r} of size {size} is used by nothing (no data_parallel, pipeline, "
                                      "context_parallel, tensor_parallel, expert_parallel, grid_parallel or placement "
                                      "names it)",
                                      "name it in data_parallel, pipeline, context_parallel, tensor_parallel, "
                                      "expert_parallel or placements, or set its mesh size to 1"))
    return issues


def _check_own_axis(section: str, axis: str, dims: list[str], role: dict[str, str], what: str) -> list[ConfigIssue]:
    """``parallel.<section>.dim`` names an axis of the mesh that no other role has taken."""
    path = f"parallel.{section}.dim"
    if axis not in dims:
        return [_unknown_axis(path, axis, dims)]
    if axis in role:
        taken = "already the data-parallel axis" if role[axis] == "data_parallel" else f"the {role[axis]} axis"
        return [ConfigIssue(path, f"axis {axis!r} is {taken}", f"give {what} its own mesh axis")]
    return []


def _unknown_axis(path: str, name: str, dims: list[str]) -> ConfigIssue:
    return ConfigIssue(path, f"axis {name!r} is not in parallel.dims {dims}", f"use one of {dims} or add it to parallel.dims")


def _check_placements(par, role: dict[str, str]) -> list[ConfigIssue]:
    issues = []
    for glob, axes in par.placements.items():
        for axis, placement in axes.items():
            path = format_path("parallel", "placements", glob, axis)
            if axis not in par.dims:
                issues.append(_unknown_axis(path, axis, par.dims))
            elif axis in role:
                issues.append(ConfigIssue(path, f"axis {axis!r} is the {role[axis]} axis; parameters are placed on it by "
                                          f"parallel.{role[axis]}", "place parameters only on tensor-parallel axes"))
            elif placement.kind == "partial":
                issues.append(ConfigIssue(path, f"{placement} on a parameter: a parameter's value must be whole, "
                                          "Partial only describes pending reductions of activations",
                                          "use Shard(d) or Replicate here; put Partial in parallel.layouts outputs"))
    for glob, layout in par.layouts.items():
        for side in ("input", "output"):
            for axis in getattr(layout, side) or {}:
                if axis not in par.dims:
                    issues.append(_unknown_axis(format_path("parallel", "layouts", glob, side, axis), axis, par.dims))
    return issues


def _check_schedule(pp, pp_size: int) -> list[ConfigIssue]:
    issues = []
    spr, name = pp.stages_per_rank, pp.schedule
    if name in INTERLEAVED_SCHEDULES and spr < 2:
        issues.append(ConfigIssue("parallel.pipeline.stages_per_rank", f"{name} interleaves stages, needs >= 2, got {spr}",
                                  "set parallel.pipeline.stages_per_rank=2, or use parallel.pipeline.schedule=1F1B"))
    elif name == "ZBV" and spr != 2:
        issues.append(ConfigIssue("parallel.pipeline.stages_per_rank", f"ZBV places exactly 2 stages per rank (a V), got {spr}",
                                  "set parallel.pipeline.stages_per_rank=2"))
    elif name in ("GPipe", "1F1B") and spr != 1:
        issues.append(ConfigIssue("parallel.pipeline.stages_per_rank", f"{name} runs one stage per rank, got {spr}",
                                  "set parallel.pipeline.stages_per_rank=1, or use "
                                  "parallel.pipeline.schedule=Interleaved1F1B for several"))
    if name != "GPipe" and pp.microbatches < pp_size:
        issues.append(ConfigIssue("parallel.pipeline.microbatches",
                                  f"{name} needs at least one micro-batch per pipeline rank: {pp.microbatches} < pp size {pp_size}",
                                  f"set parallel.pipeline.microbatches={pp_size} or more "
                                  "(a multiple of it keeps the bubble small)"))
    if name in INTERLEAVED_SCHEDULES + ("ZBV",) and pp.microbatches % pp_size:
        issues.append(ConfigIssue("parallel.pipeline.microbatches",
                                  f"{name} needs microbatches divisible by the pp size {pp_size}, got {pp.microbatches}",
                                  f"use a multiple of {pp_size}, e.g. "
                                  f"parallel.pipeline.microbatches={pp_size * max(1, round(pp.microbatches / pp_size))}"))
    return issues


def _check_batch(cfg: RunConfig) -> list[ConfigIssue]:
    t = cfg.train
    split = cfg.dp_size * cfg.num_microbatches * t.grad_accum
    if t.global_batch_size % split:
        good = split * max(1, round(t.global_batch_size / split))
        return [ConfigIssue("train.global_batch_size",
                            f"{t.global_batch_size} sequences do not split evenly into dp size {cfg.dp_size} x "
                            f"microbatches {cfg.num_microbatches} x grad_accum {t.grad_accum} = {split}",
                            f"use a multiple of {split}, e.g. train.global_batch_size={good}")]
    return []


def _check_misc(cfg: RunConfig) -> list[ConfigIssue]:
    issues = check_launch(cfg) + _check_ui_url(cfg.tracking.ui_url)
    for path, seed in (("train.seed", cfg.train.seed), ("data.seed", getattr(cfg.data, "seed", 0))):
        if not -(2**63) <= seed < 2**64:  # torch's manual_seed range: training seeds torch with it
            issues.append(ConfigIssue(path, f"{seed} does not fit in 64 bits",
                                      f"use a seed from 0 to 2**63 - 1, e.g. {path}=0"))
    issues += check_init_from(cfg.train.init_from)
    ckpt = cfg.train.checkpoint
    if ckpt.every > cfg.train.steps:
        issues.append(ConfigIssue("train.checkpoint.every", f"{ckpt.every} is more than train.steps {cfg.train.steps}; "
                                  "no checkpoint would ever be written",
                                  f"use every <= steps, e.g. train.checkpoint.every={cfg.train.steps}, "
                                  "or train.checkpoint.every=0 to disable"))
    issues += check_hardware(cfg)
    if cfg.device == "cuda" and not plans_elsewhere(cfg):  # a plan for a GPU profile needs no GPU here
        import torch

        if not torch.cuda.is_available():
            issues.append(ConfigIssue("device", "cuda requested but no CUDA device is visible", "use device=cpu or device=auto"))
        elif cfg.world_size > torch.cuda.device_count() * cfg.launch.nnodes:
            issues.append(ConfigIssue("mesh", f"{cfg.world_size} workers but only {torch.cuda.device_count()} GPUs per host",
                                      "use a smaller mesh or more hosts (launch.nnodes)"))
    return issues


def _check_ui_url(url: str | None) -> list[ConfigIssue]:
    """``tracking.ui_url`` is a web address the printed run links start with (and its port the one
    the printed ``mlflow ui`` command serves on)."""
    if url is None:
        return []
    try:
        parts = urlsplit(url)
        usable = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # a port that is not a number, or out of range
        usable = False
    if usable:
        return []
    return [ConfigIssue("tracking.ui_url", f"{url!r} is not an http(s) URL with a host (and a port from 1 to 65535)",
                        "write it as a URL, e.g. tracking.ui_url=http://127.0.0.1:5000, or tracking.ui_url=null "
                        "(links to the tracking server, or to http://127.0.0.1:5000 for a local store)")]


def _check_compile(cfg: RunConfig) -> list[ConfigIssue]:
    """``train.compile=true``: a C++ compiler for Inductor, and no zero-bubble pipeline schedule."""
    issues = [issue] if (issue := _check_cxx()) else []
    pp = cfg.parallel.pipeline if cfg.parallel else None
    if pp is not None and pp.schedule in SPLIT_BACKWARD_SCHEDULES:
        issues.append(ConfigIssue(
            "train.compile", f"torch.compile does not compose with parallel.pipeline.schedule {pp.schedule}: a zero-bubble "
            "schedule splits each backward into an input-gradient and a weight-gradient pass, but a compiled block is one "
            "autograd node, so the weight pass re-runs its whole backward; and in torch 2.13 the graph retained for it can get "
            "wrong gradients (Inductor's FX graph cache may serve a backward compiled with donated buffers, which "
            "overwrites the saved activations)",
            "to compile, use parallel.pipeline.schedule=Interleaved1F1B, or "
            "parallel.pipeline.schedule=1F1B parallel.pipeline.stages_per_rank=1; "
            "or set train.compile=false"))
    return issues


def _check_cxx() -> ConfigIssue | None:
    """Inductor compiles C++ on CPU with ``$CXX`` when set, else ``g++`` (nothing else; see
    ``torch._inductor.cpp_builder.get_cpp_compiler``): one of them must be on PATH. Only
    ``shutil.which``: validation imports nothing of torch for this."""
    if cxx := os.environ.get("CXX"):
        if shutil.which(cxx) is None:
            return ConfigIssue("train.compile", f"torch.compile (Inductor) needs a C++ compiler: $CXX is {cxx!r}, "
                               "which is not an executable on PATH",
                               "point CXX at an installed C++ compiler (or unset it to use g++), or set train.compile=false")
        return None
    if shutil.which("g++") is not None:
        return None
    others = [name for name in ("c++", "clang++") if shutil.which(name)]
    if others:
        return ConfigIssue("train.compile", f"torch.compile (Inductor) looks for $CXX, else g++; $CXX is unset and "
                           f"there is no g++ on PATH (found {', '.join(others)})",
                           f"export CXX={others[0]} before launching, or set train.compile=false")
    return ConfigIssue("train.compile", "torch.compile (Inductor) needs a C++ compiler on CPU; none was found "
                       "($CXX is unset; no g++, c++ or clang++ on PATH)",
                       "install a C++ compiler, e.g. apt-get install g++, or set train.compile=false")
