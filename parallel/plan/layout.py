"""A layout section's globs matched against one model: the explicit ``placements`` and ``layouts``,
then the family's named tensor-parallel plan on the parameters and modules they leave, with every
problem matching can find (a glob that matches nothing, a shard that does not divide, an
unsupported module layout) as a :class:`~parallel.errors.ConfigIssue`. Used for the whole model
and for each pipeline stage.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from fnmatch import fnmatchcase
from types import MappingProxyType
from typing import Any

from torch import nn

from parallel.config import LayoutConfig
from parallel.errors import ConfigIssue, format_path, override
from parallel.placements import parse_placement_table
from parallel.plan.spec import AxisSpecs, GlobCheck, LayoutSpec
from parallel.sharding.tp_styles import classify
from parallel.topology import MeshSpec


def resolve_layout(section: Any, prefix: tuple[object, ...], mesh: MeshSpec, model: nn.Module,
                   issues: list[ConfigIssue], *, check_glob: GlobCheck | None = None, only: set[str] | None = None
                   ) -> tuple[dict[str, AxisSpecs], dict[str, LayoutSpec], bool]:
    """``(placements, layouts, loss parallel)`` of one layout section (``parallel``, or a pipeline stage at
    ``prefix`` = ``("parallel", "pipeline", "stages", i)``): the explicit globs, then the model
    family's named plan on what they left, matched against the model's parameters and modules
    (only those whose names are in ``only``, a stage's, when given: there a family glob may match
    nothing). Loss parallel: whether the section's head leaves its logits as vocabulary shards (asked for,
    and the family's head plan applies: :func:`_vocab_parallel_head`). Problems are appended to ``issues``."""
    params = {name: tuple(p.shape) for name, p in model.named_parameters() if only is None or name in only}
    modules = [name for name, _ in model.named_modules() if name and (only is None or name in only)]
    family_placements, family_layout_entries, loss_parallel = _family_plan(section, prefix, model, mesh, issues, only)
    scope = {"scope": "the model"} if only is None else {"scope": f"this stage ({format_path(*prefix)})"}
    # Explicit globs first: what they place, the family's plan does not, so its issues on those
    # parameters (the ones an explicit glob was written to fix) are never raised.
    explicit = _match_placements(
        [(glob, axes, format_path(*prefix, "placements", glob)) for glob, axes in section.placements.items()],
        mesh, params, issues, check_glob, **scope)
    family = _match_placements(family_placements, mesh, params, issues, check_glob, **scope,
                               required=only is None, taken=set(explicit))
    placements = {name: explicit[name] if name in explicit else family[name]
                  for name in params if name in explicit or name in family}
    explicit_layouts, explicit_paths = _match_layouts(
        [(glob, layout, format_path(*prefix, "layouts", glob)) for glob, layout in section.layouts.items()],
        modules, issues, **scope)
    family_layouts, layout_paths = _match_layouts(family_layout_entries, modules, issues, **scope,
                                                  required=only is None, taken=set(explicit_layouts))
    layout_paths.update(explicit_paths)
    layouts = {name: explicit_layouts[name] if name in explicit_layouts else family_layouts[name]
               for name in modules if name in explicit_layouts or name in family_layouts}
    if issues:
        return placements, layouts, loss_parallel

    for name in classify(model, placements, layouts).unsupported:
        issues.append(ConfigIssue(layout_paths[name],
                                  f"module {name}: only a Shard input of a norm-like module (sequence parallel) or the "
                                  "input/output of a module with DTensor-placed parameters is supported",
                                  "remove this layout, or give the module's parameters placements"))
    return placements, layouts, loss_parallel


# ---------------------------------------------------------------------- placements


def _match_glob(section: str, glob: str, path: str, names: list[str], sources: dict[str, str],
                issues: list[ConfigIssue], scope: str = "the model", required: bool = True,
                taken: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """The names ``glob`` (written at ``path``) matches, less those in ``taken`` (an explicit glob
    placed them), recorded in ``sources``; a glob matching nothing (unless not ``required``), or a
    name another glob of the same section already took, is an issue. ``scope``: whose names
    ``names`` are, for the message."""
    noun, holds = ("parameter", "placement") if section == "placements" else ("module", "layout")
    matched = [name for name in names if fnmatchcase(name, glob)]
    if not matched and required:
        issues.append(ConfigIssue(path, f"matches no {noun} of {scope}",
                                  f"fix the glob; {noun}s look like {', '.join(names[:4])}, ..."))
    matched = [name for name in matched if name not in taken]
    for name in matched:
        if name in sources:
            issues.append(ConfigIssue(path, f"{noun} {name} is also matched by {sources[name]!r}",
                                      f"make the globs disjoint so each {noun} has one {holds}"))
        sources[name] = glob
    return matched


def _match_placements(entries: list[tuple[str, AxisSpecs, str]], mesh: MeshSpec, params: Mapping[str, tuple[int, ...]],
                      issues: list[ConfigIssue], check_glob: GlobCheck | None, **scope: Any) -> dict[str, AxisSpecs]:
    """``entries``: ``(glob, placements, the config path it was written at)``, in order;
    ``scope``: :func:`_match_glob`'s ``scope``, ``required`` and ``taken``."""
    placements: dict[str, AxisSpecs] = {}
    sources: dict[str, str] = {}
    for glob, axes, path in entries:
        found: list[ConfigIssue] = []
        _match_entry(glob, axes, path, mesh, params, placements, sources, found, check_glob, scope)
        issues += [_with_replicate_override(issue, glob, path) for issue in found]
    return placements


def _with_replicate_override(issue: ConfigIssue, glob: str, path: str) -> ConfigIssue:
    """A fix ending in "Replicate" (a shard that does not divide, attention a model cannot split)
    spelt out as the override that replicates the glob's parameters on that axis, in the section's
    explicit ``placements`` (which win over a named plan's glob, so a plan is overridden, never edited)."""
    axis = issue.path.removeprefix(f"{path}.")
    if not issue.fix.endswith(" Replicate") or axis == issue.path:
        return issue
    section = path.split(".tensor_parallel.plan[")[0].split('.placements["')[0]  # parallel, or a stage's
    key = re.sub(r"\[(\d+)\]", r".\1", section) + ".placements"  # stages[1] -> stages.1, as Hydra's keys go
    fix = f"{issue.fix}: {override(key, {glob: {axis: 'Replicate'}})}"
    return ConfigIssue(issue.path, issue.reason, fix)


def _match_entry(glob: str, axes: AxisSpecs, path: str, mesh: MeshSpec, params: Mapping[str, tuple[int, ...]],
                 placements: dict[str, AxisSpecs], sources: dict[str, str], issues: list[ConfigIssue],
                 check_glob: GlobCheck | None, scope: dict[str, Any]) -> None:
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
        assert p.dim is not None, "a shard placement has a dim"
        dim = p.dim if p.dim >= 0 else p.dim + len(shape)
        if not 0 <= dim < len(shape):
            issues.append(ConfigIssue(path, f"{p} but parameter {fqn} has {len(shape)} dims (shape {list(shape)})",
                                      f"use {'Shard(0)' if len(shape) == 1 else f'Shard(0) .. Shard({len(shape) - 1})'}"
                                      ", or a glob matching only parameters with more dims"))
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
                   issues: list[ConfigIssue], **scope: Any) -> tuple[dict[str, LayoutSpec], dict[str, str]]:
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


def _family_plan(section: Any, prefix: tuple[object, ...], model: nn.Module, mesh: MeshSpec,
                 issues: list[ConfigIssue], only: set[str] | None = None
                 ) -> tuple[list[tuple[str, AxisSpecs, str]], list[tuple[str, LayoutConfig, str]], bool]:
    """The model family's named tensor-parallel plan of a layout section (at ``prefix``) as
    ``(placement entries, layout entries, loss parallel)``, each entry ``(glob, value, path)``; explicit globs
    override them, parameter by parameter and module by module. The family's plans are read once here."""
    tp = section.tensor_parallel
    if tp is None:
        return [], [], False
    provider = getattr(model, "parallel_plan", None)  # the family's plans: a method of its root module
    if provider is None:
        issues.append(ConfigIssue(format_path(*prefix, "tensor_parallel", "plan"),
                                  f"model {type(model).__name__} provides no named plans",
                                  f"write {format_path(*prefix, 'placements')} globs instead (and drop its "
                                  "tensor_parallel)"))
        return [], [], False
    placements, layouts = provider(tp.plan, axis=tp.dim, sequence_parallel=tp.sequence_parallel)
    loss_parallel = False
    if tp.loss_parallel:
        head_placements, head_layouts, loss_parallel = _vocab_parallel_head(model, tp, prefix, mesh, only)
        placements, layouts = {**placements, **head_placements}, {**layouts, **head_layouts}
    where = f"{format_path(*prefix, 'tensor_parallel', 'plan')}[{tp.plan}]"
    parsed = parse_placement_table(placements)
    return ([(glob, parsed[glob], f'{where}["{glob}"]') for glob in placements],
            [(glob, LayoutConfig.model_validate(layout), f'{where}["{glob}"]') for glob, layout in layouts.items()],
            loss_parallel)


def _vocab_parallel_head(model: nn.Module, tp: Any, prefix: tuple[object, ...], mesh: MeshSpec,
                         only: set[str] | None = None) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """Loss parallel's globs (the head column-parallel, its logits vocabulary shards), from the model's
    ``vocab_parallel_plan``, and whether loss parallel applies: the head's logits leave it as vocabulary shards
    (the plan exists, the vocabulary divides over the axis and, for a pipeline stage whose parameters are
    ``only``, the stage itself holds the head's placed weight). A model without one, or a vocabulary that does
    not divide over the axis, keeps the replicated head, with a warning (no refusal: loss parallel is on by
    default, and a layout that trained before it existed, e.g. a 256-token vocabulary on tp 3, must still
    train)."""
    path = format_path(*prefix, "tensor_parallel", "loss_parallel")
    provider = getattr(model, "vocab_parallel_plan", None)
    if provider is None:
        warnings.warn(f"{path}: model {type(model).__name__} has no vocabulary-parallel head plan; its head stays "
                      f"whole on every {tp.dim} rank (set {path}=false to silence this)", stacklevel=2)
        return {}, {}, False
    placements, layouts, vocab = provider(axis=tp.dim)
    size = mesh.size(tp.dim) if tp.dim in mesh.dim_names else 1
    if vocab % size:
        warnings.warn(f"{path}: the vocabulary ({vocab} tokens) is not divisible by the {tp.dim} size {size}; the "
                      f"output head and input embedding stay whole on every {tp.dim} rank (no loss parallel). Pad "
                      f"the vocabulary to a multiple of {size} to split it, or set {path}=false to silence this.",
                      stacklevel=2)
        return {}, {}, False
    # An untied input embedding is split over the vocabulary too, where this layout holds it.
    embedding: dict[str, Any] = getattr(model, "vocab_parallel_embedding", lambda axis: {})(axis=tp.dim)
    embedding = {fqn: axes for fqn, axes in embedding.items() if only is None or fqn in only}
    if only is not None and not set(placements) & only and embedding:
        return embedding, {}, False  # a first stage: its embedding split, no head
    if not _head_weight_held(placements, only):
        # A pipeline stage whose head is tied to an earlier stage's input embedding: the stage keeps a copy of
        # that weight (parallel.pipeline.ties), which its own layout does not place; the copy stays whole.
        warnings.warn(f"{path}: this stage's output head is tied to {', '.join(sorted(placements))}, which an earlier "
                      f"stage holds; its copy here stays whole on every {tp.dim} rank (no loss parallel on this "
                      f"stage; set {path}=false to silence this)", stacklevel=2)
        return embedding, {}, False
    return {**embedding, **placements}, layouts, True


def _head_weight_held(placements: Mapping[str, Any], only: set[str] | None) -> bool:
    """Whether the layout's parameters (a stage's, ``only``) include the head's placed weight."""
    return only is None or set(placements) <= only
