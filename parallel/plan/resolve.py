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

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from types import MappingProxyType
from typing import Any

from torch import nn

from parallel.config import LayoutConfig, ParallelConfig, flat_ranks, mesh_rank_ids, mesh_shape_of
from parallel.errors import ConfigError, ConfigIssue, format_path
from parallel.mesh import rank_id_of
from parallel.pipeline.schedule import block_units, pipeline_units, stage_boundaries, stage_ranks
from parallel.placements import PlacementSpec, parse_placement

AxisSpecs = Mapping[str, PlacementSpec]
# A model-specific check of one placements glob: (its config path, placements, the FQNs it matched, the mesh
# whose axes the placements name) -> issues.
GlobCheck = Callable[[str, AxisSpecs, list[str], "MeshSpec"], list[ConfigIssue]]


@dataclass(frozen=True)
class MeshSpec:
    """Axis sizes (outermost first), their names, and optional nested explicit rank ids.

    The mesh's positions are torch ranks ``0 .. n-1`` row-major whatever ``rank_ids`` says; a
    rank id (PaddlePaddle's process id) only names the device the worker at that position runs
    on (:func:`parallel.mesh.rank_id_of`)."""

    shape: tuple[int, ...] = (1,)
    dim_names: tuple[str, ...] = ()
    rank_ids: Any = None

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def rank_id(self, rank: int) -> int:
        """The rank id of the worker whose torch rank is ``rank`` (``rank`` itself without explicit ids)."""
        return rank_id_of(self.rank_ids, rank)

    def size(self, names: str | Sequence[str]) -> int:
        """Product of the sizes of the axes ``names`` (an axis the mesh lacks counts 1)."""
        names = [names] if isinstance(names, str) else list(names)
        return math.prod(self.shape[self.dim_names.index(n)] for n in names if n in self.dim_names)


@dataclass(frozen=True)
class DataParallelSpec:
    """``mode`` (ddp | fsdp | zero2 | hsdp) over the mesh axes ``dim_names``."""

    mode: str
    dim_names: tuple[str, ...]

    @property
    def shard_dim_names(self) -> tuple[str, ...]:
        """The axes parameters are sharded over: all dp axes (fsdp, zero2), hsdp's inner one, none for ddp."""
        return {"ddp": (), "hsdp": self.dim_names[-1:]}.get(self.mode, self.dim_names)


@dataclass(frozen=True)
class PipelineSpec:
    """The schedule and the resolved stage split: the units of each stage and its pp rank."""

    dim: str
    schedule: str
    num_microbatches: int
    stages_per_rank: int
    stage_units: tuple[tuple[str, ...], ...]
    stage_ranks: tuple[int, ...]
    # ``parallel.pipeline.stages``: each stage its own ranks and layout (empty: the plan's layout everywhere).
    stages: tuple[StagePlan, ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.stage_units)

    @property
    def boundaries(self) -> list[str]:
        """The first unit of every stage but the first (what ``boundaries: auto`` chose)."""
        return [units[0] for units in self.stage_units[1:]]

    def stages_of(self, pp_rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_ranks) if r == pp_rank]


@dataclass(frozen=True)
class LayoutSpec:
    """A module's input and output placements per mesh axis (unnamed axes: Replicate)."""

    input: AxisSpecs = field(default_factory=dict)
    output: AxisSpecs = field(default_factory=dict)


@dataclass(frozen=True)
class ParallelPlan:
    """Everything the engine needs to spread one model over one mesh, globs already matched.

    Attributes:
        mesh: the mesh; ``(1,)`` means one device.
        units: the model's pieces a pipeline may be cut between, in forward order.
        blocks: the units that are repeated blocks (``layers.0`` ..): FSDP and activation
            checkpointing treat each one as a unit.
        placements: parameter FQN -> ``{axis: placement}`` for every parameter a glob named.
        layouts: module FQN -> its input/output placements.
    """

    mesh: MeshSpec = field(default_factory=MeshSpec)
    units: tuple[str, ...] = ()
    blocks: tuple[str, ...] = ()
    data_parallel: DataParallelSpec | None = None
    pipeline: PipelineSpec | None = None
    placements: Mapping[str, AxisSpecs] = field(default_factory=dict)
    layouts: Mapping[str, LayoutSpec] = field(default_factory=dict)
    activation_checkpointing: str = "none"
    activation_checkpointing_every: int = 2

    @property
    def dp_size(self) -> int:
        return self.mesh.size(self.data_parallel.dim_names) if self.data_parallel else 1

    @property
    def pp_size(self) -> int:
        if self.pipeline is not None and self.pipeline.stages:
            return self.pipeline.num_stages
        return self.mesh.size(self.pipeline.dim) if self.pipeline else 1


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage's own ranks and layout (``parallel.pipeline.stages[i]``).

    ``rank_ids``: the stage's global ranks (a list, or a nested list for a 2-D sub-mesh); its ``i``-th
    rank, row-major, is on lane ``i``
    (every stage has the same number of ranks, so lane ``i`` is one rank of every stage, and
    torch's pipeline schedule runs along it). ``layout``: the stage's plan on its own sub-mesh
    (``layout.mesh``: the shape and axis names of its ``ranks``), with its data parallelism,
    placements and layouts; its parameters are the stage's only."""

    rank_ids: Any  # the stage's global ranks as written: a list, or a nested list (its sub-mesh)
    layout: ParallelPlan

    @property
    def ranks(self) -> tuple[int, ...]:
        """The stage's ranks, row-major: its ``i``-th is on lane ``i``."""
        return tuple(flat_ranks(self.rank_ids))


def resolve_plan(parallel: ParallelConfig | None, mesh: Any, model: nn.Module, *,
                 check_glob: GlobCheck | None = None) -> ParallelPlan:
    """The plan of ``parallel`` on ``mesh`` (a shape or nested rank ids) for ``model`` (any
    device, ``meta`` included); raises :class:`ConfigError` with every issue found.

    ``check_glob`` adds what only the model's owner knows (the trainer checks that attention
    globs split whole heads); it runs on every placements glob that matched, beside the
    engine's own checks, so all issues are reported together."""
    units = tuple(pipeline_units(model))
    blocks = tuple(block_units(model, units))
    if parallel is None:
        return ParallelPlan(units=units, blocks=blocks)
    mesh_spec = MeshSpec(mesh_shape_of(mesh), tuple(parallel.dims), mesh_rank_ids(mesh))
    if parallel.pipeline is not None and parallel.pipeline.stages:
        from parallel.plan.stages import resolve_stages  # each stage its own ranks and layout

        return resolve_stages(parallel, mesh_spec, model, units=units, blocks=blocks, check_glob=check_glob)
    issues: list[ConfigIssue] = []
    placements, layouts = resolve_layout(parallel, ("parallel",), mesh_spec, model, issues, check_glob=check_glob)
    issues += _check_boundaries(parallel, mesh_spec, units)
    if issues:
        raise ConfigError(issues)
    dp = parallel.data_parallel
    return ParallelPlan(
        mesh=mesh_spec,
        units=units,
        blocks=blocks,
        data_parallel=DataParallelSpec(dp.mode, tuple(dp.dim_names)) if dp else None,
        pipeline=_pipeline_spec(parallel, mesh_spec, model, units),
        placements=MappingProxyType(placements),
        layouts=MappingProxyType(layouts),
        activation_checkpointing=parallel.activation_checkpointing,
        activation_checkpointing_every=parallel.activation_checkpointing_every,
    )


def resolve_layout(section: Any, prefix: tuple, mesh: MeshSpec, model: nn.Module, issues: list[ConfigIssue], *,
                   check_glob: GlobCheck | None = None, only: set[str] | None = None
                   ) -> tuple[dict[str, AxisSpecs], dict[str, LayoutSpec]]:
    """``(placements, layouts)`` of one layout section (``parallel``, or a pipeline stage at
    ``prefix`` = ``("parallel", "pipeline", "stages", i)``): the model family's named plan, then the
    explicit globs over it, matched against the model's parameters and modules (only those whose
    names are in ``only``, a stage's, when given: there a family glob may match nothing).
    Problems are appended to ``issues``."""
    params = {name: tuple(p.shape) for name, p in model.named_parameters() if only is None or name in only}
    modules = [name for name, _ in model.named_modules() if name and (only is None or name in only)]
    family_placements, family_layouts = _family_plan(section, prefix, model, issues)
    scope = {"scope": "the model"} if only is None else {"scope": f"this stage ({format_path(*prefix)})"}
    placements = _match_placements(family_placements, mesh, params, issues, check_glob, **scope, required=only is None)
    layouts, layout_paths = _match_layouts(family_layouts, modules, issues, **scope, required=only is None)
    # Explicit globs after the family's: they may re-place what the plan placed (no overlap issue).
    placements.update(_match_placements(
        [(glob, axes, format_path(*prefix, "placements", glob)) for glob, axes in section.placements.items()],
        mesh, params, issues, check_glob, **scope))
    explicit_layouts, explicit_paths = _match_layouts(
        [(glob, layout, format_path(*prefix, "layouts", glob)) for glob, layout in section.layouts.items()],
        modules, issues, **scope)
    layouts.update(explicit_layouts)
    layout_paths.update(explicit_paths)
    if issues:
        return placements, layouts

    from parallel.sharding.tensor_parallel import classify  # classification needs the module types

    for name in classify(model, placements, layouts).unsupported:
        issues.append(ConfigIssue(layout_paths[name],
                                  f"module {name}: only a Shard input of a norm-like module (sequence parallel) or the "
                                  "input/output of a module with DTensor-placed parameters is supported",
                                  "remove this layout, or give the module's parameters placements"))
    return placements, layouts


# ---------------------------------------------------------------------- placements


def _match_glob(section: str, glob: str, path: str, names: list[str], sources: dict[str, str],
                issues: list[ConfigIssue], scope: str = "the model", required: bool = True) -> list[str]:
    """The names ``glob`` (written at ``path``) matches, recorded in ``sources``; a glob matching
    nothing (unless not ``required``), or a name another glob of the same section already took,
    is an issue. ``scope``: whose names ``names`` are, for the message."""
    noun, holds = ("parameter", "placement") if section == "placements" else ("module", "layout")
    matched = [name for name in names if fnmatchcase(name, glob)]
    if not matched and required:
        issues.append(ConfigIssue(path, f"matches no {noun} of {scope}",
                                  f"fix the glob; {noun}s look like {', '.join(names[:4])}, ..."))
    for name in matched:
        if name in sources:
            issues.append(ConfigIssue(path, f"{noun} {name} is also matched by {sources[name]!r}",
                                      f"make the globs disjoint so each {noun} has one {holds}"))
        sources[name] = glob
    return matched


def _match_placements(entries: list[tuple[str, AxisSpecs, str]], mesh: MeshSpec, params: Mapping[str, tuple[int, ...]],
                      issues: list[ConfigIssue], check_glob: GlobCheck | None, **scope) -> dict[str, AxisSpecs]:
    """``entries``: ``(glob, placements, the config path it was written at)``, in order;
    ``scope``: :func:`_match_glob`'s ``scope`` and ``required``."""
    placements: dict[str, AxisSpecs] = {}
    sources: dict[str, str] = {}
    for glob, axes, path in entries:
        found: list[ConfigIssue] = []
        _match_entry(glob, axes, path, mesh, params, placements, sources, found, check_glob, scope)
        if ".tensor_parallel.plan[" in path:  # a named plan is not edited: it is overridden
            section = path.split(".tensor_parallel.plan[")[0]
            found = [ConfigIssue(i.path, i.reason, i.fix.replace(", or Replicate", ", or override it in "
                                                              f"{section}.placements (e.g. Replicate)")) for i in found]
        issues += found
    return placements


def _match_entry(glob: str, axes: AxisSpecs, path: str, mesh: MeshSpec, params: Mapping[str, tuple[int, ...]],
                 placements: dict[str, AxisSpecs], sources: dict[str, str], issues: list[ConfigIssue],
                 check_glob: GlobCheck | None, scope: dict) -> None:
    matched = _match_glob("placements", glob, path, list(params), sources, issues, **scope)
    for fqn in matched:
        placements[fqn] = MappingProxyType(dict(axes))
    # A glob can match parameters of different shapes ("*", GQA's wq/wk): check each shape once.
    first_of_shape: dict[tuple[int, ...], str] = {}
    for fqn in matched:
        first_of_shape.setdefault(params[fqn], fqn)
    reported: set[str] = set()
    for shape, fqn in first_of_shape.items():
        for issue in _check_shards(mesh, path, axes, shape, fqn):
            if issue.path not in reported:  # one issue per (glob, axis) is enough to fix it
                reported.add(issue.path)
                issues.append(issue)
    if check_glob is not None and matched:
        issues += check_glob(path, axes, matched, mesh)


def _check_shards(mesh: MeshSpec, where: str, axes: AxisSpecs, shape: tuple[int, ...], fqn: str) -> list[ConfigIssue]:
    issues = []
    per_dim: dict[int, list[str]] = {}
    for axis, p in axes.items():
        if not p.is_shard:
            continue
        path = f"{where}.{axis}"
        dim = p.dim if p.dim >= 0 else p.dim + len(shape)
        if not 0 <= dim < len(shape):
            issues.append(ConfigIssue(path, f"{p} but parameter {fqn} has {len(shape)} dims (shape {list(shape)})",
                                      f"use {'Shard(0)' if len(shape) == 1 else f'Shard(0) .. Shard({len(shape) - 1})'}, "
                                      "or a glob matching only parameters with more dims"))
            continue
        per_dim.setdefault(dim, []).append(axis)
    for dim, names in per_dim.items():
        n = mesh.size(names)
        size = shape[dim]
        if size % n:
            over = " x ".join(names)
            axes_note = f" ({over})" if len(names) > 1 else ""  # one axis: the path already names it
            issues.append(ConfigIssue(f"{where}.{names[-1]}",
                                      f"Shard({dim}) splits dim {dim} of size {size} over {n} ranks{axes_note}; "
                                      f"{size} is not divisible by {n}",
                                      f"use a {over} size dividing {size}, or Replicate"))
    return issues


# ------------------------------------------------------------------------- layouts


def _match_layouts(entries: list[tuple[str, LayoutConfig, str]], modules: list[str],
                   issues: list[ConfigIssue], **scope) -> tuple[dict[str, LayoutSpec], dict[str, str]]:
    """``(module FQN -> layout, module FQN -> the config path that gave it)``."""
    layouts: dict[str, LayoutSpec] = {}
    paths: dict[str, str] = {}
    sources: dict[str, str] = {}
    for glob, layout, path in entries:
        for name in _match_glob("layouts", glob, path, modules, sources, issues, **scope):
            layouts[name] = LayoutSpec(MappingProxyType(dict(layout.input or {})),
                                       MappingProxyType(dict(layout.output or {})))
            paths[name] = path
    return layouts, paths


# ---------------------------------------------------------------------- named plans


def _family_plan(section: Any, prefix: tuple, model: nn.Module, issues: list[ConfigIssue]) -> tuple[list, list]:
    """The model family's named tensor-parallel plan of a layout section (at ``prefix``) as
    ``(placement entries, layout entries)``, each entry ``(glob, value, path)``; explicit globs
    come after them and override them."""
    tp = section.tensor_parallel
    if tp is None:
        return [], []
    provider = getattr(model, "parallel_plan", None)  # the family's plans: a method of its root module
    if provider is None:
        issues.append(ConfigIssue(format_path(*prefix, "tensor_parallel", "plan"),
                                  f"model {type(model).__name__} provides no named plans",
                                  f"write {format_path(*prefix, 'placements')} globs instead (and drop its tensor_parallel)"))
        return [], []
    placements, layouts = provider(tp.plan, axis=tp.dim, sequence_parallel=tp.sequence_parallel)
    where = f"{format_path(*prefix, 'tensor_parallel', 'plan')}[{tp.plan}]"
    return ([(glob, {axis: parse_placement(p) for axis, p in axes.items()}, f'{where}["{glob}"]')
             for glob, axes in placements.items()],
            [(glob, LayoutConfig.model_validate(layout), f'{where}["{glob}"]') for glob, layout in layouts.items()])


# ------------------------------------------------------------------------ pipeline


def _check_boundaries(parallel: ParallelConfig, mesh: MeshSpec, units: Sequence[str],
                      num_stages: int | None = None) -> list[ConfigIssue]:
    """``num_stages``: given by ``parallel.pipeline.stages``; else pp size x stages per rank."""
    pp = parallel.pipeline
    if pp is None:
        return []
    pp_size = mesh.size(pp.dim)
    stages_given = num_stages is not None
    num_stages = num_stages if stages_given else pp_size * pp.stages_per_rank
    units = list(units)
    if pp.boundaries == "auto":
        if num_stages > len(units):
            return [ConfigIssue("parallel.pipeline.boundaries", f"auto needs {num_stages} stages but the model has only "
                                f"{len(units)} pieces to cut between ({', '.join(units)})",
                                "use a smaller pp size or stages_per_rank, or a deeper model")]
        return []
    issues = []
    positions = []
    for i, name in enumerate(pp.boundaries):
        path = format_path("parallel", "pipeline", "boundaries", i)
        if name not in units:
            issues.append(ConfigIssue(path, f"{name!r} is not a top-level module of the model",
                                      f"use one of {', '.join(units[1:])}"))
        elif units.index(name) == 0:
            issues.append(ConfigIssue(path, f"{name!r} is the first module; it always begins stage 0",
                                      "list only the first module of every later stage"))
        else:
            positions.append(units.index(name))
    if not issues and positions != sorted(set(positions)):
        issues.append(ConfigIssue("parallel.pipeline.boundaries", f"{pp.boundaries} are not in forward order",
                                  "list each boundary once, in the order the model runs them"))
    if len(pp.boundaries) != num_stages - 1:
        issues.append(ConfigIssue("parallel.pipeline.boundaries",
                                  f"{len(pp.boundaries)} boundaries make {len(pp.boundaries) + 1} stages, but "
                                  + (f"parallel.pipeline.stages lists {num_stages}" if stages_given else
                                     f"pp size {pp_size} x stages_per_rank {pp.stages_per_rank} needs {num_stages}"),
                                  f"give {num_stages - 1} boundar{'y' if num_stages == 2 else 'ies'}, or boundaries: auto"))
    return issues


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


__all__ = ["DataParallelSpec", "LayoutSpec", "MeshSpec", "ParallelPlan", "PipelineSpec", "resolve_plan"]
