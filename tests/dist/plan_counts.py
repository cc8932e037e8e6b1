"""Counts, in every process it is imported into, the plan resolutions and the meta-model builds: each one
appends a line (``resolve_plan``, ``meta model``) to ``$MESHFLOW_TEST_PLAN_COUNTS/<pid>``.

A test adds this module to the workers' fork server's preload list (``trainer.launch.processes.PRELOAD``),
so every worker forked from the server counts (tests/dist/test_plan_travels.py); :func:`install` with a
pytest ``monkeypatch`` counts in the test's own process (the launcher) and is undone after the test.
"""

from __future__ import annotations

import os
import sys
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import torch

import parallel.plan.resolve
import trainer.models
import trainer.models.skeleton as skeleton

ENV = "MESHFLOW_TEST_PLAN_COUNTS"


def _note(what: str) -> None:
    folder = os.environ.get(ENV)
    if folder:
        with open(Path(folder) / str(os.getpid()), "a") as f:
            f.write(what + "\n")


def install(monkeypatch: Any = None) -> None:
    """Every module's ``resolve_plan`` (each imported it by name, and later imports take the source's) and
    the built-in models' classes in the registry wrapped to count; with ``monkeypatch``, undone after the test,
    and the process's shared meta models (an earlier test's) set aside, so this one's builds count."""
    set_attr = monkeypatch.setattr if monkeypatch is not None else setattr
    set_item = monkeypatch.setitem if monkeypatch is not None else (lambda d, k, v: d.__setitem__(k, v))
    if monkeypatch is not None:
        monkeypatch.setattr(skeleton, "_BUILT", OrderedDict())
    original = parallel.plan.resolve.resolve_plan

    def counting(*args: Any, **kwargs: Any) -> Any:
        _note("resolve_plan")
        return original(*args, **kwargs)

    for module in list(sys.modules.values()):
        if getattr(module, "resolve_plan", None) is original:
            set_attr(module, "resolve_plan", counting)
    for arch, cls in list(trainer.models.MODEL_REGISTRY.items()):
        def counting_build(cfg: Any, cls: Any = cls) -> Any:
            if torch.get_default_device().type == "meta":
                _note("meta model")
            return cls(cfg)

        set_item(trainer.models.MODEL_REGISTRY, arch, counting_build)


def counts(folder: Path) -> dict[int, Counter]:
    """``{pid: Counter(what)}`` of every process that counted something into ``folder``."""
    return {int(path.name): Counter(path.read_text().split("\n")[:-1]) for path in folder.iterdir()}


if os.environ.get(ENV):  # imported by the fork server, which the test started with the variable set
    install()
