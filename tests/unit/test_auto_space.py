"""The auto-planner's candidates include the layouts practitioners write (sequence parallelism, gradient
accumulation, interleaved stages with a chosen micro-batch count, every other block checkpointed, the dp mode
under a pipeline), each priced exactly as the same layout written by hand; and its best-first search chooses
and ranks as pricing every layout would.

    python -m pytest tests/unit/test_auto_space.py -q
"""

from __future__ import annotations

import pytest

from parallel.config import AutoPlanConfig
from trainer.config.compose import compose_dict
from trainer.config.schema import RunConfig
from trainer.planner.auto.plan import plan_layouts, resolve_auto
from trainer.planner.auto.search import Search
from trainer.planner.cost.device import predict_on_profile
from trainer.planner.forecast.pricing import pricing_for
from trainer.planner.memory.budget import memory_margin
from trainer.planner.memory.predict import predict_memory
from trainer.validate.checks import validate_with_plan

# gpt_debug (4 blocks, 4 heads) on one node of 8 H100s, compiled as Megatron-like rows are priced.
BASE = ["+parallel=auto", "dry_run=true", "tracking.pictures=false", "hardware=h100_sxm", "launch.nnodes=1", "mesh=[8]",
        "train.precision=bf16", "train.compile=true"]
# Megatron's way: zero1 (zero2 here) over dp, interleaved stages, m micro-batches of the dp rank's batch, SP with tp.
PIPELINE = ("dp2(zero2) x pp2(Interleaved1F1B v2, m4) x tp2(sp), bf16", [2, 2, 2], {
    "dims": ["dp", "pp", "tp"], "data_parallel": {"dim": "dp", "mode": "zero2"},
    "pipeline": {"dim": "pp", "schedule": "Interleaved1F1B", "microbatches": 4, "stages_per_rank": 2,
                 "boundaries": "auto"},
    "tensor_parallel": {"dim": "tp", "plan": "megatron", "sequence_parallel": True}}, 1)
# torchtitan's and llm-foundry's way: FSDP, micro-batches accumulated, every other block checkpointed.
ACCUMULATED = ("dp4(fsdp) x tp2(sp), accum 4, AC full every 2, bf16", [4, 2], {
    "dims": ["dp", "tp"], "data_parallel": {"dim": "dp", "mode": "fsdp"},
    "tensor_parallel": {"dim": "tp", "plan": "megatron", "sequence_parallel": True},
    "activation_checkpointing": "full", "activation_checkpointing_every": 2}, 4)


def _raw(*overrides):
    return compose_dict([*BASE, *overrides])


def _search(raw: dict, knobs: AutoPlanConfig) -> Search:
    base = RunConfig.model_validate({**raw, "mesh": None, "parallel": None})
    return Search(raw, base, knobs, 8, pricing_for(base))


@pytest.mark.parametrize("label, mesh, parallel, accum", [PIPELINE, ACCUMULATED], ids=["pipeline", "accumulated"])
def test_a_layout_as_written_by_hand_is_a_candidate_priced_alike(label, mesh, parallel, accum):
    """The candidate of that label is the hand-written layout (mesh, section, train.grad_accum), and the search's
    time and memory (cached two-block passes) equal the dry run's of the hand-written config."""
    raw = _raw()
    search = _search(raw, AutoPlanConfig(precisions=["bf16"]))
    c = next(c for c in search.layouts() if c.label == label)
    assert c.mesh == mesh and c.grad_accum == accum
    written = {"activation_checkpointing": "none", "activation_checkpointing_every": 1, **parallel}
    assert {k: c.parallel.get(k) for k in written} == written
    cfg, plan = search.validate(c)
    search.predict(c, cfg, plan)
    hand_cfg, hand_plan = validate_with_plan({**raw, "mesh": mesh, "parallel": parallel,
                                              "train": {**raw["train"], "grad_accum": accum}})
    assert hand_cfg.train.compile and hand_cfg.micro_batch_size == cfg.micro_batch_size
    assert c.step_s == pytest.approx(predict_on_profile(hand_cfg, hand_plan, hand_cfg.hardware).total_s, rel=1e-9)
    assert c.peak_bytes == pytest.approx(max(e.total for e in predict_memory(hand_cfg, hand_plan)), rel=1e-9)


def test_knobs_narrow_the_new_choices():
    """Sequence parallelism only beside tp > 1; accumulation only without a pipeline (a pipeline's schedule
    runs the micro-batches); every other block only under full checkpointing; each knob narrows its choice."""
    search = _search(_raw(), AutoPlanConfig(precisions=["bf16"]))
    labels = [c.label for c in search.layouts()]
    assert not any("(sp)" in label and "tp" not in label for label in labels)
    assert not any("accum" in label and "pp" in label for label in labels)
    assert all("every" not in label or "AC full every 2" in label for label in labels)
    assert {c.grad_accum for c in search.layouts() if c.label.startswith("dp8(ddp)")} == {1, 2}  # 16 / 8 a rank
    narrow = _search(_raw(), AutoPlanConfig(precisions=["bf16"], sequence_parallel=[False], grad_accum=[1],
                                            activation_checkpointing_every=[1]))
    assert not any("(sp)" in c.label or "accum" in c.label or "every" in c.label for c in narrow.layouts())


def test_the_winner_trains_with_its_accumulation():
    raw = _raw("+parallel.auto.tensor_parallel=false", "+parallel.auto.pipeline=false", "+parallel.auto.grad_accum=[2]",
               "+parallel.auto.data_parallel_modes=[fsdp]")
    out, ranking = resolve_auto(raw)
    assert ranking.winner.grad_accum == 2 and out["train"]["grad_accum"] == 2
    cfg, _ = validate_with_plan(out)
    assert cfg.train.grad_accum == 2 and cfg.micro_batch_size * 2 * cfg.dp_size == cfg.train.global_batch_size


NARROW = ["mesh=[4]", "+parallel.auto.schedules=[1F1B]", "+parallel.auto.max_microbatches=2",
          "+parallel.auto.data_parallel_modes=[fsdp,zero2]", "+parallel.auto.activation_checkpointing=[none,full]"]


def test_best_first_chooses_and_ranks_as_pricing_every_layout():
    """Against every layout priced in full (prune=false), under a budget the fastest layout overflows (within the
    prediction's measured error: kept, not chosen): the same choice; memory predicted only for layouts no slower
    than it; every pruned layout's bound above it; and with
    rank_below a layout's rank is the exhaustive one. (A verdict is its peak against the budget's limit, so the
    exhaustive ranking under the budget is read off one run without it.)"""
    exhaustive = plan_layouts(_raw(*NARROW, "+parallel.auto.prune=false"))
    margin = memory_margin(RunConfig.model_validate({**_raw(*NARROW), "mesh": None, "parallel": None}))
    budget = exhaustive.winner.peak_bytes * (1 - 1e-6)  # the fastest layout just does not fit, within the error
    limit = budget * (1 + margin)
    # The choice is predicted to fit the budget itself; a layout within the measured error above it is kept, not chosen.
    fits = sorted(c.step_s for c in exhaustive.candidates if c.step_s is not None and c.peak_bytes <= budget)
    assert len(fits) >= 10 and fits[0] > exhaustive.winner.step_s
    over = [f"launch.memory_budget_gb={budget / 2**30!r}", *NARROW]
    fast = plan_layouts(_raw(*over))
    assert fast.winner.step_s == fits[0] and fast.winner.peak_bytes <= budget
    within = [c for c in fast.candidates if c.memory_note]
    assert all(budget < c.peak_bytes <= limit and c.status == "slower" for c in within)
    priced = [c for c in fast.candidates if c.step_s is not None]
    assert all(c.step_s <= fast.winner.step_s for c in priced if c.peak_bytes is not None)  # memory: no slower ones
    assert within and min(c.step_s for c in within) < fast.winner.step_s  # the faster ones: above the budget
    assert all(c.lower_bound_s > fast.winner.step_s for c in fast.candidates if c.status == "pruned")
    ranked = plan_layouts(_raw(*over), rank_below=fits[9])
    fitting = sorted(c.step_s for c in ranked.candidates
                     if c.status in ("chosen", "slower") and not c.memory_skipped and not c.memory_note)
    assert fitting[:10] == pytest.approx(fits[:10], rel=1e-12)  # the ten fastest that fit, each at its exact rank


def test_the_dry_run_of_the_choice_prices_the_step_its_ranking_shows(monkeypatch):
    """The search leaves its choice's unit costs (two alike blocks standing for all) for the dry run of that
    layout, which then traces no pass of the whole model and prints the step the ranking showed."""
    import trainer.planner.forecast.pricing as pricing_module
    from trainer.models import build_model

    out, ranking = resolve_auto(_raw(*NARROW))
    cfg, plan = validate_with_plan(out)

    def no_pass(*args, **kwargs):
        raise AssertionError("the dry run traced the whole model again")

    monkeypatch.setattr(pricing_module, "device_unit_costs", no_pass)
    pricing, model = pricing_for(cfg), build_model(cfg.model, device="meta")
    step = pricing.step(cfg, plan, pricing.unit_costs(cfg, plan, cfg.micro_batch_size, model), model)
    assert step.total_s == ranking.winner.step_s
