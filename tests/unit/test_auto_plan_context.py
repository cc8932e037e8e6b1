"""``+parallel=auto`` and context parallelism: long rows bring cp layouts into the search, and when no
layout without cp fits the budget, the planner chooses one that splits the sequence.

Run: ``python -m pytest tests/unit/test_auto_plan_context.py -q``
"""

from __future__ import annotations

from test_auto_plan import CAL, NARROW, _raw

from parallel.config import AutoPlanConfig
from trainer.config.schema import RunConfig
from trainer.planner.auto.plan import plan_layouts
from trainer.planner.auto.search import Search
from trainer.planner.forecast.pricing import HostPricing

# One row of 4096 tokens on 2 ranks: dp cannot split it (one row), a pipeline has no second micro-batch;
# tp splits the heads and the MLP, cp the whole row.
LONG = ["mesh=[2]", *NARROW, "model.n_layers=2", "model.max_seq_len=4096", "train.seq_len=4096",
        "train.global_batch_size=1"]


def test_cp_is_chosen_when_no_layout_without_it_fits():
    # prune=false: every layout priced in full, so that tp2 (slower than cp2) says it does not fit
    result = plan_layouts(_raw(*LONG, "launch.memory_budget_gb=0.06", "+parallel.auto.prune=false"), calibration=CAL)
    by_label = {c.label: c for c in result.candidates}
    assert result.winner.label == "cp2" and result.winner.status == "chosen"
    assert result.winner.parallel["context_parallel"] == {"dim": "cp", "method": "ring"}
    assert result.winner.peak_bytes <= 0.06 * 2**30 < by_label["tp2"].peak_bytes
    assert by_label["tp2"].status == "does not fit"
    # The ring's K/V hops are priced on the cp axis: its traffic is there beside FSDP's over cp.
    assert result.winner.traffic["cp"] > 0 and "comm cp" in result.winner.parts_s


def test_cp_is_considered_only_for_rows_of_context_parallel_from_tokens_and_more():
    def labels(seq_len: int, knobs: AutoPlanConfig) -> set[str]:
        raw = _raw(*LONG[:-2], f"train.seq_len={seq_len}", "train.global_batch_size=1")
        base = RunConfig.model_validate({**raw, "mesh": None, "parallel": None})
        return {c.label for c in Search(raw, base, knobs, 4, HostPricing(CAL)).layouts()}

    knobs = AutoPlanConfig(data_parallel_modes=["fsdp"], schedules=["1F1B"], microbatches=[2],
                           activation_checkpointing=["none"])
    assert {"cp4", "cp2 x tp2", "dp2(fsdp) x cp2"} <= labels(4096, knobs)
    assert not any("cp" in label for label in labels(1024, knobs))  # below the default 2048
    assert not any("cp" in label for label in labels(4096, knobs.model_copy(update={"context_parallel_from": None})))
