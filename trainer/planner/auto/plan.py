"""``+parallel=auto mesh=[N]``: choose the layout of N ranks with the calibrated cost model.

    python -m trainer +parallel=auto mesh=[8] dry_run=true    # the ranking, fastest first
    python -m trainer +parallel=auto mesh=[8]                 # trains with the winner

    result = plan_layouts(raw)          # raw: the composed config, `parallel: {auto: {...}}`
    result.winner.parallel              # the chosen `parallel` section, as a user would write it
    print(result.table())

Candidates: every split of N into dp x pp x tp (and hsdp's replicate x shard), each data-parallel
mode, schedule, micro-batch count, stages per rank, activation checkpointing and precision the
knobs (:class:`parallel.config.AutoPlanConfig`) allow, with the model family's Megatron plan and
``boundaries: auto``. Each is checked by the validator hand-written configs meet
(:func:`trainer.validate.checks.check_structure`, :func:`parallel.plan.resolve.resolve_plan` with the head-count
check) against one meta model built once. Axis order is fixed (dp outermost, tp innermost): on
one host permuting the axes changes nothing the model predicts, so one order stands for all.

Search: the valid candidates are sorted by a lower bound on their time that needs no meta pass
(:func:`trainer.planner.cost.model.lower_bound_s`); each is then predicted in full (the meta passes are
cached by what they depend on: tp size, micro-batch, precision) until the bound of the next one
exceeds the best time found among those predicted to fit the memory budget; the rest are pruned,
and cannot be faster. Every loser says why it lost.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from parallel.config import AutoPlanConfig
from parallel.errors import ConfigError, ConfigIssue
from trainer.planner.calibration.probe import Calibration
from trainer.config.schema import RunConfig

GIB, MIB = 2**30, 2**20
MAX_PROBE_WORKERS = 16  # a probe of more processes than that on one host measures only the scheduler


@dataclass
class Candidate:
    """One layout and its verdict. ``status``: chosen, slower, does not fit, pruned or invalid."""

    label: str
    mesh: list[int]
    parallel: dict[str, Any]
    precision: str
    status: str = "invalid"
    reason: str = ""
    lower_bound_s: float | None = None
    step_s: float | None = None
    tokens_per_s: float | None = None
    peak_bytes: float | None = None
    parts_s: dict[str, float] = field(default_factory=dict)  # compute, bubble, comm <axis>, optimizer, unitemized
    traffic: dict[str, float] = field(default_factory=dict)  # bytes a rank sends per step, per axis


@dataclass
class AutoPlan:
    world_size: int
    budget_bytes: float
    budget_source: str
    calibration: str
    candidates: list[Candidate]  # ranked: chosen, slower (by time), does not fit, pruned, invalid
    seconds: float
    show: int = 20

    @property
    def winner(self) -> Candidate:
        return self.candidates[0]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def table(self, show: int | None = None) -> str:
        """The ranking as the dry run prints it: one row per candidate, the chosen layout first."""
        rows = self.candidates[: show or self.show]
        counts = {s: sum(c.status == s for c in self.candidates) for s in
                  ("chosen", "slower", "does not fit", "pruned", "invalid")}
        lines = [f"auto plan: {len(self.candidates)} layouts of {self.world_size} ranks in {self.seconds:.1f} s "
                 f"({', '.join(f'{n} {s}' for s, n in counts.items() if n)}); memory budget "
                 f"{self.budget_bytes / MIB:,.0f} MiB per rank ({self.budget_source})",
                 f"{'#':>3} {'layout':<52} {'step ms':>9} {'tok/s':>9} {'peak MiB':>9} {'traffic MiB/axis':<30} reason"]
        for i, c in enumerate(rows, 1):
            traffic = " ".join(f"{a}:{b / MIB:.1f}" for a, b in c.traffic.items()) or "-"
            lines.append(f"{i:>3} {c.label:<52} {_num(c.step_s, 1e3, '.1f'):>9} {_num(c.tokens_per_s, 1, ',.0f'):>9} "
                         f"{_num(c.peak_bytes, 1 / MIB, ',.0f'):>9} {traffic:<30} {c.reason}")
        if len(self.candidates) > len(rows):
            lines.append(f"... {len(self.candidates) - len(rows)} more (all in auto_plan.json; parallel.auto.show=N)")
        lines.append(self.calibration)
        return "\n".join(lines)


def _num(value: float | None, scale: float, fmt: str) -> str:
    return "-" if value is None else format(value * scale, fmt)


def is_auto(raw: dict) -> bool:
    """``raw`` asks the planner to choose (an ``auto`` section and no layout of its own yet)."""
    par = raw.get("parallel")
    return isinstance(par, dict) and par.get("auto") is not None and "dims" not in par


def resolve_auto(raw: dict, *, calibration: Calibration | None = None) -> tuple[dict, AutoPlan]:
    """``raw`` with the winner's mesh and parallel section (the knobs kept under ``parallel.auto``)."""
    result = plan_layouts(raw, calibration=calibration)
    if result.winner.status != "chosen":
        raise ConfigError([ConfigIssue("parallel.auto", f"no layout of {result.world_size} ranks is valid and predicted "
                                       f"to fit: {result.winner.reason}", "change the mesh, the batch or the knobs "
                                       "(dry_run=true prints every candidate and why it lost)")])
    chosen = result.winner
    out = {**raw, "mesh": chosen.mesh, "parallel": {**chosen.parallel, "auto": raw["parallel"]["auto"]}}
    out["train"] = {**(raw.get("train") or {}), "precision": chosen.precision}
    return out, result


def ranking_for(cfg: RunConfig, *, calibration: Calibration | None = None) -> AutoPlan | None:
    """The ranking a config chosen by the planner came from (None for a hand-written layout),
    computed again: the calibration is cached and the search takes seconds, so a run records it
    without carrying it through the config (what a REST job or ``trainer.launch job.json`` reads)."""
    if cfg.parallel is None or cfg.parallel.auto is None:
        return None
    raw = cfg.model_dump(mode="json")
    raw.update(mesh=[cfg.world_size], parallel={"auto": raw["parallel"]["auto"]})
    return plan_layouts(raw, calibration=calibration)


def _knobs(raw: dict) -> AutoPlanConfig:
    from pydantic import ValidationError

    try:
        return AutoPlanConfig.model_validate(raw["parallel"]["auto"] or {})
    except ValidationError as err:
        raise ConfigError([ConfigIssue("parallel.auto." + ".".join(map(str, e["loc"])), e["msg"], "see python -m "
                                       "trainer --help for parallel.auto") for e in err.errors()]) from None


def plan_layouts(raw: dict, *, calibration: Calibration | None = None) -> AutoPlan:
    """Rank every candidate layout of ``raw``'s mesh (see the module docstring)."""
    from trainer.planner.auto.search import Search

    began = time.monotonic()
    knobs = _knobs(raw)
    mesh = raw.get("mesh") or [1]
    if any(isinstance(x, list) for x in mesh):
        raise ConfigError([ConfigIssue("mesh", "the auto-planner lays out a mesh shape, not explicit rank ids",
                                       "give the number of ranks, e.g. mesh=[8]")])
    world = math.prod(mesh)
    base = RunConfig.model_validate({**raw, "mesh": None, "parallel": None})
    search = Search(raw, base, knobs, world, calibration or host_calibration(base, world))
    candidates = search.run()
    from trainer.planner.calibration.probe import describe

    return AutoPlan(world_size=world, budget_bytes=search.budget, budget_source=search.budget_source,
                    calibration=describe(search.calibration), candidates=candidates,
                    seconds=time.monotonic() - began, show=knobs.show)


def host_calibration(base: RunConfig, world: int) -> Calibration:
    """This host's calibration for the workers a run of ``world`` ranks starts here (cached)."""
    from trainer.planner.calibration.probe import load_or_probe
    from trainer.planner.memory.layout import on_cuda

    workers = max(1, min(world // base.launch.nnodes, MAX_PROBE_WORKERS))
    sizes = [g for g in range(2, world + 1) if world % g == 0 and g <= workers]
    return load_or_probe(workers, sizes, device_type="cuda" if on_cuda(base) else "cpu")
