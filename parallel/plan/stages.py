"""Per-stage layouts: ``parallel.pipeline.stages`` resolved into one plan per stage.

A pipeline stage may name its own ranks, axes and layout, as OneFlow's and PaddlePaddle's
examples do (stage 0 data parallel on ranks 0-1, stage 1 tensor parallel on ranks 2-3)::

    parallel:
      dims: [pp]                      # mesh: [4] -- the world; the stages place its ranks
      pipeline:
        dim: pp
        boundaries: [w1]
        stages:
          - {ranks: [0, 1], dims: [dp], data_parallel: {dim: dp, mode: ddp}}
          - {ranks: [2, 3], dims: [tp], placements: {w1: {tp: Shard(1)}}}

A stage may also split its sequences over an axis of its own (``context_parallel: {dim: cp}``) or its
blocks' experts (``expert_parallel: {dim: ep}``): the stage's plan then holds its
:class:`~parallel.plan.spec.ContextParallelSpec` (the stage must hold an attention that takes a split
sequence) or its :class:`~parallel.plan.spec.ExpertParallelSpec` of the expert modules it holds.

Every stage has the same number of ranks ``k``. The ``i``-th rank of every stage (row-major)
forms *lane* ``i``: torch's pipeline schedule runs along each lane, one rank per stage, and an
activation crosses a boundary as lane ``i``'s share of the micro-batch (its ``i``-th row block,
:mod:`parallel.pipeline.stage_io`). So the data loader sees ``k`` data-parallel ranks, one per lane.

:func:`resolve_stages` matches each stage's globs against that stage's parameters and modules
only (a glob naming another stage's parameter is an issue), checks the ranks, and returns the
top-level :class:`~parallel.plan.spec.ParallelPlan` whose ``pipeline.stages`` hold a
:class:`~parallel.plan.spec.StagePlan` each.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType

import torch
from torch import nn

from parallel.config import ParallelConfig, StageConfig
from parallel.errors import ConfigError, ConfigIssue, format_path, override, override_key
from parallel.plan.layout import resolve_layout
from parallel.plan.spec import (ContextParallelSpec, DataParallelSpec, ExpertParallelSpec, GlobCheck, ParallelPlan,
                                 PipelineSpec, StagePlan, owning_unit)
from parallel.plan.units import check_boundaries, stage_boundaries
from parallel.topology import MeshSpec


def resolve_stages(parallel: ParallelConfig, mesh: MeshSpec, model: nn.Module, *, units: Sequence[str],
                   blocks: Sequence[str], check_glob: GlobCheck | None = None) -> ParallelPlan:
    """The plan of a config whose ``parallel.pipeline.stages`` give each stage its ranks and
    layout; raises :class:`ConfigError` with every issue found."""
    pp = parallel.pipeline
    assert pp is not None and pp.stages is not None, "resolve_plan calls it for a pipeline with stages"
    issues = check_stage_ranks(pp.stages, mesh.world_size)
    issues += check_boundaries(parallel, mesh, units, num_stages=len(pp.stages))
    if issues:
        raise ConfigError(issues)
    groups = stage_boundaries(model, boundaries=pp.boundaries, num_stages=len(pp.stages), units=units)
    stage_plans = []
    for index, (stage, group) in enumerate(zip(pp.stages, groups)):
        prefix = ("parallel", "pipeline", "stages", index)
        names = {name for name, _ in [*model.named_parameters(), *model.named_modules()]
                 if owning_unit(name, group) is not None}
        stage_mesh = MeshSpec(stage.shape, tuple(stage.dims))
        found: list[ConfigIssue] = []
        placements, layouts, loss_parallel = resolve_layout(stage, prefix, stage_mesh, model, found,
                                                            check_glob=check_glob, only=names)
        issues += found
        dp = stage.data_parallel
        layout = ParallelPlan(
            mesh=stage_mesh, units=tuple(units), blocks=tuple(blocks),
            data_parallel=DataParallelSpec(dp.mode, tuple(dp.dim_names)) if dp else None,
            context_parallel=_stage_context(stage, prefix, model, names, issues),
            expert_parallel=_stage_experts(stage, prefix, model, names, issues),
            placements=MappingProxyType(placements), layouts=MappingProxyType(layouts),
            loss_parallel=loss_parallel,
            activation_checkpointing=parallel.activation_checkpointing,
            activation_checkpointing_every=parallel.activation_checkpointing_every,
        )
        stage_plans.append(StagePlan(rank_ids=stage.ranks, layout=layout))
    if issues:
        raise ConfigError(issues)
    return ParallelPlan(
        mesh=mesh, units=tuple(units), blocks=tuple(blocks),
        pipeline=PipelineSpec(dim=pp.dim, schedule=pp.schedule, num_microbatches=pp.microbatches, stages_per_rank=1,
                              stage_units=tuple(tuple(g) for g in groups), stage_ranks=tuple(range(len(groups))),
                              stages=tuple(stage_plans)),
        activation_checkpointing=parallel.activation_checkpointing,
        activation_checkpointing_every=parallel.activation_checkpointing_every,
    )


def _stage_context(stage: StageConfig, prefix: tuple[object, ...], model: nn.Module, names: set[str],
                   issues: list[ConfigIssue]) -> ContextParallelSpec | None:
    """The stage's context parallelism; a stage naming it but holding no module that attends over a split
    sequence (one declaring ``context_parallel``: the decoders' attention) is an issue."""
    cp = stage.context_parallel
    if cp is None:
        return None
    if not any(hasattr(module, "context_parallel") for name, module in model.named_modules() if name in names):
        issues.append(ConfigIssue(format_path(*prefix, "context_parallel"),
                                  f"this stage holds no module of {type(model).__name__} that attends over a split "
                                  "sequence (the Llama-family decoders' attention does)",
                                  f"{override(override_key(*prefix, 'context_parallel'), None)}, or move the "
                                  "boundaries so that the stage holds attention blocks"))
        return None
    return ContextParallelSpec(cp.dim, cp.method)



def _stage_experts(stage: StageConfig, prefix: tuple[object, ...], model: nn.Module, names: set[str],
                   issues: list[ConfigIssue]) -> ExpertParallelSpec | None:
    """The stage's modules of stacked experts (of the model's ``expert_modules()``, those this stage holds),
    split over its ``expert_parallel`` axis; a stage naming the axis but holding no experts is an issue."""
    ep = stage.expert_parallel
    if ep is None:
        return None
    provider = getattr(model, "expert_modules", None)
    modules = tuple(m for m in (provider() if provider is not None else ()) if m in names)
    if not modules:
        issues.append(ConfigIssue(format_path(*prefix, "expert_parallel"),
                                  f"this stage holds no experts of model {type(model).__name__} to split over axis "
                                  f"{ep.dim!r} (a mixture-of-experts model's blocks hold them)",
                                  f"{override(override_key(*prefix, 'expert_parallel'), None)}, or move the "
                                  "boundaries so that it holds mixture-of-experts blocks"))
        return None
    return ExpertParallelSpec(ep.dim, modules)


def check_stage_ranks(stages: Sequence[StageConfig], world_size: int) -> list[ConfigIssue]:
    """The stages' ranks: a rectangular list per stage with one axis name each, every rank of
    the world in exactly one stage, the same number of ranks per stage (one per lane), and each
    sub-mesh's ranks increasing along every axis (torch orders a process group's ranks so)."""
    issues: list[ConfigIssue] = []
    owner: dict[int, int] = {}
    sizes = []
    for index, stage in enumerate(stages):
        path = format_path("parallel", "pipeline", "stages", index, "ranks")
        rows = stage.ranks if stage.ranks and isinstance(stage.ranks[0], list) else None
        if not stage.ranks or (rows is not None and (len({len(r) for r in rows}) != 1 or not rows[0])):
            issues.append(ConfigIssue(path, f"{stage.ranks} is not a non-empty list, or a rectangular nested "
                                            "list, of ranks",
                                      "give the stage's ranks as [0, 1] or, for a 2-D sub-mesh, [[0, 1], [2, 3]]"))
            continue
        if len(stage.dims) != len(stage.shape):
            issues.append(ConfigIssue(format_path("parallel", "pipeline", "stages", index, "dims"),
                                      f"names {len(stage.dims)} axes {stage.dims} but ranks {stage.ranks} have "
                                      f"{len(stage.shape)}", "give one axis name per axis of the stage's ranks"))
        sizes.append(len(stage.rank_list))
        for rank in stage.rank_list:
            if not 0 <= rank < world_size:
                issues.append(ConfigIssue(path, f"rank {rank} does not exist: the mesh has ranks 0..{world_size - 1}",
                                          f"use ranks below {world_size} (a larger mesh would leave ranks "
                                          "in no stage)"))
            elif rank in owner:
                issues.append(ConfigIssue(path, f"rank {rank} is also in stage {owner[rank]}" if owner[rank] != index
                                          else f"rank {rank} is listed twice", "give every rank to exactly one stage"))
            else:
                owner[rank] = index
        if rows is not None and len(stage.dims) == len(stage.shape):
            ids = torch.tensor(stage.ranks)
            for axis, name in enumerate(stage.dims):
                lines = ids.movedim(axis, -1).reshape(-1, ids.shape[axis])
                if bool((lines[:, 1:] <= lines[:, :-1]).any()):
                    issues.append(ConfigIssue(path, f"the ranks decrease along the stage's axis {name!r}; torch orders "
                                              "every process group's ranks ascending, so shards along it would be "
                                              "gathered out of order", "list the ranks increasing along every axis"))
    if len(set(sizes)) > 1:
        issues.append(ConfigIssue("parallel.pipeline.stages",
                                  f"the stages hold {sizes} ranks; every stage needs the same "
                                  "number, since activations travel along lanes of one rank per stage",
                                  f"give every stage {max(sizes)} ranks (or {min(sizes)})"))
    missing = sorted(set(range(world_size)) - set(owner))
    if missing and not issues:
        issues.append(ConfigIssue("parallel.pipeline.stages", f"ranks {missing} of the mesh's {world_size} "
                                                              "are in no stage",
                                  f"give them to a stage, or use mesh=[{len(owner)}]"))
    return issues
