"""The auto-planner says how far it is, and never pays twice for what it knows: each meta pass key
is traced once, each resolution shared by the candidates it serves equals their own.

    python -m pytest tests/unit/test_auto_progress.py -q
"""

from __future__ import annotations

import pytest

from parallel.plan.resolve import resolve_plan
from trainer.config.compose import compose_dict
from trainer.planner.auto import search as search_module
from trainer.planner.auto.plan import plan_layouts
from trainer.planner.auto.search import Progress
from trainer.planner.memory import predict as predict_module
from trainer.planner.memory.pass_cache import pass_key
from trainer.validate.model_checks import check_heads

# gpt_debug on 32 H100s: every split of 32 ranks, one schedule, no checkpointing (a few hundred layouts).
AUTO = ["+parallel=auto", "mesh=[32]", "hardware=h100_sxm", "launch.nnodes=4", "dry_run=true",
        "tracking.pictures=false",
        "+parallel.auto.schedules=[1F1B]", "+parallel.auto.activation_checkpointing=[none]"]


def test_progress_lines_say_what_the_search_did():
    lines: list[str] = []
    result = plan_layouts(compose_dict(AUTO), progress=lines.append)
    statuses = [c.status for c in result.candidates]
    assert lines[0].endswith("enumerating: starting")
    valid = sum(s != "invalid" and c.lower_bound_s is not None for s, c in zip(statuses, result.candidates))
    assert any(f"pricing the {valid} valid layouts, lowest bound first" in line for line in lines)
    last = lines[-1]
    assert " done: " in last and f"{len(result.candidates)} considered" in last
    assert f"{statuses.count('invalid')} invalid" in last
    priced = sum(c.step_s is not None for c in result.candidates if c.status != "invalid")
    assert f"{priced} priced" in last and f"best so far {result.winner.label}" in last
    assert (f"{statuses.count('pruned')} pruned" in last) == (statuses.count("pruned") > 0)


def test_progress_is_said_at_most_every_few_seconds_within_a_phase():
    now = [0.0]
    said: list[str] = []
    progress = Progress(said.append, every_s=5.0, clock=lambda: now[0])
    for t in (1.0, 4.9, 5.0, 7.0, 10.5):
        now[0] = t
        progress.count("considered")
        progress.tick("validating")
    assert said == ["auto plan [5 s] validating: 3 considered", "auto plan [10 s] validating: 5 considered"]
    progress.tick("done", force=True)
    assert said[-1] == "auto plan [10 s] done: 5 considered"


def test_the_search_traces_each_pass_key_once(monkeypatch):
    memory_keys: list[tuple] = []
    cost_keys: list[tuple] = []
    saved_activations = predict_module.saved_activations

    def counted_memory(cfg, plan, micro_batch, **kwargs):
        memory_keys.append(pass_key(cfg, plan, micro_batch, kwargs.get("attention")))
        return saved_activations(cfg, plan, micro_batch, **kwargs)

    device_unit_costs = search_module.ProfilePricing.unit_costs

    def counted_costs(self, cfg, plan, micro, model):
        cost_keys.append(pass_key(cfg, plan, micro, None))
        return device_unit_costs(self, cfg, plan, micro, model)

    monkeypatch.setattr(predict_module, "saved_activations", counted_memory)
    monkeypatch.setattr(search_module.ProfilePricing, "unit_costs", counted_costs)
    result = plan_layouts(compose_dict(AUTO))
    assert sum(c.step_s is not None for c in result.candidates) > 10  # many layouts priced ...
    assert len(memory_keys) == len(set(memory_keys)) and len(cost_keys) == len(set(cost_keys))  # ... each pass once
    assert 1 <= len(memory_keys) < 20 and 1 <= len(cost_keys) < 20


@pytest.mark.parametrize("index", range(0, 60, 7))
def test_a_shared_resolution_equals_the_candidates_own(index):
    """The search resolves once per tp, pp, cp, ep and stages per rank and sets each candidate's mesh, dp
    mode, schedule and micro-batches on a copy: the copy equals resolve_plan of the candidate itself."""
    raw = compose_dict(AUTO)
    from trainer.config.schema import RunConfig
    from trainer.planner.forecast.pricing import pricing_for
    from parallel.config import AutoPlanConfig

    base = RunConfig.model_validate({**raw, "mesh": None, "parallel": None})
    search = search_module.Search(raw, base, AutoPlanConfig.model_validate(raw["parallel"]["auto"]), 32,
                                  pricing_for(base))
    valid = []
    for c in search.layouts():
        checked = search.validate(c)
        if checked is not None:
            valid.append(checked)
    cfg, plan = valid[index % len(valid)]
    own = resolve_plan(cfg.parallel, cfg.mesh, search.model,
                       check_glob=lambda *glob: check_heads(search.decoder, *glob))
    assert plan == own


@pytest.mark.parametrize("layout", [["mesh=[1]"], ["+parallel=tp", "mesh=[2]"], ["+parallel=3d", "mesh=[2,2,2]"]])
def test_a_pass_over_two_alike_blocks_prices_every_block_exactly(layout):
    """gpt_small's 8 blocks are alike: the search's two-block pass gives each unit the work of the
    full model's pass, to the FLOP and the second."""
    from parallel.config import AutoPlanConfig
    from trainer.planner.cost.device import device_unit_costs
    from trainer.planner.cost.speed import DeviceSpeed
    from trainer.planner.forecast.pricing import pricing_for
    from trainer.validate.checks import validate_with_plan

    cfg, plan = validate_with_plan(compose_dict(["model=gpt_small", *layout, "hardware=h100_sxm", "dry_run=true"]))
    search = search_module.Search(compose_dict(AUTO), cfg, AutoPlanConfig(), 8, pricing_for(cfg))
    assert search._shallow() is not None and len(search._shallow().layers) == 2
    speed = DeviceSpeed.of(cfg.hardware, cfg.train.precision)
    full = device_unit_costs(cfg, plan, 4, speed, model=search.model)
    cut = search.unit_costs(cfg, plan, 4, lambda c, p, m, model: device_unit_costs(c, p, m, speed, model=model))
    assert sorted(cut) == sorted(full) and len(full) == 8 + 3  # the blocks, the embedding, the norm, the output
    for unit, cost in full.items():
        assert cut[unit].forward_s == pytest.approx(cost.forward_s, rel=1e-12)
        assert cut[unit].backward_flops == pytest.approx(cost.backward_flops, rel=1e-12)


@pytest.mark.parametrize("layout", [["mesh=[1]"], ["+parallel=fsdp", "mesh=[4]"], ["+parallel=3d", "mesh=[2,2,2]"],
                                    ["+parallel=cp", "mesh=[2]", "train.seq_len=512"]])
def test_the_two_block_memory_floor_is_below_the_full_prediction(layout):
    """The floor has the saved activations of all 8 blocks exactly and leaves out backward's worst
    moment: below the full prediction, by less than that moment's bytes."""
    from parallel.config import AutoPlanConfig
    from trainer.planner.forecast.pricing import pricing_for
    from trainer.planner.memory.predict import predict_memory
    from trainer.validate.checks import validate_with_plan

    cfg, plan = validate_with_plan(compose_dict(["model=gpt_small", *layout, "hardware=h100_sxm", "dry_run=true"]))
    search = search_module.Search(compose_dict(AUTO), cfg, AutoPlanConfig(), 8, pricing_for(cfg))
    full = predict_memory(cfg, plan, model=search.model)
    floor = search.memory_floor(cfg, plan)
    worst = max(full, key=lambda e: e.total)
    assert worst.total - worst.parts.transient * 1.2 < floor <= worst.total
    assert floor > worst.params + worst.optimizer + worst.activations * 0.99
