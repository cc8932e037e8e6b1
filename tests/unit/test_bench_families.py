"""The published-rows bench sorts each row into its family and prints the medians the issue asks for.

Families (tests/bench/bench_profiles.py ``family``): any context parallelism is ``cp``; else any
tensor or pipeline split is ``tp x pp``; else data parallel only. The medians are over the rows
whose layout the source states in full, overall and by family, and by source.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(_BENCH))  # bench_profiles imports published (and published_rows) by name
_SPEC = importlib.util.spec_from_file_location("bench_profiles_under_test", _BENCH / "bench_profiles.py")
assert _SPEC is not None and _SPEC.loader is not None
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)
ROWS = {r.name: r for r in bench.published.rows()}


@pytest.mark.parametrize(("name", "family", "stated"), [
    ("llmfoundry-h100_sxm-70b-512gpu-mbs8", "FSDP (data parallel only)", True),
    ("megatron2021-1.7B", "FSDP (data parallel only)", True),  # tp 1, pp 1: data parallel alone
    ("nanotron-80.0b-32n-dp4-tp4-pp16", "tp x pp", True),
    ("dgxc-nemotron4-15b-16gpu", "tp x pp", True),
    ("megatron2024-h100-70B", "tp x pp", False),  # micro-batch and checkpointing not stated
    ("torchtitan-8b-fsdp4-cp2", "cp", True),
    ("dgxc-llama3.1-405b-576gpu", "cp", True),  # cp 2 beside tp 8 x pp 9: family cp
])
def test_family_and_fully_stated(name, family, stated):
    assert bench.family(ROWS[name]) == family
    assert bench.fully_stated(ROWS[name]) is stated


def test_medians_by_family_over_the_fully_stated_rows():
    def result(row, error, stated=True, family="tp x pp", memory=None):
        return {"row": row, "stated": stated, "family": family, "error": error,
                "memory_published": memory, "memory_predicted": 1.2 * memory if memory else 0.0}

    results = [result("nanotron-a", 0.10, memory=50.0), result("nanotron-b", -0.30),
               result("llmfoundry-a", 0.05, family="FSDP (data parallel only)"),
               result("megatron2024-a", 0.90, stated=False)]
    lines = bench.medians(results)
    assert lines[0] == "median |error| over all rows: throughput 20.0% (4 rows), memory 20.0% (1 rows)"
    assert lines[1] == ("median |error| over rows whose layout the source states in full: throughput 10.0% "
                        "(3 rows), memory 20.0% (1 rows)")
    assert lines[2] == ("median |error| over fully-stated FSDP (data parallel only) rows: throughput 5.0% (1 rows), "
                        "memory - (0 rows)")
    assert lines[3] == "median |error| over fully-stated tp x pp rows: throughput 20.0% (2 rows), memory 20.0% (1 rows)"
    assert lines[4] == "median |error| over fully-stated cp rows: no row predicted"
    assert "median |error| over nanotron rows: throughput 20.0% (2 rows), memory 20.0% (1 rows)" in lines


def test_rows_on_hardware_without_a_profile_are_listed_not_predicted():
    row = ROWS["llmfoundry-h100_sxm-70b-512gpu-mbs8"]
    fake = bench.published.replace(row, hardware="mi300x")
    assert bench.unsupported(fake) == "no hardware profile 'mi300x' in trainer/conf/hardware"
    assert bench.unsupported(row) is None
