"""A schedule's order of actions without a process group, laid out in time; bubble fractions.

torch's schedules compute every pp rank's order of compute actions (``pipeline_order``: rank ->
``[_Action(stage, F | B | I | W, microbatch), ...]``) in their constructor, from nothing but the
pp size, the stages per rank and the number of micro-batches. :func:`schedule_order` builds the
schedule on stand-in stages that carry only those numbers, so a dry run shows the order the
workers will execute, not a copy of it that could drift from torch's.

    order = schedule_order("1F1B", pp_size=4, stages_per_rank=1, microbatches=8)  # {0: ["0F0", ...]}
    events = predicted_events(order, num_stages=4)            # unit costs: F = 1, B = 2, I = W = 1
    bubble_fractions(events)["mean"]                          # 3/11 == (p-1)/(m+p-1)
    theory_bubble("1F1B", pp_size=4, stages_per_rank=1, microbatches=8)   # (3/11, "(p-1)/(m+p-1)")

Events are plain dicts (``rank, name, kind, stage, microbatch, start_us, end_us, step``), the
same shape :class:`parallel.pipeline.timeline.TimelineRecorder` measures, so one bubble definition and
one drawing serve the prediction and the measurement.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from types import SimpleNamespace
from typing import Any, cast

# Kinds that keep a rank busy; everything else (communication, optimizer) is not pipeline work.
COMPUTE_KINDS = ("F", "B", "I", "W", "LOSS", "FB")
# One unit per forward; a full backward costs two (input and weight gradients, one unit each).
UNIT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
UNIT_US = 1000.0  # a predicted unit is drawn as 1 ms, so the measured and predicted axes read alike
SCHEDULE_CLASSES = {"GPipe": "ScheduleGPipe", "1F1B": "Schedule1F1B", "Interleaved1F1B": "ScheduleInterleaved1F1B",
                    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble", "ZBV": "ScheduleZBVZeroBubble"}


def action_name(stage: int, kind: str, microbatch: int | None) -> str:
    """torch's notation of an action: ``1F0`` (stage 1, forward, micro-batch 0), ``0SEND_B3``."""
    return f"{stage}{kind}{'' if microbatch is None else microbatch}"


def compute_order(pipeline_order: dict[int, list[Any]]) -> dict[int, list[str]]:
    """The compute actions (F, B, I, W) of a torch ``pipeline_order``, per pp rank, as names.

    torch 2.13's ``Schedule1F1B._get_pipeline_order`` numbers the last rank's forwards 1..m
    instead of 0..m-1 (it starts counting from the warm-up's last index when there is no warm-up);
    the schedule itself runs them 0..m-1. A stage's forwards always run in micro-batch order, so
    where a stage's forward indices are not exactly 0..m-1 they are renumbered in order of
    appearance; a correct order is left as it is.
    """
    out: dict[int, list[str]] = {}
    for rank, actions in sorted(pipeline_order.items()):
        compute = [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in actions
                   if a is not None and a.computation_type.value in UNIT_COSTS]
        forwards: dict[int, list[int]] = defaultdict(list)
        for stage, kind, mb in compute:
            if kind == "F":
                forwards[stage].append(mb)
        renumber = {s for s, mbs in forwards.items() if sorted(mbs) != list(range(len(mbs)))}
        seen: dict[int, int] = defaultdict(int)
        names = []
        for stage, kind, mb in compute:
            if kind == "F" and stage in renumber:
                mb, seen[stage] = seen[stage], seen[stage] + 1
            names.append(action_name(stage, kind, mb))
        out[rank] = names
    return out


def schedule_order(schedule: str, *, pp_size: int, stages_per_rank: int, microbatches: int) -> dict[int, list[str]]:
    """Every pp rank's compute actions in the order torch's ``schedule`` runs them.

    The schedule is constructed on stand-in stages: its constructor reads only ``num_stages``,
    ``group_size``, ``group_rank`` and ``submod`` of them (no process group, no tensors).
    """
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, SCHEDULE_CLASSES[schedule])
    stages = [SimpleNamespace(num_stages=pp_size * stages_per_rank, group_size=pp_size, group_rank=0, submod=None,
                              stage_index=i) for i in range(stages_per_rank)]
    built = cls(stages[0] if schedule in ("GPipe", "1F1B") else stages,
                n_microbatches=microbatches, loss_fn=lambda output, target: output)
    return compute_order(built.pipeline_order)


def parse_action(name: str) -> tuple[int, str, int]:
    """``"1F0"`` -> ``(1, "F", 0)``."""
    digits = len(name) - len(name.lstrip("0123456789"))
    rest = name[digits:]
    kind = rest.rstrip("0123456789")
    return int(name[:digits]), kind, int(rest[len(kind):])


def predicted_events(order: dict[int, list[str]], *, num_stages: int,
                     costs: dict[str, float] = UNIT_COSTS) -> list[dict[str, Any]]:
    """Lay ``order`` out in time: each rank runs its actions in order, each as soon as the rank is
    free and its input is there; communication costs nothing.

    Dependencies: a forward of stage ``s > 0`` waits for stage ``s-1``'s forward of the same
    micro-batch; a backward (B or I) of stage ``s < last`` for stage ``s+1``'s B or I; a weight
    gradient (W) follows its own I, which comes earlier on the same rank. Returns events on pp
    ranks with ``UNIT_US`` microseconds per unit.
    """
    finished: dict[tuple[int, str, int], float] = {}
    free = {rank: 0.0 for rank in order}
    position = {rank: 0 for rank in order}
    events: list[dict[str, Any]] = []

    def needs(stage: int, kind: str, mb: int) -> list[tuple[int, str, int]]:
        if kind == "F" and stage > 0:
            return [(stage - 1, "F", mb)]
        if kind in ("B", "I") and stage < num_stages - 1:
            return [(stage + 1, "B", mb), (stage + 1, "I", mb)]  # whichever the next stage runs
        return []

    while any(position[r] < len(order[r]) for r in order):
        progressed = False
        for rank, actions in order.items():
            while position[rank] < len(actions):
                stage, kind, mb = parse_action(actions[position[rank]])
                deps = needs(stage, kind, mb)
                if deps and not any(d in finished for d in deps):
                    break
                start = max([free[rank]] + [finished[d] for d in deps if d in finished])
                end = start + costs[kind]
                finished[(stage, kind, mb)] = free[rank] = end
                events.append({"rank": rank, "name": actions[position[rank]], "kind": kind, "stage": stage,
                               "microbatch": mb, "start_us": start * UNIT_US, "end_us": end * UNIT_US, "step": 0})
                position[rank] += 1
                progressed = True
        if not progressed:
            waiting = {r: order[r][position[r]] for r in order if position[r] < len(order[r])}
            raise ValueError(f"the order cannot proceed: every rank waits ({waiting})")
    return events


def bubble_fractions(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The pipeline bubble of a timeline: the share of the pipeline's time a rank does no compute.

    Per step, the pipeline's time ``T`` runs from the first compute action's start on any rank to
    the last one's end on any rank (the optimizer and anything after the last backward are not in
    it); a rank's bubble is ``1 - busy / T``, ``busy`` the summed length of its compute actions
    (F, B, I, W, and the loss on the last stage). Over several steps busy and ``T`` are summed
    first. With equal stage costs this is exactly GPipe's and 1F1B's ``(p-1)/(m+p-1)``: every rank
    is busy ``m (F+B)`` of ``T = (m+p-1)(F+B)``. Waiting for a send or receive counts as bubble.

    Returns ``{"per_rank": {rank: fraction}, "mean": fraction}`` (``mean``: over ranks), or
    ``{"per_rank": {}, "mean": None}`` when no compute was recorded.
    """
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["kind"] in COMPUTE_KINDS:
            by_step[e["step"]].append(e)
    busy: dict[int, float] = defaultdict(float)
    span = 0.0
    ranks = sorted({e["rank"] for e in events})
    for compute in by_step.values():
        span += max(e["end_us"] for e in compute) - min(e["start_us"] for e in compute)
        for e in compute:
            busy[e["rank"]] += e["end_us"] - e["start_us"]
    if span <= 0:
        return {"per_rank": {}, "mean": None}
    per_rank = {rank: 1.0 - busy[rank] / span for rank in ranks}
    return {"per_rank": per_rank, "mean": sum(per_rank.values()) / len(per_rank)}


def theory_bubble(schedule: str, *, pp_size: int, stages_per_rank: int, microbatches: int) -> tuple[float | None, str]:
    """The published bubble fraction of ``schedule`` for equal stage costs, and its formula (or
    why there is none).

    GPipe, 1F1B: ``(p-1)/(m+p-1)`` (GPipe paper; the same for 1F1B, Narayanan et al. 2021).
    Interleaved1F1B with ``v`` stages per rank: ``(p-1)/(v m+p-1)`` (the bubble shrinks by ``v``,
    Narayanan et al. 2021). InterleavedZeroBubble: ZB1P's bubble, a third of 1F1B's for
    ``T_F = T_B = T_W`` (Qi et al. 2024, ZB-H1), shrunk by ``v`` as interleaving shrinks 1F1B's:
    ``(p-1)/(3 v m+p-1)``; laid out with unit costs, torch's own order gives exactly that.
    ZBV: none. The paper gives 0 for ``T_F = T_B = T_W``, but torch's ZBV order laid out with those
    costs does not reach it (:func:`predicted_events` gives ``(p-1)/(6m+p-1)`` for ``m >= 2p``), and
    a yardstick the schedule cannot meet says nothing about a run; compare with the prediction.
    """
    p, v, m = pp_size, stages_per_rank, microbatches
    if schedule in ("GPipe", "1F1B"):
        return (p - 1) / (m + p - 1), "(p-1)/(m+p-1)"
    if schedule == "Interleaved1F1B":
        return (p - 1) / (v * m + p - 1), "(p-1)/(v*m+p-1)"
    if schedule == "InterleavedZeroBubble":
        return (p - 1) / (3 * v * m + p - 1), "(p-1)/(3*v*m+p-1)"
    return None, "n/a: the ZB-V paper's 0 is not what torch's order reaches at T_F = T_B = T_W; see the prediction"


@functools.lru_cache(maxsize=4096)  # a planner asks for the same few shapes thousands of times
def expected_bubble(schedule: str, *, pp_size: int, stages_per_rank: int, microbatches: int) -> float:
    """The bubble a plan expects with equal stage costs: the schedule's theory, or where it has
    none (ZBV) torch's order laid out with unit costs."""
    theory, _ = theory_bubble(schedule, pp_size=pp_size, stages_per_rank=stages_per_rank, microbatches=microbatches)
    if theory is not None:
        return theory
    order = schedule_order(schedule, pp_size=pp_size, stages_per_rank=stages_per_rank, microbatches=microbatches)
    return cast(float, bubble_fractions(predicted_events(order, num_stages=pp_size * stages_per_rank))["mean"])
