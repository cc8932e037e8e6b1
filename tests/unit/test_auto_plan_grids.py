"""``+parallel=auto`` offers Colossal-AI's 2-D and 2.5-D grids and 3-D cubes where the ranks make a square or a cube,
ranked with the rest and priced as the same layouts written by hand (``+parallel=tp2d_dp`` / ``tp2p5d`` / ``tp3d``),
their blocks' compute and activations split as the layouts split them; where the model does not split over them,
validation refuses the candidate with its reason.

    python -m pytest tests/unit/test_auto_plan_grids.py -q
"""

from __future__ import annotations

import pytest
from test_auto_plan import CAL, _raw

from trainer.planner.auto.plan import plan_layouts
from trainer.planner.cost.model import predict_step_time
from trainer.planner.numbers import plan_numbers
from trainer.validate.checks import validate_with_plan

# gpt_debug splittable 8 ways (8 heads over 8 kv heads, ffn 176), 8 ranks, ddp only, no pipeline, no accumulation
KNOBS = ["mesh=[8]", "model.n_heads=8", "model.n_kv_heads=8", "model.ffn_hidden_dim=176",
         "train.global_batch_size=16", "train.seq_len=128", "+parallel.auto.data_parallel_modes=[ddp]",
         "+parallel.auto.pipeline=false", "+parallel.auto.activation_checkpointing=[none]",
         "+parallel.auto.grad_accum=[1]", "+parallel.auto.sequence_parallel=[false]"]


@pytest.fixture(scope="module")
def ranking():
    raw = _raw(*KNOBS)
    return raw, {c.label: c for c in plan_layouts(raw, calibration=CAL).candidates}


def test_the_grid_and_the_cube_are_ranked_with_the_rest(ranking):
    raw, by_label = ranking
    grid, cube = by_label["dp2(ddp) x grid 2x2"], by_label["cube 2x2x2"]
    assert by_label["depth2 x grid 2x2"].status in ("chosen", "slower", "pruned")  # 2.5-D: Tesseract's depth 2
    assert grid.mesh == [2, 2, 2] and grid.parallel["grid_parallel"] == {"rows": "row", "cols": "col"}
    assert cube.mesh == [2, 2, 2] and cube.parallel["tensor_parallel_3d"] == {"dims": ["ca", "cb", "cc"]}
    for c in (grid, cube):
        assert c.status in ("chosen", "slower", "does not fit", "pruned"), (c.label, c.status, c.reason)
    assert "tp8" in by_label and "dp8(ddp)" in by_label  # beside 1-D tp and plain data parallelism
    # priced: a lower bound from the grid's own plan (its blocks split: a quarter of the weights' reduce over dp)
    assert grid.lower_bound_s is not None and cube.lower_bound_s is not None
    cfg, plan = validate_with_plan({**raw, "mesh": grid.mesh, "parallel": grid.parallel})
    assert plan.grid is not None and plan_numbers(cfg, plan).per_pp_rank[0].param_bytes == 333_056


def test_the_grids_and_the_cube_are_ranked_at_their_split_prices():
    # Every layout priced (no pruning): the grids' and the cube's blocks at 1/4 and 1/8 of their work per rank.
    raw = _raw(*KNOBS, "+parallel.auto.prune=false")
    ranking = plan_layouts(raw, calibration=CAL).candidates
    by_label = {c.label: c for c in ranking}
    grid, tesseract, cube = by_label["dp2(ddp) x grid 2x2"], by_label["depth2 x grid 2x2"], by_label["cube 2x2x2"]
    assert tesseract.mesh == [2, 2, 2] and tesseract.parallel["grid_parallel"] == {
        "rows": "row", "cols": "col", "depth": "depth"}
    # 2.5-D with ddp over its depth is 2-D with ddp over dp: one price, its reduce on the depth axis
    assert tesseract.step_s == pytest.approx(grid.step_s, rel=1e-12) and "comm depth" in tesseract.parts_s
    # A grid block on 8 sequences split 4 ways does the compute of dp2 x tp4's (56.5 / 62.2 / 65.8 ms: tp2, the
    # grid, tp4); run whole it was 201.9 ms. The cube (the whole batch, blocks 1/8) 75.9 against tp8's 84.5.
    tp4, tp8 = by_label["dp2(ddp) x tp4"], by_label["tp8"]
    assert grid.parts_s["compute"] == pytest.approx(tp4.parts_s["compute"], rel=0.1)
    assert cube.parts_s["compute"] < tp8.parts_s["compute"]
    # ranked: dp8 62.8, dp4 x tp2 68.9, dp2 x tp4 94.0, the grids 116.3, the cube 162.7, tp8 175.6 ms (before:
    # grid 256.0, cube 488.7, last); what keeps them behind is their collectives (col 35.8 + row 15.9 ms)
    order = [c.label for c in ranking]
    assert order.index(grid.label) < order.index(cube.label) < order.index("tp8")
    assert order[0] == "dp8(ddp)" and grid.step_s > tp4.step_s
    assert grid.peak_bytes < 50 * 2**20  # 44.6 MiB, beside tp8's 45.0 (the blocks whole: 56.6)
    # the planner's price (its two-block pass) is the dry run's of the same layout written by hand
    cfg, plan = validate_with_plan({**raw, "mesh": tesseract.mesh, "parallel": tesseract.parallel})
    assert predict_step_time(cfg, plan, CAL).total_s == pytest.approx(tesseract.step_s, rel=1e-9)


def test_a_model_the_cube_cannot_split_is_refused_with_the_reason():
    # 4 heads over 2 kv heads, ffn 172: a 2 x 2 x 2 cube splits it; a 3 x 3 x 3 one of 27 ranks does not
    raw = _raw("mesh=[27]", "train.global_batch_size=27", "train.seq_len=32",
               "+parallel.auto.data_parallel_modes=[ddp]",
               "+parallel.auto.pipeline=false", "+parallel.auto.activation_checkpointing=[none]",
               "+parallel.auto.grad_accum=[1]", "+parallel.auto.sequence_parallel=[false]")
    by_label = {c.label: c for c in plan_layouts(raw, calibration=CAL).candidates}
    cube = by_label["cube 3x3x3"]
    assert cube.status == "invalid" and "tensor_parallel_3d" in cube.reason and "cannot split" in cube.reason
