"""trainer.calibrate: the fits, the schema's JSON round trip, extrapolation to unmeasured groups, the cache."""

from __future__ import annotations

import pytest

from trainer.planner.calibration.probe import load_or_probe, probe
from trainer.planner.cost.calibration import Calibration, Fit, fit_line
from timing import scaled, slowness


def _calibration(workers: int = 8) -> Calibration:
    line = Fit(latency_s=1e-4, rate=1e9)
    return Calibration(host="h", device="cpu:test", workers=workers, matmul={"fp32": Fit(1e-5, 1e10)},
                       elementwise=Fit(2e-6, 5e9),
                       collectives={op: {2: line, 4: Fit(3e-4, 5e8)} for op in
                                    ("all_reduce", "all_gather", "reduce_scatter", "send_recv")})


def test_fit_line_recovers_latency_and_rate():
    sizes = [1e3, 1e5, 1e7]
    fit = fit_line(sizes, [2e-4 + s / 3e8 for s in sizes])
    assert fit.latency_s == pytest.approx(2e-4, rel=1e-6)
    assert fit.rate == pytest.approx(3e8, rel=1e-6)
    assert fit.time(1e6) == pytest.approx(2e-4 + 1e6 / 3e8)


def test_json_round_trip_keeps_every_field():
    cal = _calibration()
    back = Calibration.from_json(cal.to_json())
    assert back == cal
    assert back.collectives["all_gather"][4].rate == 5e8  # group sizes come back as ints


def test_collective_time_measured_and_extrapolated():
    cal = _calibration()
    assert cal.collective_time("all_reduce", 1, 1e6) == 0.0  # a group of one moves nothing
    assert cal.collective_time("all_reduce", 2, 1e6) == pytest.approx(1e-4 + 1e6 / 1e9)
    # 8 ranks from the fit at 4: latency x (8-1)/(4-1) ring steps, bandwidth x (7/8)/(3/4) share sent
    assert cal.collective_time("all_gather", 8, 1e6) == pytest.approx(3e-4 * 7 / 3 + 1e6 * (7 / 8) / (3 / 4) / 5e8)


def test_one_worker_probe_is_cached(tmp_path):
    first = load_or_probe(1, [], root=tmp_path)
    assert first.workers == 1 and first.matmul["fp32"].rate > 1e8  # any CPU does 0.1 GFLOP/s
    assert first.collectives["all_reduce"] == {}
    assert len(list(tmp_path.glob("*.json"))) == 1 and not list(tmp_path.glob("*.tmp"))  # written whole
    again = load_or_probe(1, [], root=tmp_path)
    assert again.created == first.created  # read from the cache, not probed again
    # the framework terms: an op inside a module's forward + backward pays more than a raw call
    assert first.op_latency_s > first.elementwise.latency_s and first.op_latency_s > 0
    assert first.optimizer_tensor_s > 0


def test_framework_terms_floor_every_call_and_the_optimizer():
    from dataclasses import replace

    from trainer.planner.cost.model import Work, count_calls

    cal = _calibration()
    work = Work(matmul_calls=10, other_calls=30)
    assert work.seconds(cal, "fp32") == pytest.approx(10 * 1e-5 + 30 * 2e-6)
    slow = replace(cal, op_latency_s=5e-5)
    assert work.seconds(slow, "fp32") == pytest.approx(40 * 5e-5)  # every call at least the framework's latency
    import torch

    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    assert count_calls(lambda: lin(x).sum().backward()) >= 4  # addmm, sum; backward: mm, sum, ...


def test_two_workers_measure_collectives():
    cal = probe(2, [2])
    for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv"):
        fit = cal.collectives[op][2]
        # loopback gloo: > 1 MB/s, a call under 100 ms (idle host; scaled by its slowness, tests/timing.py)
        assert fit.rate > 1e6 / slowness() and fit.latency_s < scaled(0.1)
    assert cal.cores >= 1 and cal.dtensor_linear_s > 0 and cal.optimizer_dtensor_tensor_s > 0
    # real steps of the reference decoder over both workers, each slower than nothing and finite
    assert set(cal.step_efficiency) == {"ddp", "fsdp", "tp"} and all(0.1 < r < 20 for r in cal.step_efficiency.values())
    # a two-stage pipeline's step, per schedule action: two workers have no pp x tp2 reference
    assert 0.0 <= cal.schedule_action_s < scaled(1.0) and cal.pipelined_tp_collective_s == 0.0


def test_reference_steps_are_the_engines_layouts_and_round_trip():
    from dataclasses import replace

    from trainer.planner.calibration.framework import STEP_MODEL, reference_step, step_efficiency
    from trainer.planner.cost.model import predict_step_time
    from trainer.planner.cost.reference import layout_degrees

    cal = replace(_calibration(), step_efficiency={"ddp": 1.25, "tp": 1.5})
    assert Calibration.from_json(cal.to_json()).step_efficiency == {"ddp": 1.25, "tp": 1.5}
    for family in ("ddp", "fsdp", "tp"):
        cfg, plan = reference_step(family, 8)
        assert layout_degrees(plan) == {family: 8}  # each reference uses one family over all workers
        assert cfg.train.global_batch_size == 16 and cfg.model.n_layers == STEP_MODEL["n_layers"]
    assert reference_step("tp", 16) is None  # tp16 cannot split 8 heads: no tp reference there
    assert reference_step("ddp", 1) is None
    # the ratio is measured over the prediction made without any ratio
    cfg, plan = reference_step("fsdp", 8)
    predicted = predict_step_time(cfg, plan, _calibration()).total_s
    assert step_efficiency(cal, {"fsdp": 2 * predicted}) == pytest.approx({"fsdp": 2.0})


def test_pipelined_references_measure_a_cost_per_schedule_action_and_tp_all_reduce():
    from dataclasses import replace

    from trainer.planner.calibration.framework import pipeline_costs, reference_step, step_efficiency
    from trainer.planner.cost.model import predict_step_time
    from trainer.planner.cost.reference import layout_degrees, pipelined_tp_collectives, schedule_actions

    cfg, plan = reference_step("pp", 8)  # dp4(ddp) x pp2, 1F1B over 4 micro-batches
    assert plan.mesh.shape == (4, 2) and plan.pp_size == 2 and layout_degrees(plan) == {"ddp": 4}
    assert plan.pipeline.schedule == "1F1B" and schedule_actions(plan) == 8  # 4 forwards, 4 backwards
    assert pipelined_tp_collectives(plan) == 0
    cfg3, plan3 = reference_step("pp_tp", 8)  # the 3-D layout: dp2 x pp2 x tp2
    assert plan3.mesh.shape == (2, 2, 2) and layout_degrees(plan3) == {"ddp": 2, "tp": 2}
    assert pipelined_tp_collectives(plan3) == 4 * 2 * 4  # per block and micro-batch, two blocks a stage
    assert reference_step("pp", 2)[1].mesh.shape == (2,)  # a pipeline alone
    assert reference_step("pp_tp", 2) is None and reference_step("pp", 3) is None
    # the residues over the prediction with the dp and tp ratios: pp's per action; pp_tp's beyond
    # its actions' cost, per tp all-reduce; never below 0
    cal = replace(_calibration(), step_efficiency={"ddp": 1.5, "tp": 2.0})
    predicted = predict_step_time(cfg, plan, cal).total_s
    predicted3 = predict_step_time(cfg3, plan3, cal).total_s
    measured = {"ddp": 1.0, "pp": predicted + 8 * 0.01, "pp_tp": predicted3 + 8 * 0.01 + 32 * 0.005}
    assert pipeline_costs(cal, measured) == pytest.approx((0.01, 0.005))
    assert pipeline_costs(cal, {**measured, "pp_tp": predicted3}) == pytest.approx((0.01, 0.0))
    assert pipeline_costs(cal, {"ddp": 1.0}) == (0.0, 0.0)  # no pipelined reference: nothing to pay
    assert set(step_efficiency(cal, measured)) == {"ddp"}  # the pipelines are no ratio
    paid = replace(cal, schedule_action_s=0.01, pipelined_tp_collective_s=0.005)
    assert Calibration.from_json(paid.to_json()) == paid
    assert predict_step_time(cfg, plan, paid).total_s == pytest.approx(predicted + 0.08)
    assert predict_step_time(cfg3, plan3, paid).total_s == pytest.approx(predicted3 + 0.08 + 0.16)
