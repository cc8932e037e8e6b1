"""The pieces a model may be cut between (its *units*) and where pipeline stages begin: pure
arithmetic on the model's structure, no process group.

A *unit* is a piece the model may be cut between, in forward order: `tok_embeddings`,
`layers.0`, ..., `norm`, `output` (or raw top-level parameters such as `w0`, `w1`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from torch import nn

from parallel.config import V_SCHEDULES, ParallelConfig
from parallel.errors import ConfigIssue, format_path
from parallel.topology import MeshSpec


def pipeline_units(model: nn.Module) -> list[str]:
    """Pieces a pipeline may be cut between, in forward order: the children of a
    ``ModuleDict``/``ModuleList`` are separate units (``layers.0``), a module that holds such a
    container is looked into (Hugging Face's ``model`` -> ``model.embed_tokens``,
    ``model.layers.0``, ..., ``model.norm``), any other child is one unit, and so is each raw
    parameter of the root (the seeds' ``w0``, ``w1``)."""
    units: list[str] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
                units.extend(f"{prefix}{name}.{key}" for key, _ in child.named_children())
            elif any(isinstance(c, (nn.ModuleDict, nn.ModuleList)) for c in child.children()):
                visit(child, f"{prefix}{name}.")
            else:
                units.append(prefix + name)

    visit(model, "")
    return units + [name for name, _ in model.named_parameters(recurse=False)]


def block_units(model: nn.Module, units: Sequence[str]) -> list[str]:
    """The units that are entries of a ``ModuleDict``/``ModuleList`` (the repeated blocks):
    FSDP shards and activation checkpointing wraps them one by one."""
    containers = {name for name, m in model.named_modules() if isinstance(m, (nn.ModuleDict, nn.ModuleList))}
    return [u for u in units if u.rpartition(".")[0] in containers]


def stage_ranks(num_stages: int, pp_size: int, *, schedule: str) -> list[int]:
    """The pp rank of each stage: V-style for ZBV, loop-style otherwise."""
    if schedule in V_SCHEDULES:
        if num_stages != 2 * pp_size:
            raise ValueError(f"{schedule} needs exactly 2 stages per rank, got {num_stages} stages on {pp_size} ranks")
        return [s if s < pp_size else 2 * pp_size - 1 - s for s in range(num_stages)]
    return [s % pp_size for s in range(num_stages)]


def stage_boundaries(model: nn.Module, *, boundaries: Sequence[str] | str, num_stages: int,
                     units: Sequence[str]) -> list[list[str]]:
    """The units of each stage. ``boundaries`` lists the first unit of every stage but the
    first; ``"auto"`` balances parameter counts over contiguous units."""
    units = list(units)
    if num_stages > len(units):
        raise ValueError(f"{num_stages} stages but the model has only {len(units)} units: {units}")
    if boundaries == "auto":
        modules = dict(model.named_modules())
        boundaries = auto_boundaries(units, [_unit_numel(model, modules, u) for u in units], num_stages)
    missing = [b for b in boundaries if b not in units]
    if missing:
        raise ValueError(f"boundaries {missing} are not units of the model; units are {units}")
    starts = [0] + [units.index(b) for b in boundaries]
    if len(starts) != num_stages or starts != sorted(set(starts)):
        raise ValueError(f"boundaries {list(boundaries)} do not cut {units} into {num_stages} stages in order")
    ends = starts[1:] + [len(units)]
    return [units[a:b] for a, b in zip(starts, ends)]


def _unit_numel(model: nn.Module, modules: dict[str, nn.Module], unit: str) -> int:
    if unit in modules:
        return sum(p.numel() for p in modules[unit].parameters())
    return model.get_parameter(unit).numel()


def auto_boundaries(units: list[str], unit_params: list[int], num_stages: int) -> list[str]:
    """First unit of every stage but the first: contiguous stages whose largest parameter count
    is as small as it can be (the classic linear-partition dynamic programme; units are few)."""
    return list(_linear_partition(tuple(units), tuple(unit_params), num_stages))


@functools.lru_cache(maxsize=256)  # a planner cuts one model into the same stage counts for many layouts
def _linear_partition(units: tuple[str, ...], unit_params: tuple[int, ...], num_stages: int) -> tuple[str, ...]:
    n = len(units)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot cut {n} units into {num_stages} stages")
    prefix = [0]
    for count in unit_params:
        prefix.append(prefix[-1] + count)
    inf = float("inf")
    # best[k][i]: smallest max-stage size putting the first i units into k stages; cut[k][i]: last cut.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts, i = [], n
    for k in range(num_stages, 1, -1):
        i = cut[k][i]
        starts.append(i)
    return tuple(units[i] for i in reversed(starts))


def check_boundaries(parallel: ParallelConfig, mesh: MeshSpec, units: Sequence[str],
                      num_stages: int | None = None) -> list[ConfigIssue]:
    """``num_stages``: given by ``parallel.pipeline.stages``; else pp size x stages per rank."""
    pp = parallel.pipeline
    if pp is None:
        return []
    pp_size = mesh.size(pp.dim)
    stages_given = num_stages is not None
    num_stages = num_stages if num_stages is not None else pp_size * pp.stages_per_rank
    units = list(units)
    if pp.boundaries == "auto":
        if num_stages > len(units):
            return [ConfigIssue("parallel.pipeline.boundaries", f"auto needs {num_stages} stages but the "
                                                                "model has only "
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
                                  f"give {num_stages - 1} boundar{'y' if num_stages == 2 else 'ies'}, or "
                                  "boundaries: auto"))
    return issues
