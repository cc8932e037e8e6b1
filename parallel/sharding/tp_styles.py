"""Which tensor-parallel style each module gets, from the resolved placements and layouts alone:
Megatron column/row pairs, sequence-parallel norms, DTensor owners, and the layouts none of them
honours. Pure arithmetic on module names and types (no process group, no DTensor import), so the
plan can refuse an ignored layout before any worker starts; :mod:`parallel.sharding.tensor_parallel`
applies the styles.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from parallel.placements import PlacementSpec
from parallel.sharding.ties import placed_alike, tied_groups

AxisSpecs = Mapping[str, PlacementSpec]


@dataclass
class Classification:
    """Which module gets which treatment; keys are module FQNs.

    Attributes:
        col, row: ``nn.Linear`` modules of Megatron pairs -> their axis.
        sp_norms: sequence-parallel modules -> ``(axis, sequence dim)``.
        owners: modules whose own parameters become DTensors -> ``{param name: placements}``.
        unsupported: modules with a non-Replicate layout that none of the above honours.
    """

    col: dict[str, str] = field(default_factory=dict)
    row: dict[str, str] = field(default_factory=dict)
    sp_norms: dict[str, tuple[str, int]] = field(default_factory=dict)
    owners: dict[str, dict[str, AxisSpecs]] = field(default_factory=dict)
    unsupported: list[str] = field(default_factory=list)


def classify(module: nn.Module, placements: Mapping[str, AxisSpecs], layouts: Mapping[str, Any]) -> Classification:
    """The style of every module of ``module`` that ``placements`` (param FQN -> ``{axis:
    placement}``) and ``layouts`` (module FQN -> :class:`~parallel.plan.spec.LayoutSpec`) touch.
    Entries for names ``module`` lacks (another pipeline stage's) are ignored."""
    modules = dict(module.named_modules())
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    specs = {fqn: axes for fqn, axes in with_ties(module, placements).items() if fqn in params}
    layouts = {name: layout for name, layout in layouts.items() if name in modules}
    out = Classification()
    out.col, out.row = _megatron_pairs(modules, specs)
    out.sp_norms = _sequence_parallel_norms(modules, specs, layouts)
    claimed = set(out.col) | set(out.row) | set(out.sp_norms)
    for fqn, axis_specs in specs.items():
        owner, _, pname = fqn.rpartition(".")
        if owner not in claimed and sharded_axes(axis_specs):
            out.owners.setdefault(owner, {})[pname] = axis_specs
    handled = set(out.sp_norms) | set(out.owners)
    out.unsupported = [name for name, layout in layouts.items()
                       if name not in handled and non_replicate(layout.input) | non_replicate(layout.output)]
    return out


def with_ties(module: nn.Module, placements: Mapping[str, AxisSpecs]) -> dict[str, AxisSpecs]:
    """``placements`` with every name of a tied parameter of ``module`` (an input embedding that is also
    the output head) placed as its placed name (:func:`parallel.sharding.ties.placed_alike`)."""
    return placed_alike(dict(placements), tied_groups(module))


def sharded_axes(axis_specs: Mapping[str, PlacementSpec]) -> dict[str, PlacementSpec]:
    return {a: p for a, p in axis_specs.items() if p.kind != "replicate"}


def non_replicate(axis_specs: Mapping[str, PlacementSpec]) -> set[str]:
    return {a for a, p in axis_specs.items() if p.kind != "replicate"}


def block_of(name: str) -> str:
    """The block a sequence-parallel norm belongs to: its parent, or itself at top level."""
    parent = name.rpartition(".")[0]
    return parent if parent else name


def is_within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def enclosing(blocks: Mapping[str, Any], name: str) -> Any:
    for block, value in blocks.items():
        if is_within(name, block):
            return value
    return None


def _megatron_pairs(
    modules: Mapping[str, nn.Module], specs: Mapping[str, Mapping[str, PlacementSpec]]
) -> tuple[dict[str, str], dict[str, str]]:
    """Column- and row-parallel ``nn.Linear`` modules ``{name: axis}``: a parent module holding
    at least one of each on the same single axis. Lone shards fall through to DTensor."""
    candidates: dict[tuple[str, str], dict[str, list[str]]] = {}
    for name, mod in modules.items():
        if not isinstance(mod, nn.Linear) or f"{name}.weight" not in specs:
            continue
        sharded = sharded_axes(specs[f"{name}.weight"])
        if len(sharded) != 1:
            continue
        (axis, p), = sharded.items()
        assert p.dim is not None, "sharded_axes holds shards only"
        dim = p.dim % 2  # a Linear weight is 2-D: Shard(-1) is Shard(1)
        # The styles shard the bias themselves (column: Shard(0), row: Replicate); a config
        # asking for something else is honoured by the DTensor path instead.
        if mod.bias is not None:
            bias = {a: repr(q) for a, q in sharded_axes(specs.get(f"{name}.bias", {})).items()}
            if bias != ({axis: "Shard(0)"} if dim == 0 else {}):
                continue
        kind = "col" if dim == 0 else "row"
        candidates.setdefault((name.rpartition(".")[0], axis), {"col": [], "row": []})[kind].append(name)
    col: dict[str, str] = {}
    row: dict[str, str] = {}
    for (_, axis), kinds in candidates.items():
        if kinds["col"] and kinds["row"]:
            col.update({n: axis for n in kinds["col"]})
            row.update({n: axis for n in kinds["row"]})
    return col, row


def _sequence_parallel_norms(
    modules: Mapping[str, nn.Module], specs: Mapping[str, AxisSpecs], layouts: Mapping[str, Any]
) -> dict[str, tuple[str, int]]:
    """Modules whose layout input is ``Shard(d)`` on one axis and whose own parameters are not
    sharded (norms): ``{name: (axis, sequence dim)}``."""
    found: dict[str, tuple[str, int]] = {}
    # Every module above a sharded parameter (one pass, not one per layout: a planner asks this often).
    owners: set[str] = set()
    for fqn, spec in specs.items():
        if sharded_axes(spec):
            parts = fqn.split(".")
            owners.update(".".join(parts[:i]) for i in range(1, len(parts)))
    for name, layout in layouts.items():
        inputs = sharded_axes(layout.input)
        if len(inputs) != 1 or non_replicate(layout.output):
            continue
        (axis, p), = inputs.items()
        if p.kind != "shard":
            continue
        assert p.dim is not None, "a shard placement has a dim"
        if name not in owners:
            found[name] = (axis, p.dim)
    return found
