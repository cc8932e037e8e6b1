"""The plan is resolved once and the meta model built once on a launch's road: the command line's
``+parallel=3d mesh=[2,2,2]`` through validation, the run's record (plan.txt, the placement picture)
and the launcher's price of the plan, up to the point where the workers would start, which get the plan as a
file (the launch with its workers: tests/dist/test_plan_travels.py).

    python -m pytest tests/unit/test_plan_once.py -q -n 0
"""

from __future__ import annotations

import sys
from collections import Counter, OrderedDict
from pathlib import Path

import torch

import parallel.plan.resolve
import trainer.launch.elastic
import trainer.models
import trainer.models.skeleton
import trainer.run.build
from parallel.placements import parse_placement
from parallel.plan.serial import ResolvedPlan, model_fingerprint
from trainer.cli.job import run as _run
from trainer.config.compose import compose_dict
from trainer.config.schema import RunConfig
from trainer.launch.launcher import LaunchSession
from trainer.models import build_model


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
    """The built-in models' classes wrapped in the registry: a build on the meta device counts (the process's
    shared meta models, an earlier test's, set aside first)."""
    monkeypatch.setattr(trainer.models.skeleton, "_BUILT", OrderedDict())
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

    def start(launch_config, worker_args, cfg):  # the plan file is read while it exists (a temporary folder)
        started.append((*worker_args, ResolvedPlan.read(Path(worker_args[4]))))
        return {0: {}}

    monkeypatch.setattr(trainer.launch.elastic, "_run_elastic", start)
    raw = compose_dict(["+parallel=3d", "mesh=[2,2,2]", "train.steps=3", "tracking=none",
                        f"launch.log_dir={tmp_path / 'logs'}"])
    with LaunchSession() as session:
        outcome = _run(raw, True, session)
    assert outcome is not None and len(started) == 1
    assert started[0][3] is not None and started[0][3] > 0  # the plan's price for rank 0 to report
    assert (tmp_path / "logs").is_dir()
    assert dict(counts) == {"resolve_plan": 1, "meta model": 1}
    written = started[0][5]  # the workers' copy of the launcher's plan, for the model they will build
    assert written.plan.pipeline.boundaries == ["layers.2"] and written.plan.mesh.shape == (2, 2, 2)
    assert written.plan.placements["layers.0.attn.wq.weight"] == {"tp": parse_placement("Shard(0)")}
    model_cfg = RunConfig.model_validate(compose_dict(["+parallel=3d", "mesh=[2,2,2]"])).model
    assert written.fingerprint == model_fingerprint(build_model(model_cfg, device="meta"))[0]


def test_a_one_device_launch_trains_on_validations_plan_in_process(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    counts: Counter = Counter()
    _count_resolutions(monkeypatch, counts)
    _count_meta_builds(monkeypatch, counts)
    given: list[ResolvedPlan | None] = []
    build = trainer.run.build.worker_plan

    def keep(cfg, model, plan=None):
        given.append(plan)
        return build(cfg, model, plan)

    monkeypatch.setattr(trainer.run.build, "worker_plan", keep)
    raw = compose_dict(["train.steps=1", "tracking=none", "train.global_batch_size=2", "train.seq_len=16",
                        f"launch.log_dir={tmp_path / 'logs'}"])
    with LaunchSession() as session:
        outcome = _run(raw, True, session)
    assert outcome is not None and outcome.ok and len(outcome.losses) == 1
    assert len(given) == 1 and given[0] is not None  # the launcher's plan, checked against the real build
    assert given[0].num_parameters == len(list(build_model(RunConfig.model_validate(raw).model).parameters()))
    assert dict(counts) == {"resolve_plan": 1, "meta model": 1}  # validation's; the loop and its price reuse them
