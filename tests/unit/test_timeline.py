"""The pipeline timeline without processes: torch's order built without a process group, its
unit-cost layout and bubble against the published formulas, the Chrome trace and PNG writers, the
dry run's pictures, and the recorder on one device (the multi-process recording is checked in
tests/dist/test_parallel.py).

    python -m pytest tests/unit/test_timeline.py -q
"""

from __future__ import annotations

import json
import tempfile
import time

import pytest
import torch

from parallel.engine import parallelize
from parallel.pipeline.order import (
    bubble_fractions,
    compute_order,
    parse_action,
    predicted_events,
    schedule_order,
    theory_bubble,
)
from parallel.pipeline.timeline import TimelineRecorder
from parallel.plan.resolve import resolve_plan
from trainer.config.schema import MLPConfig
from trainer.models import build_model, loss_fn_for
from trainer.pictures.timeline_chart import gather_events, timeline_pictures, write_timeline
from trainer.planner.numbers import plan_numbers

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SHAPES = [(2, 4), (2, 8), (4, 4), (4, 8), (3, 5)]  # (p, m)


def _predicted(schedule: str, p: int, v: int, m: int) -> list[dict]:
    order = schedule_order(schedule, pp_size=p, stages_per_rank=v, microbatches=m)
    return predicted_events(order, num_stages=p * v)


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize("p, m", SHAPES)
def test_predicted_bubble_of_gpipe_and_1f1b_is_exactly_the_formula(schedule, p, m):
    bubble = bubble_fractions(_predicted(schedule, p, 1, m))
    assert bubble["mean"] == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert all(b == pytest.approx((p - 1) / (m + p - 1), abs=1e-12) for b in bubble["per_rank"].values())
    assert theory_bubble(schedule, pp_size=p, stages_per_rank=1, microbatches=m) == ((p - 1) / (m + p - 1),
                                                                                     "(p-1)/(m+p-1)")


@pytest.mark.parametrize("schedule, v, formula", [("Interleaved1F1B", 2, lambda p, v, m: (p - 1) / (v * m + p - 1)),
                                                  ("InterleavedZeroBubble", 2, lambda p, v,
                                                   m: (p - 1) / (3 * v * m + p - 1))])
@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (4, 8)])
def test_interleaved_and_zero_bubble_theory_is_what_torchs_order_gives(schedule, v, formula, p, m):
    theory, _ = theory_bubble(schedule, pp_size=p, stages_per_rank=v, microbatches=m)
    assert theory == pytest.approx(formula(p, v, m))
    assert bubble_fractions(_predicted(schedule, p, v, m))["mean"] == pytest.approx(theory, abs=1e-12)


def test_zbv_has_no_theory_but_a_prediction():
    theory, reason = theory_bubble("ZBV", pp_size=2, stages_per_rank=2, microbatches=4)
    assert theory is None and reason.startswith("n/a")
    assert 0 < bubble_fractions(_predicted("ZBV", 2, 2, 4))["mean"] < (2 - 1) / (4 + 2 - 1)


def test_order_is_torchs_with_1f1b_forwards_numbered_from_zero():
    assert schedule_order("GPipe", pp_size=2, stages_per_rank=1, microbatches=3) == {
        0: ["0F0", "0F1", "0F2", "0B0", "0B1", "0B2"], 1: ["1F0", "1F1", "1F2", "1B0", "1B1", "1B2"]}
    # torch 2.13 numbers the last rank's forwards 1..m; the schedule runs 0..m-1 (see compute_order).
    assert schedule_order("1F1B", pp_size=2, stages_per_rank=1, microbatches=4) == {
        0: ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"],
        1: ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"]}
    zbv = schedule_order("ZBV", pp_size=2, stages_per_rank=2, microbatches=4)
    assert {parse_action(a)[0] for a in zbv[0]} == {0, 3} and {parse_action(a)[1] for a in zbv[1]} == {"F", "I", "W"}
    for actions in zbv.values():  # every stage runs each micro-batch's F, I and W once
        assert sorted(actions) == sorted(f"{s}{k}{mb}" for s in {parse_action(a)[0] for a in actions}
                                         for k in "FIW" for mb in range(4))


def test_compute_order_drops_communication_and_idle_steps():
    from torch.distributed.pipelining.schedules import _Action

    order = {0: [None, _Action.from_str("0F0"), _Action.from_str("0SEND_F0"), _Action.from_str("0B0")]}
    assert compute_order(order) == {0: ["0F0", "0B0"]}


@pytest.mark.parametrize("schedule, v", [("1F1B", 1), ("Interleaved1F1B", 2), ("ZBV", 2)])
def test_predicted_layout_keeps_ranks_serial_and_data_dependencies(schedule, v):
    events = _predicted(schedule, 2, v, 4)
    end = {e["name"]: e["end_us"] for e in events}
    for rank in (0, 1):
        mine = sorted((e for e in events if e["rank"] == rank), key=lambda e: e["start_us"])
        assert all(a["end_us"] <= b["start_us"] for a, b in zip(mine, mine[1:]))
    for e in events:
        if e["kind"] == "F" and e["stage"] > 0:
            assert e["start_us"] >= end[f"{e['stage'] - 1}F{e['microbatch']}"]
        if e["kind"] in ("B", "I") and e["stage"] < 2 * v - 1:
            before = end.get(f"{e['stage'] + 1}B{e['microbatch']}", end.get(f"{e['stage'] + 1}I{e['microbatch']}"))
            assert e["start_us"] >= before


def test_bubble_sums_busy_time_and_span_over_steps():
    def ev(rank, start, end, step, kind="F"):
        return {"rank": rank, "name": "x", "kind": kind, "start_us": start, "end_us": end, "step": step}

    events = [ev(0, 0, 10, 1), ev(1, 5, 10, 1), ev(1, 10, 11, 1, kind="SEND_F"),  # span 10: busy 10 and 5
              ev(0, 100, 120, 2), ev(1, 100, 110, 2), ev(0, 120, 200, 2, kind="OPT")]  # span 20: busy 20 and 10
    bubble = bubble_fractions(events)
    assert bubble["per_rank"] == {0: 0.0, 1: pytest.approx(1 - 15 / 30)}
    assert bubble["mean"] == pytest.approx(0.25)
    assert bubble_fractions([ev(0, 0, 5, 1, kind="OPT")]) == {"per_rank": {}, "mean": None}


def test_chrome_trace_has_one_process_per_rank_and_nesting_threads(tmp_path):
    events = _predicted("1F1B", 4, 1, 8)
    # Two overlapping sends on rank 0: they must land on different threads (complete events nest).
    events += [{"rank": 0, "name": "0SEND_F0", "kind": "SEND_F", "stage": 0, "microbatch": 0, "start_us": 1000.0,
                "end_us": 5000.0, "step": 0, "peer": 1, "wait_us": 3.0},
               {"rank": 0, "name": "0SEND_F1", "kind": "SEND_F", "stage": 0, "microbatch": 1, "start_us": 2000.0,
                "end_us": 6000.0, "step": 0, "peer": 1, "wait_us": 1.0}]
    paths = write_timeline(events, tmp_path / "out", title="1F1B p=4 m=8")
    trace = json.loads(paths["timeline_trace"].read_text())
    assert paths["timeline_trace"].name == "timeline.json" and trace["otherData"]["title"] == "1F1B p=4 m=8"
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"
             and e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(4)}
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(events) and min(e["ts"] for e in complete) == 0
    for pid in range(4):
        compute = [e for e in complete if e["pid"] == pid and e["tid"] == 0]
        assert [e["name"] for e in compute] == schedule_order("1F1B", pp_size=4, stages_per_rank=1, microbatches=8)[pid]
    sends = [e for e in complete if e["cat"] == "SEND_F"]
    assert sorted(e["tid"] for e in sends) == [1, 2] and sends[0]["args"]["peer"] == 1
    png = paths["timeline_png"].read_bytes()
    assert paths["timeline_png"].name == "timeline.png" and png.startswith(PNG_SIGNATURE) and len(png) > 10_000


def test_dry_run_writes_the_predicted_timeline_and_names_it(compose, tmp_path):
    from trainer.planner.report import describe_plan

    cfg = compose("+parallel=pp", "mesh=[2]", "parallel.pipeline.schedule=GPipe", "tracking=none")
    plan = resolve_plan(cfg.parallel, cfg.mesh, build_model(cfg.model, device="meta"))
    text = describe_plan(cfg, plan, pictures_dir=tmp_path / "plan")
    line = text.splitlines()[-1]
    assert line.startswith(f"pictures: predicted timeline {tmp_path / 'plan' / 'timeline.png'} ")
    assert "predicted bubble 20.0%, theory (p-1)/(m+p-1) = 20.0%" in line
    trace = json.loads((tmp_path / "plan" / "timeline.json").read_text())
    assert "GPipe p=2 m=4" in trace["otherData"]["title"]
    off = compose("+parallel=pp", "mesh=[2]", "tracking=none", "tracking.pictures=false")
    assert "pictures:" not in describe_plan(off, plan,
                                            pictures_dir=tmp_path / "off") and not (tmp_path / "off").exists()


class _Tracker:
    run_id = "4f2a"

    def __init__(self):
        self.metrics, self.summary, self.artifacts = {}, {}, []

    def log_metrics(self, metrics, step):
        self.metrics.update(metrics)

    def log_summary(self, values):
        self.summary.update(values)

    def log_artifact(self, path, artifact_dir=None):
        self.artifacts.append((path.name, artifact_dir))


class _Progress:
    def __init__(self):
        self.lines = []

    def log(self, message):
        self.lines.append(message)


def _one_device():
    model_cfg = MLPConfig(in_features=8, hidden_features=16, out_features=4)
    model = build_model(model_cfg, seed=0)
    return parallelize(model, resolve_plan(None, None, model), device=torch.device("cpu")), loss_fn_for(model_cfg)


def test_recorder_on_one_device_times_forward_backward_and_optimizer_and_wraps_only_while_recording():
    pm, loss_fn = _one_device()
    optimizer = torch.optim.SGD(list(pm.parameters()), lr=0.1)
    recorder = TimelineRecorder(pm)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    for step in (1, 2, 3):
        with recorder.step(step, record=step >= 2):
            assert ("forward_backward" in vars(pm)) == (step >= 2)  # wrapped only in a recorded step
            pm.forward_backward(x, y, loss_fn)
            with recorder.mark("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
        assert "forward_backward" not in vars(pm) and not recorder.recording
    assert [(e["step"], e["name"], e["kind"]) for e in recorder.events] == [
        (2, "forward_backward", "FB"), (2, "optimizer", "OPT"), (3, "forward_backward", "FB"), (3, "optimizer", "OPT")]
    assert all(e["rank"] == 0 and e["start_us"] <= e["end_us"] for e in recorder.events)
    assert all(a["end_us"] <= b["start_us"] for a, b in zip(recorder.events, recorder.events[1:]))
    assert gather_events(recorder) == recorder.events  # no process group: this rank's own, sorted
    clock = recorder.clock()
    assert abs(clock["wall_minus_monotonic_us"] / 1e6 - (time.time() - time.monotonic())) < 1


def test_run_pictures_log_artifacts_the_bubble_and_print_paths(compose, tmp_path, monkeypatch):
    """What the loop calls after its last step: files, MLflow artifacts under pictures/, the
    bubble with a pipeline (a stand-in recorder holding a two-rank 1F1B timeline): once-per-run
    numbers, logged as the run's params (its overview), not as one-point metric charts."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a direct train() call draws (then removes)
    cfg = compose("+parallel=pp", "mesh=[2]", "tracking=none")
    recorder = type("Recorded", (), {"events": _predicted("1F1B", 2, 1, 4), "clock": lambda self: {}})()
    tracker, progress = _Tracker(), _Progress()
    paths = timeline_pictures(recorder, cfg, tracker=tracker, progress=progress, out_dir=tmp_path / "pictures")
    assert set(paths) == {"timeline trace", "timeline picture"}
    assert sorted(tracker.artifacts) == [("timeline.json", "pictures"), ("timeline.png", "pictures")]
    assert tracker.summary == {"pipeline_bubble": pytest.approx(0.2), "pipeline_bubble_theory": pytest.approx(0.2),
                               "pipeline_bubble_predicted": pytest.approx(0.2)}
    assert tracker.metrics == {}
    assert progress.lines[0].startswith(f"pictures: timeline {paths['timeline picture']} ")
    assert open(paths["timeline picture"], "rb").read(8) == PNG_SIGNATURE
    assert paths["timeline picture"] == str(tmp_path / "pictures" / "timeline.png")
    # Called without a folder (train() outside the launcher): uploaded, then nothing left on disk.
    tracker = _Tracker()
    assert timeline_pictures(recorder, cfg, tracker=tracker, progress=_Progress()) == {}
    assert len(tracker.artifacts) == 2 and not list(tmp_path.glob("meshflow-pictures-*"))
    # Without a pipeline there is a picture but no bubble.
    pm, loss_fn = _one_device()
    recorder, tracker = TimelineRecorder(pm), _Tracker()
    with recorder.step(1):
        pm.forward_backward(torch.randn(2, 8), torch.randn(2, 4), loss_fn)
    assert set(timeline_pictures(recorder, compose("tracking=none"), tracker=tracker, progress=_Progress(),
                                 out_dir=tmp_path / "one")) == {"timeline trace", "timeline picture"}
    assert tracker.metrics == tracker.summary == {} and len(tracker.artifacts) == 2


@pytest.mark.parametrize("schedule, expected", [("InterleavedZeroBubble", 1 / 25), ("ZBV", None)])
def test_the_plans_bubble_is_the_schedules_own(compose, schedule, expected):
    """The dry run's and REST plan's ``bubble``: the zero-bubble schedules' theory, or (ZBV) the
    unit-cost layout of torch's order, not interleaved 1F1B's (p-1)/(v*m+p-1) = 1/9."""
    cfg = compose("+parallel=pp", "mesh=[2]", f"parallel.pipeline.schedule={schedule}",
                  "parallel.pipeline.stages_per_rank=2", "tracking=none")
    plan = resolve_plan(cfg.parallel, cfg.mesh, build_model(cfg.model, device="meta"))
    predicted = bubble_fractions(_predicted(schedule, 2, 2, 4))["mean"]
    assert plan_numbers(cfg, plan).bubble == pytest.approx(expected if expected is not None else predicted)


def test_dry_run_names_why_torch_refuses_to_order_a_shape(tmp_path):
    """A dry run despite batch errors (1F1B with fewer micro-batches than ranks) still prints its
    plan; the picture line says why there is none."""
    from trainer.config.compose import compose_dict
    from trainer.config.schema import RunConfig
    from trainer.planner.report import describe_plan
    from trainer.validate.model_checks import check_against_model

    cfg = RunConfig.model_validate(compose_dict(["+parallel=pp", "mesh=[4]", "parallel.pipeline.microbatches=2",
                                                 "tracking=none"]))
    plan, _ = check_against_model(cfg)
    line = describe_plan(cfg, plan, pictures_dir=tmp_path).splitlines()[-1]
    assert line.startswith("pictures: no predicted timeline (Number of microbatches (2) must be greater")
