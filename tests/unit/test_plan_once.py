"""The plan is resolved once and the meta model built once on a launch's road: the command line's
``+parallel=3d mesh=[2,2,2]`` through validation, the run's record (plan.txt, the placement picture)
and the launcher's price of the plan, up to the point where the workers would start.

    python -m pytest tests/unit/test_plan_once.py -q -n 0
"""

from __future__ import annotations

import sys
from collections import Counter

import torch

import parallel.plan.resolve
import trainer.launch.elastic
import trainer.models
from trainer.cli.main import _run
from trainer.config.compose import compose_dict
from trainer.launch.launcher import LaunchSession


def _count_resolutions(monkeypatch, counts: Counter) -> None:
    """Every module's ``resolve_plan`` (each imported it by name) wrapped to count its calls."""
    original = parallel.plan.resolve.resolve_plan

    def counting(*args, **kwargs):
        counts["resolve_plan"] += 1
        return original(*args, **kwargs)

    for module in list(sys.modules.values()):
        if getattr(module, "resolve_plan", None) is original:
            monkeypatch.setattr(module, "resolve_plan", counting)


def _count_meta_builds(monkeypatch, counts: Counter) -> None:
    """The built-in models' classes wrapped in the registry: a build on the meta device counts."""
    for arch, cls in list(trainer.models.MODEL_REGISTRY.items()):
        def counting(cfg, cls=cls):
            counts["meta model"] += torch.get_default_device().type == "meta"
            return cls(cfg)

        monkeypatch.setitem(trainer.models.MODEL_REGISTRY, arch, counting)


def test_a_3d_launch_resolves_the_plan_and_builds_the_meta_model_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    counts: Counter = Counter()
    started: list[tuple] = []
    _count_resolutions(monkeypatch, counts)
    _count_meta_builds(monkeypatch, counts)
    # Up to the workers: the fork server and the elastic agent are not started; what they were given is kept.
    monkeypatch.setattr(LaunchSession, "start_workers_server", lambda self: None)
    monkeypatch.setattr(trainer.launch.elastic, "_run_elastic",
                        lambda launch_config, worker_args, cfg: started.append(worker_args) or {0: {}})
    raw = compose_dict(["+parallel=3d", "mesh=[2,2,2]", "train.steps=3", "tracking=none",
                        f"launch.log_dir={tmp_path / 'logs'}"])
    with LaunchSession(raw["tracking"]) as session:
        outcome = _run(raw, True, session)
    assert outcome is not None and len(started) == 1
    assert started[0][3] is not None and started[0][3] > 0  # the plan's price for rank 0 to report
    assert (tmp_path / "logs").is_dir()
    assert dict(counts) == {"resolve_plan": 1, "meta model": 1}
