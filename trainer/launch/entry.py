"""The trainer's public entry point for engines that run it: ``train(config) -> outcome``.

    from trainer import train
    outcome = train({"train": {"steps": 5}})                 # a plain dict: validated here
    outcome = train("job.json")                              # a resolved config, as the control plane writes it
    outcome = train(cfg, node_rank=1, rdzv_endpoint="10.0.0.1:29500", rdzv_id="job-42")   # one node of several
    outcome["losses"], outcome["run_id"]

It launches *this node's* share of the run exactly as ``python -m trainer.launch`` does (one
device in-process, or the node's workers through torch's elastic launcher) and returns the
launch's outcome (losses, timings, the MLflow run id) as a dict. A Ray task or ``TorchTrainer``
loop, a Kubernetes pod or a notebook calls this instead of reaching into the launcher.

Call it from the main thread: SIGTERM handling (a cancelled job's clean stop) needs it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.config.schema import RunConfig
from trainer.launch import launcher
from trainer.planner.auto.plan import resolve_and_validate

# The launcher's exit codes, as words (trainer.launch.EXIT_*).
EXIT_MEANINGS = {1: "a worker failed (its rank and error are printed above)", 2: "the config was refused",
                 130: "interrupted (SIGINT)", 143: "terminated (SIGTERM)"}


class TrainingFailed(RuntimeError):
    """The run did not finish; ``exit_code`` is what ``python -m trainer.launch`` would have exited with."""

    def __init__(self, exit_code: int) -> None:
        self.exit_code = exit_code
        meaning = EXIT_MEANINGS.get(exit_code, "see the output above")
        super().__init__(f"training failed with exit code {exit_code}: {meaning}")


def as_config(config: RunConfig | Mapping[str, Any] | str | os.PathLike[str]) -> RunConfig:
    """A :class:`RunConfig` from a config object (taken as is), a plain mapping (validated, model
    checks included, as ``python -m trainer`` does) or the path of a resolved JSON config (the
    control plane's ``job.json``: validated at submit, read back as is)."""
    if isinstance(config, RunConfig):
        return config
    if isinstance(config, Mapping):
        # a plain copy: the validator may fill it in
        return resolve_and_validate(json.loads(json.dumps(dict(config))))[0]
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        try:
            return RunConfig.model_validate_json(path.read_text())
        except OSError as err:
            raise FileNotFoundError(f"train({str(path)!r}): cannot read the config ({err.strerror}); pass the path "
                                    "of a resolved config (RunConfig.model_dump_json()), a dict or a "
                                    "RunConfig") from None
    raise TypeError(f"train(config): expected a RunConfig, a dict or the path of a resolved JSON config, "
                    f"got {type(config).__name__}")


def train(config: RunConfig | Mapping[str, Any] | str | os.PathLike[str], *, node_rank: int | None = None,
          rdzv_endpoint: str | None = None, rdzv_id: str | None = None) -> dict[str, Any]:
    """Run this node's part of the training and return its outcome (``losses``, timings, ``run_id``;
    node 0 holds the losses); raise :class:`TrainingFailed` when the run did not finish.
    ``node_rank``, ``rdzv_endpoint`` and ``rdzv_id`` override those ``launch.*`` fields."""
    cfg = as_config(config)
    overrides = {"node_rank": node_rank, "rdzv_endpoint": rdzv_endpoint, "rdzv_id": rdzv_id}
    if any(value is not None for value in overrides.values()):
        raw = cfg.model_dump(mode="json")
        raw["launch"].update({k: v for k, v in overrides.items() if v is not None})
        cfg = RunConfig.model_validate(raw)
    outcome = launcher.launch(cfg)
    if not outcome.ok:
        raise TrainingFailed(outcome.exit_code)
    return outcome.as_dict()
