"""Mesh-to-mesh reshard in 8 real gloo processes: 1200 seeded random cases give every destination
rank DTensor's piece bit for bit with the plan's bytes on the wire, and on the world mesh reshard
agrees with DTensor.redistribute.

    PYTHONPATH=. python -m pytest tests/dist/test_reshard.py -q     # one launch, ~50-80 s on 2 shared cores

The checks run in the workers (``reshard_checks.SUITES``); this file only reads their results.
"""

from __future__ import annotations

import pytest

from dist_harness import launch
from reshard_checks import NUM_RANDOM_CASES


WORLD_SIZE = 8


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    per_rank = launch("eight_rank", world_size=WORLD_SIZE, out_dir=tmp_path_factory.mktemp("reshard"), checks="reshard_checks")
    by_check = {name: [r[name] for r in per_rank] for name in per_rank[0]}
    for name, ranks in by_check.items():
        errors = [r["error"] for r in ranks if not r["ok"]]
        assert not errors, f"{name}: {errors[0]}"
    return by_check


def test_random_cases_match_dtensor_pieces_bit_for_bit(results):
    per_rank = results["random_cases"]
    failures = [f for r in per_rank for f in r["failures"]]
    assert sum(r["num_failures"] for r in per_rank) == 0, failures
    assert all(r["num_cases"] == NUM_RANDOM_CASES >= 1000 for r in per_rank)
    # The generator must reach what it claims to: destination checks on every rank, Partial on
    # both sides, disjoint meshes (counts are per rank that took part, so only lower bounds).
    assert sum(r["num_dst_checks"] for r in per_rank) >= 2 * NUM_RANDOM_CASES
    assert all(r["num_dst_checks"] > 0 and r["num_partial_src"] > 0 and r["num_partial_dst"] > 0 and r["num_disjoint"] > 0
               for r in per_rank)


def test_same_mesh_matches_dtensor_redistribute(results):
    per_rank = results["dtensor_parity"]
    assert all(r["num_checked"] == 24 for r in per_rank)
    assert [m for r in per_rank for m in r["mismatches"]] == []
