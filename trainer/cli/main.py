"""The entry point behind ``python -m trainer``: compose (Hydra) -> validate -> launch.

Hydra stays here at the edge: the composed config becomes a plain dict, then a frozen
pydantic :class:`~trainer.config.schema.RunConfig`. A bad config exits with code 2 before any
worker starts, printing each problem as ``path: reason (fix)``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from parallel.errors import ConfigError
from parallel.topology import mesh_world_size
from trainer.config.compose import CONF_DIR, group_option_issues, register_defaults, to_plain, with_preset
from trainer.config.schema import CheckpointConfig
from trainer.launch.launcher import LaunchSession
from trainer.launch.outcome import EXIT_CONFIG, EXIT_OK, LaunchOutcome
from trainer.tracking.run_info import SWEEP_JOB_TAG

register_defaults()  # the base config Hydra composes from: the pydantic models' defaults


def main(*, started: float | None = None) -> int:
    """``python -m trainer``: one run, or a sweep's jobs (``--multirun``), as Hydra reads the command
    line. A single run exits with its launch's code; after a sweep, the code returned is the first
    failed job's, else 0. Each job returns its :class:`LaunchOutcome` to Hydra (``float()`` of it is the
    final loss a sweeper such as Optuna minimises; :class:`trainer.cli.sweep.SweepParentRun` reads the
    rest), so that nothing of one job's outcome is left in a module for the next."""
    failed: list[int] = []  # this sweep's failed jobs' exit codes

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def job(composed: DictConfig) -> LaunchOutcome | None:
        outcome = run_job(composed, started=started)
        if outcome is not None and not outcome.ok:
            failed.append(outcome.exit_code)
        return outcome

    job()
    return failed[0] if failed else EXIT_OK


def run_job(composed: DictConfig, *, started: float | None = None) -> LaunchOutcome | None:
    """One job: the composed config validated and launched (or planned, or only checked). In a single
    run the process exits with the launch's code; in a sweep a job returns its outcome, a failed one's
    too, so that Hydra goes on with the next job and the sweep ends failed (:func:`main`). ``started``:
    the process's start, for a single run's wall time (a sweep's jobs count from their own launch)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    sweeping = HydraConfig.get().mode == RunMode.MULTIRUN
    raw = with_preset(to_plain(composed), HydraConfig.get().runtime.choices)
    if sweeping and isinstance(raw.get("tracking"), dict):  # tells the sweep's runs apart (trainer.tracking.run_info)
        raw["tracking"].setdefault("tags", {})[SWEEP_JOB_TAG] = str(HydraConfig.get().job.num)
    if sweeping:
        _sweep_checkpoint_dir(raw, HydraConfig.get())
    with LaunchSession(started=None if sweeping else started) as session:
        if _starts_workers(raw):  # the workers' fork server imports while the config is checked
            session.start_workers_server()
        # start-up: validation, the planner and torch load here, beside the server's imports (their 1.7 s
        # came before the server's start when this module imported them)
        from trainer.cli.job import run

        return run(raw, sweeping, session)


def _sweep_checkpoint_dir(raw: dict, hydra: Any) -> None:
    """A sweep's job saves under the sweep's own folder, ``multirun/<time>/checkpoints/job<n>``, when the
    command line leaves ``train.checkpoint.dir`` at its default: its jobs run in one directory, and each
    would otherwise find the one before's checkpoints there (refused: trainer.launch.disk_checks)."""
    checkpoint = (raw.get("train") or {}).get("checkpoint")
    if isinstance(checkpoint, dict) and checkpoint.get("dir") == CheckpointConfig.model_fields["dir"].default:
        checkpoint["dir"] = str(Path(hydra.sweep.dir) / "checkpoints" / f"job{hydra.job.num}")


def refuse_unknown_group_options(argv: list[str]) -> None:
    """Exit 2 with each override that chooses a config group's option Hydra would refuse (an unknown
    one, or a group written with or without ``+`` against the defaults list), as ``path: reason (fix)``
    like every other bad config, instead of Hydra's search-path dump and exit 1."""
    if issues := group_option_issues(argv):
        print(ConfigError(issues), file=sys.stderr)
        sys.exit(EXIT_CONFIG)


def _starts_workers(raw: dict) -> bool:
    """Whether this config, once valid, launches workers: a mesh of several ranks, not a dry run."""
    if raw.get("dry_run") is True or raw.get("validate_only") is True or not isinstance(raw.get("mesh"), list):
        return False
    if (raw.get("launch") or {}).get("executor") == "slurm":  # the job's nodes start them
        return False
    return mesh_world_size(raw["mesh"]) > 1  # explicit rank ids, of any depth: one worker per id
