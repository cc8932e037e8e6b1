"""``+parallel=auto`` launches the pp x cp and the hsdp x ep layouts it chooses, and they train to one device's losses
(fp32, rel 1e-5): the CLI's own road (compose, the planner's search, validation, the launcher and its workers), with
the planner's calibration fixed to the unit tests' (``tests/unit/test_auto_plan.py``) so that the choice does not
depend on how loaded this host is when the test runs (``tests/unit/test_auto_plan_axes.py`` holds why each wins).

    python -m pytest tests/dist/test_auto_axes.py -q -m slow -n 0     # two launches: 4 and 8 workers
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from dist_harness import max_rel

import trainer.planner.auto.plan as auto_plan
from trainer.cli.job import run as _run
from trainer.config.compose import compose_dict
from trainer.launch.launcher import LaunchSession
from trainer.run.loop import train
from trainer.run.metrics import NullProgress
from trainer.tracking.tracker import NullTracker
from trainer.validate.checks import validate_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_auto_plan import CAL  # noqa: E402 - the unit tests' calibration
from test_auto_plan_axes import DEEP, DEEP_BUDGET_GB, WIDE_EXPERTS  # noqa: E402

LOSS_REL_TOL = 1e-5
STEPS = 3
COMMON = [f"train.steps={STEPS}", "tracking=none", "data=synthetic", "data.num_tokens=65536",
          "train.checkpoint.save_final=false", "train.eval_at_start=false", "optim.lr=1e-3", "optim.warmup_steps=0"]
# (the model and batch overrides, the planner's knobs and budget, the layout it chooses, its mesh)
CASES = {
    "pp_x_cp": ([o for o in DEEP if not o.startswith(("mesh", "+parallel"))],
                ["mesh=[4]", *(o for o in DEEP if o.startswith("+parallel")),
                 f"launch.memory_budget_gb={DEEP_BUDGET_GB}"],
                "pp2(1F1B, m8) x cp2", [2, 2]),
    "hsdp_x_ep": ([o for o in WIDE_EXPERTS if not o.startswith(("mesh", "+parallel"))],
                  ["mesh=[8]", *(o for o in WIDE_EXPERTS if o.startswith("+parallel"))],
                  "dp2x2(hsdp) x ep2", [2, 2, 2]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_layout_the_planner_chooses_trains_to_one_devices_losses(case, tmp_path, monkeypatch):
    model, knobs, label, mesh = CASES[case]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(auto_plan, "host_calibration", lambda base, world: CAL)
    raw = compose_dict(["+parallel=auto", *model, *COMMON, *knobs, f"launch.log_dir={tmp_path / 'logs'}"])
    _, ranking = auto_plan.resolve_auto(raw, calibration=CAL)  # the choice _run makes below
    assert (ranking.winner.label, ranking.winner.mesh) == (label, mesh)
    with LaunchSession() as session:
        outcome = _run(raw, True, session)
    assert outcome is not None and outcome.ok, outcome
    one = validate_config(compose_dict([*model, *COMMON]), check_model=False)
    expected = train(one, tracker=NullTracker(), progress=NullProgress(), predicted_peak_mib=0.0).losses
    assert len(expected) == STEPS and len(set(expected)) == STEPS, expected
    print(f"{label}: losses {outcome.losses}, one device {expected}, max rel {max_rel(outcome.losses, expected):.1e}")
    assert max_rel(outcome.losses, expected) <= LOSS_REL_TOL, (outcome.losses, expected)
