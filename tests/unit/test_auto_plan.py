"""trainer.planner.auto.plan: enumeration, validation reasons, pruning against brute force, integration into
validation."""

from __future__ import annotations

import pytest

from parallel.config import AutoPlanConfig
from trainer.config.compose import compose_dict
from trainer.config.schema import RunConfig
from trainer.planner.auto.plan import plan_layouts, resolve_auto
from trainer.planner.auto.search import Search
from trainer.planner.cost.calibration import Calibration, Fit
from trainer.planner.forecast.pricing import HostPricing
from trainer.planner.memory.predict import predict_memory
from trainer.planner.numbers import plan_numbers
from trainer.validate.checks import validate_with_plan

CAL = Calibration(host="h", device="cpu:test", workers=8, matmul={"fp32": Fit(1e-5, 1e10)},
                  elementwise=Fit(2e-6, 5e9),
                  collectives={op: {g: Fit(1e-4 * g, 1e9 / g) for g in (2, 4, 8)}
                               for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv")})
NARROW = ["+parallel.auto.data_parallel_modes=[ddp,fsdp]", "+parallel.auto.schedules=[1F1B]",
          "+parallel.auto.microbatches=[2]", "+parallel.auto.activation_checkpointing=[none]",
          "+parallel.auto.grad_accum=[1]", "+parallel.auto.sequence_parallel=[false]"]


def _raw(*overrides):
    return compose_dict(["+parallel=auto", "dry_run=true", *overrides])


def test_two_ranks_enumerate_the_four_layouts():
    result = plan_layouts(_raw("mesh=[2]", *NARROW), calibration=CAL)
    labels = sorted(c.label for c in result.candidates)
    assert labels == ["dp2(ddp)", "dp2(fsdp)", "pp2(1F1B, m2)", "tp2"]
    assert result.winner.status == "chosen" and result.winner.step_s == min(
        c.step_s for c in result.candidates if c.step_s is not None and c.status != "pruned")
    assert all(c.status in ("chosen", "slower", "pruned") for c in result.candidates)


def test_invalid_layouts_say_why():
    result = plan_layouts(_raw("mesh=[8]", *NARROW), calibration=CAL)
    tp8 = next(c for c in result.candidates if c.label == "tp8")
    assert tp8.status == "invalid"
    assert "n_heads=4 over tp size 8" in tp8.reason  # gpt_debug has 4 heads
    # the structural checks hand-written configs meet: 1F1B needs a micro-batch per pipeline rank
    pp8 = next(c for c in result.candidates if c.label.startswith("pp8"))
    assert pp8.status == "invalid" and "2 < pp size 8" in pp8.reason


def test_losers_reasons_name_the_growth():
    result = plan_layouts(_raw("mesh=[4]", *NARROW), calibration=CAL)
    slower = [c for c in result.candidates if c.status == "slower"]
    assert slower
    for c in slower:
        pct = round((c.step_s / result.winner.step_s - 1) * 100)
        assert c.reason.startswith(f"slower: +{pct}% (+")


def test_pruning_keeps_the_brute_force_optimum():
    raw = _raw("mesh=[8]", "+parallel.auto.microbatches=[2,4]")
    result = plan_layouts(raw, calibration=CAL)
    assert any(c.status == "pruned" for c in result.candidates)  # the bound does prune
    search = Search(raw, RunConfig.model_validate({**raw, "mesh": None, "parallel": None}),
                    AutoPlanConfig(microbatches=[2, 4]), 8, HostPricing(CAL))
    times = []
    for c in search.layouts():
        checked = search.validate(c)
        if checked is not None:
            search.predict(c, *checked)
            if c.status == "slower":
                times.append(c.step_s)
    assert result.winner.step_s == pytest.approx(min(times))
    for c in result.candidates:  # a pruned candidate's bound is above the winner, and so its time
        if c.status == "pruned":
            assert c.lower_bound_s > result.winner.step_s


def test_a_section_failure_rejects_its_twins_with_the_validators_own_reason():
    """The search validates one candidate per failing tp degree / pipeline section and copies the
    reason to the rest: the verdicts equal validating every candidate afresh."""
    raw = _raw("mesh=[8]", "+parallel.auto.schedules=[1F1B,GPipe]")
    knobs = AutoPlanConfig(schedules=["1F1B", "GPipe"])
    base = RunConfig.model_validate({**raw, "mesh": None, "parallel": None})
    memo, fresh = Search(raw, base, knobs, 8, HostPricing(CAL)), Search(raw, base, knobs, 8, HostPricing(CAL))
    verdicts = {"memo": [], "fresh": []}
    for c in memo.layouts():
        verdicts["memo"].append((c.label, memo.validate(c) is None, c.reason))
    for c in fresh.layouts():
        fresh._failed.clear()
        verdicts["fresh"].append((c.label, fresh.validate(c) is None, c.reason))
    assert verdicts["memo"] == verdicts["fresh"]
    assert sum(invalid for _, invalid, _ in verdicts["memo"]) > 2 * len(memo._failed) > 0


def test_memory_budget_drops_layouts_that_do_not_fit():
    result = plan_layouts(_raw("mesh=[2]", *NARROW, "launch.memory_budget_gb=0.01"), calibration=CAL)
    assert result.winner.status != "chosen"
    assert all(c.reason.startswith("does not fit:") and "> 0.01 GiB budget" in c.reason
               for c in result.candidates if c.status == "does not fit")
    with pytest.raises(Exception, match="no layout of 2 ranks"):
        resolve_auto(_raw("mesh=[2]", *NARROW, "launch.memory_budget_gb=0.01"), calibration=CAL)


def test_the_winner_is_an_ordinary_config(monkeypatch):
    import trainer.planner.auto.plan as auto_plan

    monkeypatch.setattr(auto_plan, "host_calibration", lambda base, world: CAL)
    cfg, _, ranking = auto_plan.resolve_and_validate(_raw("mesh=[4]", *NARROW))
    assert ranking is not None and ranking.winner.status == "chosen"
    assert cfg.world_size == 4 and cfg.parallel.dims and cfg.parallel.auto is not None
    ranking = auto_plan.ranking_for(cfg, calibration=CAL)
    assert ranking.winner.parallel["dims"] == list(cfg.parallel.dims)


@pytest.mark.slow  # 2.7 s: a search with meta passes of an MoE model
def test_experts_are_split_over_ep_where_that_is_fastest_and_never_for_a_dense_model():
    """gpt_moe with wide experts (3.1M of its 3.2M parameters) on 4 ranks: ep4 holds a quarter of the experts
    and moves tokens by all-to-all (a few MiB) instead of all-reducing or gathering every expert (ten times
    that with ddp or fsdp), and wins; ep composes with fsdp only (no ddp x ep). A dense model is never given an ep
    axis."""
    raw = _raw("model=gpt_moe", "model.moe.hidden_dim=1024", "model.n_layers=2", "mesh=[4]",
               "+parallel.auto.tensor_parallel=false",
               "+parallel.auto.pipeline=false", "+parallel.auto.data_parallel_modes=[ddp,fsdp]",
               "+parallel.auto.activation_checkpointing=[none]", "+parallel.auto.grad_accum=[1]")
    result = plan_layouts(raw, calibration=CAL)
    assert sorted(c.label for c in result.candidates) == ["dp2(fsdp) x ep2", "dp4(ddp)", "dp4(fsdp)", "ep4"]
    winner = result.winner
    assert (winner.label, winner.status, winner.mesh) == ("ep4", "chosen", [4])
    assert winner.parallel["dims"] == ["ep"] and winner.parallel["expert_parallel"] == {"dim": "ep"}
    cfg, plan = validate_with_plan({**raw, "mesh": winner.mesh, "parallel": winner.parallel})  # as resolve_auto does
    # The search prices the traffic the dry run reports on ep: 4 all-to-alls per block of the rank's tokens'
    # top_k rows (3/4 leave the rank), and the all-reduce of the gradients beside the experts'.
    comm = plan_numbers(cfg, plan).comm
    assert winner.traffic == {"ep": pytest.approx(comm["ep all-to-all"] + comm["ep"])} and comm["ep all-to-all"] > 0
    assert winner.peak_bytes == max(e.total for e in predict_memory(cfg, plan))
    dense = _raw("mesh=[8]")
    search = Search(dense, RunConfig.model_validate({**dense, "mesh": None, "parallel": None}), AutoPlanConfig(), 8,
                    HostPricing(CAL))
    assert search._ep_sizes(8) == [1] and not any("ep" in c.parallel["dims"] for c in search.layouts())


def test_a_gpu_profile_keeps_layouts_within_the_measured_error_and_drops_those_beyond():
    """As the validator (trainer.planner.memory.budget): on a GPU profile a layout over the budget is
    dropped only beyond the prediction's measured error; within it, it is ranked, its reason says so."""
    from trainer.planner.memory.budget import PUBLISHED_MEMORY_ERROR

    profile = ["hardware=h100_sxm", "launch.nnodes=1", "mesh=[2]", *NARROW, "+parallel.auto.prune=false"]  # every peak
    peaks = [c.peak_bytes for c in plan_layouts(_raw(*profile)).candidates if c.peak_bytes]
    within = max(peaks) / (1 + PUBLISHED_MEMORY_ERROR / 2) / 2**30  # every layout above it, within its error
    assert min(peaks) / 2**30 > within
    kept = plan_layouts(_raw(*profile, f"launch.memory_budget_gb={within}"))
    assert kept.winner.status == "chosen"
    ranked = [c for c in kept.candidates if c.status in ("chosen", "slower")]
    assert len(ranked) == len(peaks) and all("may not fit:" in c.reason and
                                             f"within the {PUBLISHED_MEMORY_ERROR:.0%} measured error" in c.reason
                                             for c in ranked)
    beyond = min(peaks) / (1 + PUBLISHED_MEMORY_ERROR) / 1.01 / 2**30
    dropped = plan_layouts(_raw(*profile, f"launch.memory_budget_gb={beyond}"))
    assert all(c.status == "does not fit" and f"+ {PUBLISHED_MEMORY_ERROR:.0%} measured error" in c.reason
               for c in dropped.candidates if c.peak_bytes)


def test_the_choice_fits_when_a_layout_does_and_one_within_the_error_comes_after_it():
    """A faster layout above the budget (within the prediction's measured error) is not chosen while another
    is predicted to fit: the choice must be one the prediction says fits; the faster one is listed, saying why."""
    profile = ["hardware=h100_sxm", "launch.nnodes=1", "mesh=[2]", *NARROW, "+parallel.auto.prune=false"]
    every = sorted((c for c in plan_layouts(_raw(*profile)).candidates if c.peak_bytes), key=lambda c: c.peak_bytes)
    fits, fastest = every[0], min(every, key=lambda c: c.step_s)
    assert fits.label != fastest.label  # pp2 holds least here and is the slowest: the case under test
    budget = (every[0].peak_bytes + every[1].peak_bytes) / 2 / 2**30  # only the first fits
    for prune in ("true", "false"):
        result = plan_layouts(_raw(*profile[:-1], f"+parallel.auto.prune={prune}", f"launch.memory_budget_gb={budget}"))
        assert (result.winner.label, result.winner.reason) == (fits.label, "chosen: fastest predicted to fit")
        faster = [c for c in result.candidates if c.status == "slower" and c.step_s < result.winner.step_s]
        assert faster and all(c.reason.startswith("not chosen (-") and "against the choice, which fits); may not fit:"
                              in c.reason for c in faster), [c.reason for c in faster]
        assert result.candidates[0] is result.winner
