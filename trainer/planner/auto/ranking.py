"""The auto-planner's verdicts: one :class:`Candidate` per layout of N ranks (its predicted step
time, peak memory, traffic and why it won or lost), and the ranking of them all (:class:`AutoPlan`)
that the dry run prints and a run logs as ``auto_plan.json``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from trainer.planner.numbers import MIB


@dataclass
class Candidate:
    """One layout and its verdict. ``status``: chosen, slower, does not fit, pruned or invalid."""

    label: str
    mesh: list[int]
    parallel: dict[str, Any]
    precision: str
    grad_accum: int = 1  # train.grad_accum: the micro-batches a data-parallel rank accumulates (no pipeline)
    status: str = "invalid"
    reason: str = ""
    lower_bound_s: float | None = None
    step_s: float | None = None
    tokens_per_s: float | None = None
    peak_bytes: float | None = None
    parts_s: dict[str, float] = field(default_factory=dict)  # compute, bubble, comm <axis>, optimizer, unitemized
    traffic: dict[str, float] = field(default_factory=dict)  # bytes a rank sends per step, per axis
    memory_note: str = ""  # a GPU profile's layout above the budget, within the prediction's measured error
    memory_skipped: bool = False  # priced for time only: slower than a layout already predicted to fit


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
