"""The plan is resolved once on a real ``+parallel=3d mesh=[2,2,2]`` launch, workers included: the launcher
resolves it (validation) and builds the meta model once; each of the 8 workers reads the launcher's
``resolved_plan.json``, checks it against its own model build and resolves nothing; the losses are the
ones the trainer recorded before the plan travelled as a file, bit for bit.

    python -m pytest tests/dist/test_plan_travels.py -q -n 0      # one launch of 8 workers, ~30 s on 2 cores
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import plan_counts
import trainer.launch.processes
from trainer.cli.job import run as _run
from trainer.config.compose import compose_dict
from trainer.launch.launcher import LaunchSession

# `python -m trainer +parallel=3d mesh=[2,2,2] train.steps=2` before the plan file (each worker resolved its
# own plan then): 5.568375587463379, 5.473509311676025.
LOSSES = [float.fromhex("0x1.6460440000000p+2"), float.fromhex("0x1.5e4dfa0000000p+2")]


def test_a_3d_launch_resolves_once_in_the_launcher_and_never_in_a_worker(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "counts"
    folder.mkdir()
    # Before the fork server starts, which reads its environment then (and its sys.path from PYTHONPATH alone).
    monkeypatch.setenv(plan_counts.ENV, str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(Path(plan_counts.__file__).parent),
                                                                   os.environ.get("PYTHONPATH")])))
    *modules, ready = trainer.launch.processes.PRELOAD
    monkeypatch.setattr(trainer.launch.processes, "PRELOAD", (*modules, "plan_counts", ready))
    plan_counts.install(monkeypatch)
    raw = compose_dict(["+parallel=3d", "mesh=[2,2,2]", "train.steps=2", "tracking=none",
                        f"launch.log_dir={tmp_path / 'logs'}"])
    with LaunchSession() as session:
        outcome = _run(raw, True, session)
    assert outcome is not None and outcome.ok
    assert outcome.losses == LOSSES
    counted = plan_counts.counts(folder)
    launcher = counted.pop(os.getpid())
    assert launcher == Counter({"resolve_plan": 1, "meta model": 1})
    assert len(counted) == 8  # every worker counted its own build
    assert all(worker == Counter({"meta model": 1}) for worker in counted.values()), counted
