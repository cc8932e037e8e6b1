"""The pipeline timeline as pictures: a Chrome trace (opens in Perfetto) and a PNG Gantt chart.

A training run records its last ``tracking.timeline_steps`` steps (:mod:`parallel.pipeline.timeline`),
gathers every rank's actions to rank 0 and draws them; a dry run draws the order torch's
schedule will run, laid out with unit costs (:mod:`parallel.pipeline.order`). Both carry the
bubble fraction beside the schedule's theory.

    events = predicted_timeline(plan)                       # the dry run's (None without a pipeline)
    paths = write_timeline(events, Path("meshflow-plan"), title="1F1B, p=2, m=4")
    paths["timeline_trace"], paths["timeline_png"]          # .../timeline.json, .../timeline.png

Open the trace at https://ui.perfetto.dev (or chrome://tracing): one process per rank, its
compute (and optimizer) on one thread, its sends and receives on threads below it.
"""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from parallel.pipeline.order import (
    COMPUTE_KINDS,
    bubble_fractions,
    predicted_events,
    schedule_order,
    theory_bubble,
)

COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#8FD19E", "W": "#2E7D5B", "LOSS": "#8172B2", "FB": "#4C72B0",
          "OPT": "#DD8452", "SEND_F": "#9E9E9E", "RECV_F": "#C7C7C7", "SEND_B": "#7F7F7F", "RECV_B": "#B0B0B0"}
LABELS = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weight)", "LOSS": "loss",
          "FB": "forward + backward", "OPT": "optimizer", "SEND_F": "send activation", "RECV_F": "receive activation",
          "SEND_B": "send gradient", "RECV_B": "receive gradient"}
ROW_KINDS = COMPUTE_KINDS + ("OPT",)  # drawn on a rank's main row; the rest is communication


def bubble_summary(events: list[dict], *, schedule: str, pp_size: int, stages_per_rank: int, microbatches: int) -> dict:
    """The bubble of ``events`` beside the schedule's theory and torch's order laid out with unit costs."""
    theory, formula = theory_bubble(schedule, pp_size=pp_size, stages_per_rank=stages_per_rank,
                                    microbatches=microbatches)
    order = schedule_order(schedule, pp_size=pp_size, stages_per_rank=stages_per_rank, microbatches=microbatches)
    predicted = bubble_fractions(predicted_events(order, num_stages=pp_size * stages_per_rank))["mean"]
    measured = bubble_fractions(events)
    return {"measured": measured["mean"], "per_rank": measured["per_rank"], "theory": theory, "formula": formula,
            "predicted": predicted}


def bubble_text(summary: dict, *, what: str = "measured") -> str:
    """``measured bubble 31.2%, theory (p-1)/(m+p-1) = 20.0%, unit-cost prediction 20.0%``."""
    theory = "theory n/a" if summary["theory"] is None else f"theory {summary['formula']} = {summary['theory']:.1%}"
    text = f"{what} bubble {summary['measured']:.1%}, {theory}"
    return text + (f", unit-cost prediction {summary['predicted']:.1%}" if what == "measured" else "")


def schedule_text(schedule: str, pp_size: int, stages_per_rank: int, microbatches: int) -> str:
    """``1F1B p=2 m=4`` (``v=2`` too for several stages per rank)."""
    return f"{schedule} p={pp_size}{f' v={stages_per_rank}' if stages_per_rank > 1 else ''} m={microbatches}"


# ------------------------------------------------------------------------- gathering


def gather_events(recorder: Any) -> list[dict] | None:
    """Every rank's recorded events on rank 0, sorted by start (``None`` on the other ranks): a
    collective every rank calls. Ranks on another host than rank 0 are moved onto its clock by
    their wall-clock offsets (NTP-accurate; one host's monotonic clock is shared exactly)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return sorted(recorder.events, key=lambda e: e["start_us"])
    mine = (recorder.events, recorder.clock())
    gathered: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if gathered is None:
        return None
    host, offset = gathered[0][1]["host"], gathered[0][1]["wall_minus_monotonic_us"]
    events = []
    for rank_events, clock in gathered:
        shift = 0.0 if clock["host"] == host else clock["wall_minus_monotonic_us"] - offset
        events += [{**e, "start_us": e["start_us"] + shift, "end_us": e["end_us"] + shift} for e in rank_events]
    return sorted(events, key=lambda e: e["start_us"])


# --------------------------------------------------------------------------- drawing


def _lanes(events: list[dict]) -> list[int]:
    """A lane per event such that no two events of one lane overlap (greedy, by start): Chrome's
    complete events on one thread must nest, and a send posted early may outlast the next one."""
    ends: list[float] = []
    lanes = []
    for e in events:
        lane = next((i for i, end in enumerate(ends) if end <= e["start_us"]), len(ends))
        if lane == len(ends):
            ends.append(0.0)
        ends[lane] = e["end_us"]
        lanes.append(lane)
    return lanes


def chrome_trace(events: list[dict], *, title: str = "") -> dict:
    """The Chrome trace-event JSON of ``events``: a process (pid) per rank, its compute and
    optimizer as complete ("X") events on thread 0, its communication on threads 1, 2, ...
    Times are µs from the first event."""
    t0 = min((e["start_us"] for e in events), default=0.0)
    trace: list[dict] = []
    by_rank: dict[int, list[dict]] = defaultdict(list)
    for e in sorted(events, key=lambda e: e["start_us"]):
        by_rank[e["rank"]].append(e)
    for rank, rank_events in sorted(by_rank.items()):
        trace += [{"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
                  {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
                  {"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": "compute"}}]
        comm = [e for e in rank_events if e["kind"] not in ROW_KINDS]
        tids = dict(zip(map(id, comm), (1 + lane for lane in _lanes(comm))))
        for tid in sorted(set(tids.values())):
            trace.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": f"comm {tid}"}})
        for e in rank_events:
            args = {k: e[k] for k in ("stage", "microbatch", "step", "peer", "wait_us") if e.get(k) is not None}
            trace.append({"ph": "X", "name": e["name"], "cat": e["kind"], "pid": rank, "tid": tids.get(id(e), 0),
                          "ts": round(e["start_us"] - t0, 3), "dur": round(max(e["end_us"] - e["start_us"], 0.0), 3),
                          "args": args})
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": {"title": title}}


def draw_gantt(events: list[dict], path: Path, *, title: str = "", xlabel: str = "time (ms)") -> Path:
    """A PNG Gantt chart: a row per rank (compute and optimizer as bars, communication as thin
    bars under them), a colour per kind, time in ms from the first event."""
    from matplotlib.figure import Figure  # the object API: no pyplot, no global backend state
    from matplotlib.patches import Patch

    t0 = min((e["start_us"] for e in events), default=0.0)
    ranks = sorted({e["rank"] for e in events})
    row = {rank: i for i, rank in enumerate(ranks)}
    fig = Figure(figsize=(12, 1.2 + 0.55 * len(ranks)), dpi=120)
    ax = fig.add_subplot()
    bars: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        bars[(e["rank"], e["kind"])].append(((e["start_us"] - t0) / 1000, max(e["end_us"] - e["start_us"], 0.0) / 1000))
    for (rank, kind), spans in bars.items():
        main = kind in ROW_KINDS
        y = row[rank] + (-0.35 if main else 0.2)
        ax.broken_barh(spans, (y, 0.5 if main else 0.15), facecolors=COLORS.get(kind, "#333333"),
                       edgecolor="white" if main else "none", linewidth=0.4)
    compute = [e for e in events if e["kind"] in ("F", "B", "I", "W")]
    several = len({(e["rank"], e["stage"]) for e in compute}) > len({e["rank"] for e in compute})
    span = max(max((e["end_us"] for e in events), default=t0) - t0, 1e-9)
    for e in compute:  # micro-batch labels (stage:micro-batch where a rank holds several) on bars wide enough
        label = f"{e['stage']}:{e['microbatch']}" if several else str(e["microbatch"])
        if (e["end_us"] - e["start_us"]) / span * 1150 >= 4.5 * len(label) + 3:  # ~1150 px of axis, ~4.5 px a digit
            ax.text((e["start_us"] + e["end_us"] - 2 * t0) / 2000, row[e["rank"]] - 0.1, label,
                    ha="center", va="center", fontsize=6, color="white")
    step_starts = {s: min(e["start_us"] for e in events if e["step"] == s) for s in {e["step"] for e in events}}
    for start in sorted(step_starts.values())[1:]:  # a dotted line where each later step begins
        ax.axvline((start - t0) / 1000, color="black", linestyle=":", linewidth=0.8)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.6)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    kinds = [k for k in COLORS if any(kind == k for _, kind in bars)]
    ax.legend(handles=[Patch(color=COLORS[k], label=LABELS[k]) for k in kinds], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    return path


def write_timeline(events: list[dict], out_dir: Path, *, title: str = "", name: str = "timeline",
                   xlabel: str = "time (ms)") -> dict[str, Path]:
    """Write ``<name>.json`` (Chrome trace) and ``<name>.png`` (Gantt chart) of ``events`` into
    ``out_dir`` (created); returns ``{"timeline_trace": json path, "timeline_png": png path}``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = out_dir / f"{name}.json"
    trace.write_text(json.dumps(chrome_trace(events, title=title)))
    return {"timeline_trace": trace, "timeline_png": draw_gantt(events, out_dir / f"{name}.png", title=title,
                                                                xlabel=xlabel)}


# ------------------------------------------------------------------ dry run and loop


def pipeline_shape(plan: Any) -> dict | None:
    """``schedule, pp_size, stages_per_rank, microbatches`` of a plan's pipeline (None without one)."""
    pp = plan.pipeline
    if pp is None:
        return None
    return dict(schedule=pp.schedule, pp_size=pp.num_stages // pp.stages_per_rank, stages_per_rank=pp.stages_per_rank,
                microbatches=pp.num_microbatches)


def predicted_timeline(plan: Any) -> list[dict] | None:
    """The order torch's schedule will run on each pp rank, laid out with unit costs (F = 1,
    B = 2, I = W = 1 unit, drawn as 1 ms; no communication cost); ``None`` without a pipeline."""
    if (shape := pipeline_shape(plan)) is None:
        return None
    order = schedule_order(shape["schedule"], pp_size=shape["pp_size"], stages_per_rank=shape["stages_per_rank"],
                           microbatches=shape["microbatches"])
    return predicted_events(order, num_stages=plan.pipeline.num_stages)


def write_predicted_timeline(plan: Any, out_dir: Path) -> tuple[dict[str, Path], dict] | None:
    """The dry run's pictures: :func:`predicted_timeline` written into ``out_dir`` (the paths), and
    its :func:`bubble_summary`; ``None`` without a pipeline. Raises ``ValueError`` where torch's
    schedule refuses the shape (e.g. 1F1B with fewer micro-batches than ranks)."""
    if (events := predicted_timeline(plan)) is None:
        return None
    shape = pipeline_shape(plan)
    assert shape is not None, "a predicted timeline is a pipeline's"
    summary = bubble_summary(events, **shape)
    title = f"{schedule_text(**shape)}: {bubble_text(summary, what='predicted (unit costs, no communication)')}"
    return write_timeline(events, out_dir, title=title, xlabel="time (units: a forward = 1, drawn as 1 ms)"), summary


def timeline_pictures(recorder: Any, cfg: Any, *, tracker: Any, progress: Any,
                      out_dir: str | Path | None = None) -> dict[str, str]:
    """After the loop, on every rank (a collective): gather the recorded steps; rank 0 draws them
    into ``out_dir`` (the launcher's folder beside the run's logs; None: a temporary directory,
    removed after the upload, and no paths are returned), logs both files as MLflow artifacts under
    ``pictures/`` and, with a pipeline, the bubble as params (one number per run, in the overview).
    Returns ``{"timeline picture": path, "timeline trace": path}`` on rank 0, ``{}`` elsewhere or when
    nothing was recorded."""
    events = gather_events(recorder)
    if not events:
        return {}
    steps = sorted({e["step"] for e in events})
    pipeline = cfg.parallel.pipeline if cfg.parallel is not None else None
    if pipeline is not None:
        shape = dict(schedule=pipeline.schedule, pp_size=cfg.pp_size, stages_per_rank=pipeline.stages_per_rank,
                     microbatches=pipeline.microbatches)
        summary = bubble_summary(events, **shape)
        title = f"{schedule_text(**shape)}, steps {steps[0]}-{steps[-1]}: {bubble_text(summary)}"
        metrics = {"pipeline_bubble": summary["measured"], "pipeline_bubble_predicted": summary["predicted"]}
        if summary["theory"] is not None:
            metrics["pipeline_bubble_theory"] = summary["theory"]
        tracker.log_summary(metrics)  # once per run: the overview's params, not one-point charts
    else:
        summary, title = None, f"no pipeline, steps {steps[0]}-{steps[-1]}: forward + backward and optimizer per rank"
    bubble = f"; {bubble_text(summary)}" if summary else ""
    if out_dir is None:  # train() called directly (no launcher): the files go to MLflow only
        with tempfile.TemporaryDirectory(prefix="meshflow-pictures-") as tmp:
            for path in write_timeline(events, Path(tmp), title=title).values():
                tracker.log_artifact(path, "pictures")
        progress.log(f"pictures: timeline drawn{bubble}")
        return {}
    paths = write_timeline(events, Path(out_dir), title=title)
    for path in paths.values():
        tracker.log_artifact(path, "pictures")
    progress.log(f"pictures: timeline {paths['timeline_png']} (Chrome trace {paths['timeline_trace'].name}){bubble}")
    return {"timeline picture": str(paths["timeline_png"]), "timeline trace": str(paths["timeline_trace"])}
