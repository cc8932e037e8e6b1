"""``+parallel=auto`` pairs a pipeline with context parallelism and hsdp with expert parallelism: both are candidates,
listed in the dry run's ranking with their sizes and priced as the same layouts written by hand; a layout that cannot
split is not offered (rows that do not cut into ``2 x cp`` chunks, ep for a dense model) and is refused as written;
and where long rows through many layers leave no other layout within the memory budget, the planner chooses pp x cp.

    python -m pytest tests/unit/test_auto_plan_axes.py -q
"""

from __future__ import annotations

import pytest
from test_auto_plan import CAL, _raw

from parallel.config import AutoPlanConfig
from trainer.config.schema import RunConfig
from trainer.models.skeleton import meta_model
from trainer.planner.auto.plan import plan_layouts
from trainer.planner.auto.search import Search
from trainer.planner.cost.model import predict_step_time
from trainer.planner.forecast.pricing import HostPricing
from trainer.planner.memory.predict import predict_memory
from trainer.validate.checks import validate_with_plan

# 8 blocks of 3 heads (no tp on 4 ranks) over rows of 1,028 tokens (cp 2 at most: 1,028 is not a multiple of 8);
# 8 rows, neither accumulated nor checkpointed: a pipeline of 8 micro-batches of one row each, its rows split over cp,
# keeps the least in flight.
DEEP = ["mesh=[4]", "model.dim=48", "model.n_heads=3", "model.n_kv_heads=3", "model.n_layers=8",
        "model.ffn_hidden_dim=128", "model.max_seq_len=1028", "train.seq_len=1028", "train.global_batch_size=8",
        "+parallel.auto.context_parallel_from=1024", "+parallel.auto.data_parallel_modes=[fsdp]",
        "+parallel.auto.schedules=[1F1B]", "+parallel.auto.activation_checkpointing=[none]",
        "+parallel.auto.grad_accum=[1]"]
DEEP_BUDGET_GB = 0.074  # pp2 x cp2 is predicted at 70 MiB, every other layout at 81 MiB or more
# gpt_moe with 2 wide experts (top 1) on 8 ranks: ep 2 holds one expert per rank, hsdp keeps the gradients'
# all-reduce of everything else inside its shard axis x ep.
WIDE_EXPERTS = ["model=gpt_moe", "mesh=[8]", "model.n_layers=2", "model.moe.hidden_dim=1024",
                "model.moe.num_experts=2", "model.moe.top_k=1", "train.global_batch_size=8",
                "+parallel.auto.tensor_parallel=false", "+parallel.auto.pipeline=false",
                "+parallel.auto.activation_checkpointing=[none]", "+parallel.auto.grad_accum=[1]"]


def _search(raw: dict, knobs: AutoPlanConfig, world: int) -> Search:
    return Search(raw, RunConfig.model_validate({**raw, "mesh": None, "parallel": None}), knobs, world,
                  HostPricing(CAL))


def _as_written(raw: dict, c) -> tuple:
    """The candidate as a hand-written config, validated as resolve_auto's result is."""
    return validate_with_plan({**raw, "mesh": c.mesh, "parallel": c.parallel,
                               "train": {**raw["train"], "grad_accum": c.grad_accum}})


def test_pp_x_cp_is_chosen_when_long_rows_through_many_blocks_leave_nothing_else_within_the_budget():
    raw = _raw(*DEEP, f"launch.memory_budget_gb={DEEP_BUDGET_GB}")
    result = plan_layouts(raw, calibration=CAL)
    winner, budget = result.winner, DEEP_BUDGET_GB * 2**30
    assert (winner.label, winner.status, winner.mesh) == ("pp2(1F1B, m8) x cp2", "chosen", [2, 2])
    assert winner.parallel["dims"] == ["pp", "cp"] and winner.parallel["context_parallel"] == {"dim": "cp",
                                                                                                "method": "ring"}
    assert winner.parallel["pipeline"]["microbatches"] == 8 and winner.peak_bytes <= budget
    # What is faster does not fit: fsdp over 4 ranks (2 rows each), and with cp (4 rows over 2 ranks each).
    by_label = {c.label: c for c in result.candidates}
    for faster in ("dp4(fsdp)", "dp2(fsdp) x cp2"):
        assert by_label[faster].status == "does not fit" and by_label[faster].peak_bytes > budget
        assert by_label[faster].step_s < winner.step_s
    # The ranking the dry run prints lists it first, with its sizes; its traffic is priced on both axes.
    assert result.table().splitlines()[2].split()[1:4] == ["pp2(1F1B,", "m8)", "x"]
    assert winner.traffic["cp"] > 0 and winner.traffic["pp"] > 0 and "comm cp" in winner.parts_s
    # Priced as the same layout written by hand: its step and its peak (the search's two-block passes, exact).
    cfg, plan = _as_written(raw, winner)
    assert winner.step_s == pytest.approx(predict_step_time(cfg, plan, CAL).total_s, rel=1e-9)
    assert winner.peak_bytes == pytest.approx(max(e.total for e in predict_memory(cfg, plan)), rel=1e-9)


def test_hsdp_x_ep_is_a_candidate_of_a_model_with_experts_priced_on_its_own_axes():
    raw = _raw(*WIDE_EXPERTS)
    result = plan_layouts(raw, calibration=CAL)
    winner = result.winner
    assert (winner.label, winner.status, winner.mesh) == ("dp2x2(hsdp) x ep2", "chosen", [2, 2, 2])
    assert winner.parallel["dims"] == ["dp_replicate", "dp_shard", "ep"]
    assert winner.parallel["data_parallel"] == {"dim": ["dp_replicate", "dp_shard"], "mode": "hsdp"}
    assert winner.parallel["expert_parallel"] == {"dim": "ep"}
    # The experts gathered and reduced over dp_shard, the rest over dp_shard x ep, the tokens' all-to-all on ep and
    # hsdp's all-reduce over dp_replicate of a rank's gradient shards: the experts' 1/2 (one of 2 over ep, then
    # halved over dp_shard), everything else's 1/4 (over dp_shard x ep).
    assert set(winner.traffic) == {"dp_shard", "dp_shard,ep", "ep", "dp_replicate"}
    cfg, plan = _as_written(raw, winner)
    topology = plan.topology
    shards = sum(p.numel() / topology.local_divisor(fqn, plan.placements.get(fqn, {})) / topology.fsdp_divisor(fqn)
                 for fqn, p in meta_model(cfg.model).named_parameters())
    assert winner.traffic["dp_replicate"] == pytest.approx(4.0 * shards)  # a ring of 2 sends it once
    assert winner.step_s == pytest.approx(predict_step_time(cfg, plan, CAL).total_s, rel=1e-9)


def test_layouts_that_cannot_split_are_not_offered_and_are_refused_as_written():
    knobs = AutoPlanConfig(data_parallel_modes=["fsdp", "hsdp"], schedules=["1F1B"], microbatches=[4],
                           activation_checkpointing=["none"], grad_accum=[1], context_parallel_from=1024,
                           tensor_parallel=False)
    dense = _raw(*DEEP[1:9], "mesh=[8]")  # 1,028 tokens: 2 x cp chunks for cp 2, not for cp 4 (8 chunks)
    search = _search(dense, knobs, 8)
    labels = {c.label for c in search.layouts()}
    assert {"dp2(fsdp) x pp2(1F1B, m4) x cp2", "pp4(1F1B, m4) x cp2", "dp4(fsdp) x cp2"} <= labels
    assert not any("cp4" in label or "cp8" in label or "ep" in label for label in labels)
    compiled = _raw(*DEEP[1:9], "mesh=[8]", "train.compile=true")  # torch.compile with cp is refused: none offered
    assert not any("cp" in c.parallel["dims"] for c in _search(compiled, knobs, 8).layouts())
    # Written by hand, the same layouts are refused with the validator's reason.
    cp4 = search._candidate(1, "", None, 2, "pp2(1F1B, m4)", {"dim": "pp", "schedule": "1F1B", "microbatches": 4,
                                                             "stages_per_rank": 1, "boundaries": "auto"},
                            1, 1, ("none", 1), "fp32", cp=4)
    assert search.validate(cp4) is None and cp4.reason.startswith(
        "invalid: train.seq_len: 1028 tokens do not cut into 2 x cp = 8 equal chunks")
    hsdp_ep = search._candidate(4, "dp2x2(hsdp)", {"dim": ["dp_replicate", "dp_shard"], "mode": "hsdp"}, 1, "",
                                None, 1, 2, ("none", 1), "fp32")
    assert hsdp_ep.mesh == [2, 2, 2] and search.validate(hsdp_ep) is None
    assert hsdp_ep.reason.startswith("invalid: parallel.expert_parallel: model Transformer has no experts to split "
                                     "over axis 'ep'"), hsdp_ep.reason
    # A model with experts: hsdp beside ep on every replicate x shard split whose ep divides the experts.
    moe = _raw(*WIDE_EXPERTS[:4], "model.moe.num_experts=4", "model.moe.top_k=1")
    experts = {c.label for c in _search(moe, knobs, 8).layouts() if "hsdp" in c.label and "ep" in c.label}
    assert experts == {"dp2x2(hsdp) x ep2"}  # ep 4 leaves dp 2: no replicate x shard split of it
    off = knobs.model_copy(update={"expert_parallel": False})
    assert not any("ep" in c.parallel["dims"] for c in _search(moe, off, 8).layouts())


@pytest.mark.parametrize("preset, mesh, dims, rest_axis", [
    ("fsdp_ep", "[2,4]", [], "dp,ep"),
    ("hsdp", "[2,2,2]", ["parallel.dims=[dp_replicate,dp_shard,ep]", "+parallel.expert_parallel={dim: ep}"],
     "dp_shard,ep")])
def test_fsdp_beside_ep_hides_behind_compute_on_a_gpu_profile(preset, mesh, dims, rest_axis):
    """The parameters beside the experts are FSDP over the shard axes x ep: on a GPU profile their gathers and
    reduces are prefetched behind compute as FSDP's over dp are (they were all exposed, as tp's are), and hsdp's
    are named by its shard axis x ep, not its replicate axis too."""
    from trainer.config.compose import compose_dict
    from trainer.planner.cost.device import predict_on_profile

    cfg, plan = validate_with_plan(compose_dict(["model=gpt_moe", f"+parallel={preset}", f"mesh={mesh}", *dims,
                                                 "hardware=h100_sxm", "launch.nnodes=1", "dry_run=true",
                                                 "train.precision=bf16"]))
    step = predict_on_profile(cfg, plan, cfg.hardware)
    assert step.comm_s[rest_axis] > 0 and step.traffic[rest_axis] > 0
    assert rest_axis not in (step.exposed_s or {}), step.exposed_s
    assert not any({"dp_replicate", "ep"} <= set(axis.split(",")) for axis in step.traffic), step.traffic
