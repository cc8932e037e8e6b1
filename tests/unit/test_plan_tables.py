"""The per-parameter facts the planner reads, computed once inside ``parallel/`` and handed back as one table
(issue 45's road: one question per model, not one per parameter): the topology's holdings, the plan's units,
the placement tables; the config's topology kept; loss parallel decided where the head plan is read.

    python -m pytest tests/unit/test_plan_tables.py -q -n 0
"""

from __future__ import annotations

import warnings

import pytest

from parallel.placements import PlacementSpec, parse_placement_table, placement_texts, sharding_axes
from parallel.plan.resolve import resolve_plan
from parallel.plan.serial import plan_from_dict, plan_to_dict
from parallel.plan.spec import ParallelPlan
from parallel.topology import MeshSpec, Topology
from trainer.config.compose import compose_dict
from trainer.config.schema import RunConfig
from trainer.models.skeleton import meta_model
from trainer.planner.numbers import parameter_list
from trainer.validate.checks import validate_with_plan

SHARD0, SHARD1, REPLICATE = PlacementSpec("shard", 0), PlacementSpec("shard", 1), PlacementSpec("replicate")
EXPERT, DENSE, NORM = "layers.0.mlp.experts.w1", "layers.0.attn.wq.weight", "layers.0.attn_norm.weight"


def test_placement_tables_answer_for_every_row_in_one_call():
    table = {DENSE: {"tp": SHARD0, "dp": REPLICATE}, NORM: {}, EXPERT: {"ep": SHARD1, "tp": SHARD0}}
    texts = placement_texts(table)
    assert texts == {DENSE: {"tp": "Shard(0)", "dp": "Replicate()"}, NORM: {},
                     EXPERT: {"ep": "Shard(1)", "tp": "Shard(0)"}}
    assert parse_placement_table(texts) == table
    assert sharding_axes(table) == {DENSE: ("tp",), NORM: (), EXPERT: ("ep", "tp")}
    layouts = {("norm", "input"): {"tp": "Shard(1)"}, ("norm", "output"): {}}  # any hashable key
    assert parse_placement_table(layouts) == {("norm", "input"): {"tp": SHARD1}, ("norm", "output"): {}}


@pytest.mark.parametrize("mode", ["fsdp", "hsdp", "zero1", None])
def test_the_holdings_table_is_each_parameters_holding(mode):
    dims, shape = (("dp_replicate", "dp_shard", "ep", "tp"), (2, 2, 4, 2)) if mode == "hsdp" else \
        (("dp", "ep", "tp"), (2, 4, 2))
    dp_axes = tuple(a for a in dims if a.startswith("dp")) if mode else ()
    topo = Topology(MeshSpec(shape, dims), dp_axes=dp_axes, dp_mode=mode, ep_axis="ep",
                    expert_modules=("layers.0.mlp.experts",), tp_axes=("tp",))
    placements = {DENSE: {"tp": SHARD0}, EXPERT: {"tp": SHARD1, "ep": REPLICATE}, "other.weight": {"tp": REPLICATE}}
    fqns = [DENSE, EXPERT, NORM, "other.weight"]
    table = topo.holdings(fqns, placements)
    assert table == {fqn: topo.holding(fqn, placements.get(fqn, {})) for fqn in fqns}
    # an expert: tp x ep blocks (its Replicate on ep overridden by the engine's Shard(0)), FSDP over dp alone
    expected_dp = {"fsdp": 2, "hsdp": 2, "zero1": 1, None: 1}[mode]
    assert table[EXPERT] == (2 * 4, expected_dp, True)
    assert table[NORM][0] == 1 and table[DENSE][0] == 2 and table["other.weight"][0] == 1


def test_a_resolved_plans_holdings_and_units_match_the_per_parameter_answers():
    cfg, plan = validate_with_plan(compose_dict(["+parallel=3d_ep", "mesh=[2,2,2]", "model=gpt_moe",
                                                 "tracking=none"]))
    assert plan is not None
    fqns = [fqn for fqn, _, _ in parameter_list(meta_model(cfg.model))]
    table = plan.topology.holdings(fqns, plan.placements)
    assert table == {fqn: plan.topology.holding(fqn, plan.placements.get(fqn, {})) for fqn in fqns}
    assert any(expert for _, _, expert in table.values()) and any(tp > 1 for tp, _, _ in table.values())
    assert plan.units_of(fqns) == {fqn: plan.unit_of(fqn) for fqn in fqns}
    with pytest.raises(KeyError, match="is in none of the model's units"):
        ParallelPlan(units=("layers",)).units_of(["layers.0.w", "head.weight"])


def test_a_written_plan_reads_back_equal_with_its_layouts():
    _, plan = validate_with_plan(compose_dict(["+parallel=3d", "mesh=[2,2,2]", "tracking=none",
                                               "parallel.tensor_parallel.sequence_parallel=true"]))
    assert plan is not None and plan.layouts
    written = plan_to_dict(plan)
    norm = next(iter(written["layouts"].values()))
    assert norm["input"] == {"tp": "Shard(1)"} and set(norm) == {"input", "output"}
    assert plan_from_dict(written) == plan


def test_the_config_keeps_its_topology_and_a_copy_with_another_mesh_builds_its_own():
    cfg = RunConfig.model_validate(compose_dict(["+parallel=3d", "mesh=[2,2,2]", "tracking=none"]))
    assert cfg.topology is cfg.topology and (cfg.world_size, cfg.dp_size, cfg.pp_size) == (8, 2, 2)
    wider = cfg.model_copy(update={"mesh": [4, 2, 2]})
    assert (wider.world_size, wider.dp_size) == (16, 4) and (cfg.world_size, cfg.dp_size) == (8, 2)
    fresh = RunConfig.model_validate(compose_dict(["+parallel=3d", "mesh=[2,2,2]", "tracking=none"]))
    assert fresh == cfg and cfg == fresh  # what is kept is no field: equality and dumps read the fields
    assert fresh.model_dump() == cfg.model_dump() and "_topology_of" not in cfg.model_dump_json()


@pytest.mark.parametrize("vocab, applies", [(256, True), (257, False)])
def test_the_head_plan_is_read_once_per_resolution(monkeypatch, vocab, applies):
    """Loss parallel is decided where the family's head plan is read (a vocabulary of 257 does not divide
    over tp 2: the head stays whole, with a warning)."""
    cfg = RunConfig.model_validate(compose_dict(["+parallel=3d", "mesh=[2,2,2]", "tracking=none",
                                                 f"model.vocab_size={vocab}"]))
    model = meta_model(cfg.model)
    calls = []
    original = type(model).vocab_parallel_plan

    def counting(self, *, axis):
        calls.append(axis)
        return original(self, axis=axis)

    monkeypatch.setattr(type(model), "vocab_parallel_plan", counting)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = resolve_plan(cfg.parallel, cfg.mesh, model)
    assert plan.loss_parallel is applies and calls == ["tp"]
    assert applies or any("not divisible by the tp size 2" in str(w.message) for w in caught)
