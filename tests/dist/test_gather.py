"""The run's final model, gathered to rank 0 over the process group, on every kind of layout: fsdp x tp,
pp x tp, fsdp x interleaved pp (4 stages on 2 ranks' pairs), per-stage layouts (and, on 8 ranks, a stage's own cp or
ep axis beside an fsdp x tp stage), hsdp, fsdp x cp and fsdp x ep. Rank 0
holds every tensor of the model, equal to the model built whole on one device; the other ranks hold
nothing.

    pytest tests/dist/test_gather.py -q -m slow      # two launches: 4 and 8 processes
"""

from __future__ import annotations

import pytest

from dist_harness import SuiteResults
from gather_checks import SUITES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return SuiteResults(SUITES, {"four_rank": 4, "eight_rank": 8}, checks="gather_checks", tmp=tmp_path_factory)


@pytest.mark.parametrize("name", [name for named in SUITES.values() for name, _ in named])
def test_the_final_model_is_whole_on_rank0(results, name):
    rank0, *others = results(name)
    assert rank0["missing"] == [] and rank0["unexpected"] == [], rank0
    assert rank0["max_abs_diff"] == 0.0 and rank0["plain_equal"], rank0
    assert all(other["none_here"] for other in others)
