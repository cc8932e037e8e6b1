"""docs/planning.md: `python -m trainer +parallel=auto mesh=[4] dry_run=true` prints the ranking and the chosen
layout's plan; without dry_run it trains with that layout and logs the ranking to MLflow."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import run_cli

ROOT = {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}  # this checkout's trainer


def _first_row(out: str) -> str:
    return next(line for line in out.splitlines() if re.match(r"\s+1 ", line))


def test_dry_run_prints_the_ranking_with_the_choice_first(tmp_path):
    proc = run_cli(["+parallel=auto", "mesh=[4]", "dry_run=true",
                    "tracking.pictures=false"], cwd=tmp_path, timeout=600, env=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"auto plan: \d+ layouts of 4 ranks", proc.stdout)
    first = _first_row(proc.stdout)
    assert first.rstrip().endswith("chosen: fastest predicted to fit")
    # the plan printed below the table is the chosen layout's: its mesh has 4 workers
    assert "(4 workers)" in proc.stdout.split("\nplan: ", 1)[1].splitlines()[0]


@pytest.mark.slow
def test_auto_run_trains_with_the_winner(tmp_path):
    proc = run_cli(["+parallel=auto", "mesh=[4]", "train.steps=2",
                    "tracking.pictures=false", "tracking.system_metrics=false", "tracking.log_model=false",
                    f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"],
                   cwd=tmp_path, timeout=900, env=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"done: steps 1\.\.2, loss", proc.stdout)
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("meshflow").experiment_id])[0]
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"auto_plan.json", "auto_plan.txt"} <= names
