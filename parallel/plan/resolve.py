"""The parallel plan: what a config's ``mesh`` and ``parallel`` sections mean for one model.

:func:`resolve_plan` is the one place where the user's words meet the model: placement and
layout globs are matched against the model's parameter and module names, ``boundaries: auto``
becomes a stage split, and everything that matching can find wrong is reported as
:class:`~parallel.errors.ConfigIssue` s (path, reason, fix). Validation, the dry-run plan and
the engine all use its result, so they cannot disagree:

    plan = resolve_plan(cfg.parallel, cfg.mesh, build_model(cfg.model, device="meta"))
    plan.placements["layers.0.attn.wq.weight"]     # {"tp": Shard(0)}
    plan.pipeline.stage_units                       # (("tok_embeddings", "layers.0", "layers.1"), ...)
    pm = parallelize(model, plan, device=torch.device("cpu"))

A plan holds names, shapes and placements only (no process group, no tensors); it is built in
a few milliseconds from a model on the meta device.
"""


from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

from torch import nn

from parallel.config import ParallelConfig, mesh_rank_ids, mesh_shape_of
from parallel.errors import ConfigError, ConfigIssue
from parallel.plan.cube import resolve_cube
from parallel.plan.layout import resolve_layout
from parallel.plan.spec import (AxisSpecs, ContextParallelSpec, DataParallelSpec, ExpertParallelSpec, GlobCheck,
                                 GridSpec, LayoutSpec, ParallelPlan, PipelineSpec)
from parallel.plan.stages import resolve_stages
from parallel.plan.units import block_units, check_boundaries, pipeline_units, stage_boundaries, stage_ranks
from parallel.topology import MeshSpec


def resolve_plan(parallel: ParallelConfig | None, mesh: Any, model: nn.Module, *,
                 check_glob: GlobCheck | None = None, layout_cache: dict[Any, Any] | None = None) -> ParallelPlan:
    """The plan of ``parallel`` on ``mesh`` (a shape or nested rank ids) for ``model`` (any
    device, ``meta`` included); raises :class:`ConfigError` with every issue found.

    ``check_glob`` adds what only the model's owner knows (the trainer checks that attention
    globs split whole heads); it runs on every placements glob that matched, beside the
    engine's own checks, so all issues are reported together. ``layout_cache``: a dict a caller
    resolving many meshes of one model and ``check_glob`` keeps (the auto-planner): the matched
    placements and layouts, the costly part, found once for every mesh that agrees on them."""
    units = tuple(pipeline_units(model))
    blocks = tuple(block_units(model, units))
    if parallel is None:
        return ParallelPlan(units=units, blocks=blocks)
    mesh_spec = MeshSpec(mesh_shape_of(mesh), tuple(parallel.dims), mesh_rank_ids(mesh))
    if parallel.pipeline is not None and parallel.pipeline.stages:
        return resolve_stages(parallel, mesh_spec, model, units=units, blocks=blocks, check_glob=check_glob)
    issues: list[ConfigIssue] = []
    placements, layouts, loss_parallel = _resolve_layout(parallel, mesh_spec, model, issues, check_glob, layout_cache)
    issues += check_boundaries(parallel, mesh_spec, units)
    experts = _expert_parallel_spec(parallel, model, issues)
    cube = resolve_cube(parallel, mesh_spec, model, issues)
    if issues:
        raise ConfigError(issues)
    dp, cp = parallel.data_parallel, parallel.context_parallel
    return ParallelPlan(
        mesh=mesh_spec,
        units=units,
        blocks=blocks,
        data_parallel=DataParallelSpec(dp.mode, tuple(dp.dim_names)) if dp else None,
        pipeline=_pipeline_spec(parallel, mesh_spec, model, units),
        context_parallel=ContextParallelSpec(cp.dim, cp.method) if cp else None,
        placements=MappingProxyType(placements),
        layouts=MappingProxyType(layouts),
        activation_checkpointing=parallel.activation_checkpointing,
        activation_checkpointing_every=parallel.activation_checkpointing_every,
        loss_parallel=loss_parallel,
        expert_parallel=experts,
        grid=GridSpec(grid.rows, grid.cols, grid.depth) if (grid := parallel.grid_parallel) is not None else None,
        cube=cube,
    )


def _resolve_layout(parallel: ParallelConfig, mesh: MeshSpec, model: nn.Module, issues: list[ConfigIssue],
                    check_glob: GlobCheck | None, cache: dict[Any, Any] | None
                    ) -> tuple[dict[str, AxisSpecs], dict[str, LayoutSpec], bool]:
    """:func:`resolve_layout` of the parallel section, its answer and issues kept in ``cache`` by all it reads:
    the section's placements, layouts and tensor-parallel plan, and of the mesh only the sizes of the axes
    those name (the shards' and heads' divisibility, the vocabulary's split)."""
    if cache is None:
        return resolve_layout(parallel, ("parallel",), mesh, model, issues, check_glob=check_glob)
    tp = parallel.tensor_parallel
    axes = {a for by_axis in parallel.placements.values() for a in by_axis} | ({tp.dim} if tp is not None else set())
    key = (parallel.model_dump_json(include={"placements", "layouts", "tensor_parallel"}),
           tuple(sorted((a, a in mesh.dim_names, mesh.size(a)) for a in axes)))
    if key not in cache:
        found: list[ConfigIssue] = []
        cache[key] = (*resolve_layout(parallel, ("parallel",), mesh, model, found, check_glob=check_glob), found)
    placements, layouts, loss_parallel, found = cache[key]
    issues += found
    return placements, layouts, loss_parallel


def _expert_parallel_spec(parallel: ParallelConfig, model: nn.Module,
                          issues: list[ConfigIssue]) -> ExpertParallelSpec | None:
    """The model's modules of stacked experts, as its ``expert_modules()`` names them (a method of its
    root module, like the named tensor-parallel plans); a model without experts cannot use the axis."""
    ep = parallel.expert_parallel
    if ep is None:
        return None
    provider = getattr(model, "expert_modules", None)
    modules = tuple(provider()) if provider is not None else ()
    if not modules:
        issues.append(ConfigIssue("parallel.expert_parallel", f"model {type(model).__name__} has no experts to split "
                                  f"over axis {ep.dim!r} (a mixture-of-experts model names its stacked experts)",
                                  "use a mixture-of-experts model, e.g. model=gpt_moe, or remove the ep axis "
                                  "(a preset without parallel.expert_parallel)"))
        return None
    return ExpertParallelSpec(ep.dim, modules)



def _pipeline_spec(parallel: ParallelConfig, mesh: MeshSpec, model: nn.Module,
                   units: Sequence[str]) -> PipelineSpec | None:
    pp = parallel.pipeline
    if pp is None:
        return None
    pp_size = mesh.size(pp.dim)
    num_stages = pp_size * pp.stages_per_rank
    groups = stage_boundaries(model, boundaries=pp.boundaries, num_stages=num_stages, units=units)
    return PipelineSpec(
        dim=pp.dim,
        schedule=pp.schedule,
        num_microbatches=pp.microbatches,
        stages_per_rank=pp.stages_per_rank,
        stage_units=tuple(tuple(g) for g in groups),
        stage_ranks=tuple(stage_ranks(num_stages, pp_size, schedule=pp.schedule)),
    )
