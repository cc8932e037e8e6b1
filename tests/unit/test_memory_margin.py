"""A GPU profile refuses a layout for memory only beyond the prediction's measured error, and that
error is the one the published rows measure today.

    PYTHONPATH=$PWD python -m pytest -q -p no:cacheprovider -n 0 tests/unit/test_memory_margin.py

* :data:`trainer.planner.memory.budget.PUBLISHED_MEMORY_ERROR` is recomputed here from the published
  rows that publish memory (tests/bench/published.py, configs by tests/bench/bench_profiles.py's
  ``row_config``): a predictor change that moves it fails until the constant is updated.
* Every published row the engine can express is not refused for memory on its own hardware
  (``slow``: one meta pass per row, up to 1T parameters; the 8B FSDP row runs by default).
* Between the budget and the margin the verdict is a warning that names the margin; beyond it a refusal.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_profiles  # noqa: E402
import published  # noqa: E402

from parallel.plan.resolve import resolve_plan  # noqa: E402
from trainer.config.compose import compose_dict  # noqa: E402
from trainer.config.schema import RunConfig  # noqa: E402
from trainer.models import build_model  # noqa: E402
from trainer.planner.memory.budget import (PUBLISHED_MEMORY_ERROR, PUBLISHED_MEMORY_ROWS, check_memory,  # noqa: E402
                                           memory_verdict)
from trainer.planner.memory.predict import predict_memory  # noqa: E402
from trainer.planner.numbers import GIB  # noqa: E402

EXPRESSIBLE = [r for r in published.rows() if bench_profiles.unsupported(r) is None]
WITH_MEMORY = [r for r in EXPRESSIBLE if r.reported.peak_memory_gib is not None]


def _row(row: published.PublishedRun):
    cfg = bench_profiles.row_config(row)
    return cfg, resolve_plan(cfg.parallel, cfg.mesh, build_model(cfg.model, device="meta"))


def test_the_published_memory_error_is_the_one_the_rows_measure():
    errors = []
    for row in WITH_MEMORY:
        cfg, plan = _row(row)
        # The engine that made the figure (bench_profiles.row_model: the source's gated unit where it keeps more;
        # published_reserved: its weights, gradients and optimizer state where they differ: tests/bench/engine_state.py)
        model = bench_profiles.row_model(row, cfg)
        reserved = max(bench_profiles.published_reserved(row, cfg, plan, model, e)
                       for e in predict_memory(cfg, plan, model=model)) / GIB  # torchtitan's column
        errors.append(abs(reserved / row.reported.peak_memory_gib - 1))
    assert len(errors) == PUBLISHED_MEMORY_ROWS
    # The constant is the largest |error|, rounded up to a whole percent.
    assert PUBLISHED_MEMORY_ERROR == math.ceil(max(errors) * 100 - 1e-9) / 100, sorted(errors)


def _no_refusal(row: published.PublishedRun) -> None:
    cfg, plan = _row(row)
    issues = check_memory(cfg, plan)
    assert issues == [], f"{row.name} ({row.hardware}): {issues[0].reason if issues else ''}"


def test_the_8b_fsdp_row_is_not_refused_on_its_h100s():
    _no_refusal(next(r for r in EXPRESSIBLE if r.name == "torchtitan-8b-fsdp8"))


@pytest.mark.slow
@pytest.mark.parametrize("row", EXPRESSIBLE, ids=[r.name for r in EXPRESSIBLE])
def test_no_published_row_is_refused_for_memory_on_its_hardware(row):
    _no_refusal(row)


def _profile_cfg(budget_gb: float | None = None) -> RunConfig:
    overrides = ["hardware=h100_sxm", "launch.nnodes=1", "dry_run=true", "tracking=none", "data=synthetic"]
    if budget_gb is not None:
        overrides.append(f"launch.memory_budget_gb={budget_gb}")
    return RunConfig.model_validate(compose_dict(overrides))


def test_the_verdict_warns_within_the_margin_and_refuses_beyond():
    cfg = _profile_cfg(budget_gb=10)
    budget = 10 * GIB
    assert memory_verdict(cfg, budget).status == "fits"
    within = memory_verdict(cfg, budget * (1 + PUBLISHED_MEMORY_ERROR / 2))
    assert within.status == "may not fit" and not within.refused
    assert within.limit == pytest.approx(budget * (1 + PUBLISHED_MEMORY_ERROR))
    line = within.warning()
    assert "budget 10.00 GiB" in line and f"measured error {PUBLISHED_MEMORY_ERROR:.0%} on " \
        f"{PUBLISHED_MEMORY_ROWS} published rows" in line and "may not fit" in line
    assert memory_verdict(cfg, budget * (1 + PUBLISHED_MEMORY_ERROR) * 1.01).refused


def test_this_host_refuses_at_the_budget():
    cfg = RunConfig.model_validate(compose_dict(["launch.memory_budget_gb=10", "tracking=none"]))
    assert memory_verdict(cfg, 10.01 * GIB).refused and memory_verdict(cfg, 10 * GIB).status == "fits"


def test_a_profile_budget_is_the_memory_cuda_shows():
    # An H100 SXM "80 GB" shows 85,017,493,504 bytes (tests/bench/results/h100_sxm_2026-11-26_a.json).
    verdict = memory_verdict(_profile_cfg(), 0.0)
    assert verdict.budget == pytest.approx(85_017_493_504, rel=1e-4)


def test_a_launch_within_the_error_warns_with_the_margin_and_goes_on(capsys):
    row = next(r for r in EXPRESSIBLE if r.name == "torchtitan-8b-fsdp8")
    cfg, plan = _row(row)
    peak = max(e.total for e in predict_memory(cfg, plan))
    budget_gb = peak / GIB / (1 + PUBLISHED_MEMORY_ERROR / 2)
    tight = cfg.model_copy(update={"launch": cfg.launch.model_copy(update={"memory_budget_gb": budget_gb})})
    assert check_memory(tight, plan) == []
    err = capsys.readouterr().err
    assert f"warning: memory may not fit: predicted {peak / GIB:.2f} GiB, budget {budget_gb:.2f} GiB" in err
    assert f"measured error {PUBLISHED_MEMORY_ERROR:.0%} on {PUBLISHED_MEMORY_ROWS} published rows" in err
    beyond = cfg.model_copy(update={"launch": cfg.launch.model_copy(
        update={"memory_budget_gb": peak / GIB / (1 + PUBLISHED_MEMORY_ERROR) / 1.01})})
    [issue] = check_memory(beyond, plan)
    assert issue.path == "launch.memory_budget_gb"
    assert f"beyond the prediction's measured error of {PUBLISHED_MEMORY_ERROR:.0%}" in issue.reason
    # The fix names changes predicted not to be refused: the row checkpoints every other block (torchtitan's
    # per-op policy, as bench_profiles writes it); checkpointing every block brings it in.
    assert "parallel.activation_checkpointing_every=1" in issue.fix
    every_block = beyond.parallel.model_copy(update={"activation_checkpointing_every": 1})
    fixed = beyond.model_copy(update={"parallel": every_block})
    assert check_memory(fixed, resolve_plan(fixed.parallel, fixed.mesh, build_model(fixed.model, device="meta"))) == []
