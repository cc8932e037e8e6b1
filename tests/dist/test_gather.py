"""The run's final model, gathered to rank 0 over the process group, on every kind of layout: fsdp x tp,
pp x tp, fsdp x interleaved pp (4 stages on 2 ranks' pairs), per-stage layouts, hsdp, fsdp x cp and fsdp x ep. Rank 0
holds every tensor of the model, equal to the model built whole on one device; the other ranks hold
nothing.

    pytest tests/dist/test_gather.py -q -m slow      # one launch of 4 processes
"""

from __future__ import annotations

import pytest

from dist_harness import SuiteResults
from gather_checks import SUITES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return SuiteResults(SUITES, {"four_rank": 4}, checks="gather_checks", tmp=tmp_path_factory)


@pytest.mark.parametrize("name", [name for name, _ in SUITES["four_rank"]])
def test_the_final_model_is_whole_on_rank0(results, name):
    rank0, *others = results(name)
    assert rank0["missing"] == [] and rank0["unexpected"] == [], rank0
    assert rank0["max_abs_diff"] == 0.0 and rank0["plain_equal"], rank0
    assert all(other["none_here"] for other in others)
