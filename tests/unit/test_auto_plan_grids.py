"""``+parallel=auto`` offers Colossal-AI's 2-D grids and 3-D cubes where the ranks make a square or a cube, ranked with
the rest and priced as the same layouts written by hand (``+parallel=tp2d_dp`` / ``tp3d``); where the model does not
split over them, validation refuses the candidate with its reason.

    python -m pytest tests/unit/test_auto_plan_grids.py -q
"""

from __future__ import annotations

import pytest
from test_auto_plan import CAL, _raw

from trainer.planner.auto.plan import plan_layouts
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
    assert grid.mesh == [2, 2, 2] and grid.parallel["grid_parallel"] == {"rows": "row", "cols": "col"}
    assert cube.mesh == [2, 2, 2] and cube.parallel["tensor_parallel_3d"] == {"dims": ["ca", "cb", "cc"]}
    for c in (grid, cube):
        assert c.status in ("chosen", "slower", "does not fit", "pruned"), (c.label, c.status, c.reason)
    assert "tp8" in by_label and "dp8(ddp)" in by_label  # beside 1-D tp and plain data parallelism
    # priced: a lower bound from the grid's own plan (its blocks split: a quarter of the weights' reduce over dp)
    assert grid.lower_bound_s is not None and cube.lower_bound_s is not None
    cfg, plan = validate_with_plan({**raw, "mesh": grid.mesh, "parallel": grid.parallel})
    assert plan.grid is not None and plan_numbers(cfg, plan).per_pp_rank[0].param_bytes == 333_056


def test_a_model_the_cube_cannot_split_is_refused_with_the_reason():
    # 4 heads over 2 kv heads, ffn 172: a 2 x 2 x 2 cube splits it; a 3 x 3 x 3 one of 27 ranks does not
    raw = _raw("mesh=[27]", "train.global_batch_size=27", "train.seq_len=32",
               "+parallel.auto.data_parallel_modes=[ddp]",
               "+parallel.auto.pipeline=false", "+parallel.auto.activation_checkpointing=[none]",
               "+parallel.auto.grad_accum=[1]", "+parallel.auto.sequence_parallel=[false]")
    by_label = {c.label: c for c in plan_layouts(raw, calibration=CAL).candidates}
    cube = by_label["cube 3x3x3"]
    assert cube.status == "invalid" and "tensor_parallel_3d" in cube.reason and "cannot split" in cube.reason
