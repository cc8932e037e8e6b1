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
from trainer.config.schema import CheckpointConfig, RunConfig
from trainer.launch.launcher import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, LaunchOutcome, LaunchSession
from trainer.launch.slurm import dry_run_script, submit_and_follow
from trainer.pictures.placement import DRY_RUN_DIR, write_placement
from trainer.planner.auto.plan import resolve_and_validate
from trainer.planner.forecast.plan_file import dry_run_report
from trainer.tracking.run_info import SWEEP_JOB_TAG
from trainer.tracking.run_record import launch_plan
from trainer.validate.model_checks import check_against_model

_BATCH_PATHS = {"train.global_batch_size", "parallel.pipeline.microbatches"}
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
    with LaunchSession(raw.get("tracking") or {}, started=None if sweeping else started) as session:
        if _starts_workers(raw):  # the workers' fork server imports while the config is checked
            session.start_workers_server()
        return _run(raw, sweeping, session)


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


def _run(raw: dict, sweeping: bool, session: LaunchSession) -> LaunchOutcome | None:
    try:
        # +parallel=auto: the rest of the road sees an ordinary config; the search says how far it is
        cfg, plan, ranking = resolve_and_validate(raw, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except ConfigError as err:
        if raw.get("dry_run") is True and all(i.path in _BATCH_PATHS for i in err.issues):
            _plan_despite_batch(raw, err)
            return None
        print(err, file=sys.stderr)
        if sweeping:
            return _job_failed(LaunchOutcome(EXIT_CONFIG))
        sys.exit(EXIT_CONFIG)
    if cfg.validate_only:
        print(f"config OK: {cfg.model.arch} model, mesh {list(cfg.mesh_shape)} "
              f"({cfg.world_size} worker{'s' if cfg.world_size > 1 else ''}), {cfg.train.steps} steps")
        return None
    if cfg.dry_run:
        _dry_run(cfg, plan, ranking)
        return None
    if cfg.launch.executor == "slurm":
        outcome = submit_and_follow(cfg, plan=launch_plan(cfg, plan))
    else:
        outcome = session.launch(cfg, plan=plan)
    if not sweeping:
        sys.exit(outcome.exit_code)
    return outcome if outcome.ok else _job_failed(outcome)


def _dry_run(cfg: RunConfig, plan, ranking) -> None:
    """The plan's report and pictures; exit 1 when its prediction failed, 2 when a launch would refuse it."""
    if ranking is not None:
        print(ranking.table() + "\n")
    text, summary = dry_run_report(cfg, plan)
    print(text)
    _write_pictures(cfg, plan)
    if cfg.launch.executor == "slurm":
        print(dry_run_script(cfg, DRY_RUN_DIR / "slurm"))
    _failed_prediction(summary)
    if summary["memory_verdict"] == "does not fit":  # within the measured error: the report's warning, no refusal
        hint = ("the memory table above says which ranks; fewer bytes per rank: fsdp, tp, pp, activation "
                "checkpointing, or more devices")
        if cfg.hardware.is_host and summary["memory_budget_gib"] <= 0:
            hint = (f"{cfg.world_size // cfg.launch.nnodes} workers share this host's memory; to plan a cluster "
                    "you do not have, name its hardware and nodes, e.g. hardware=h100_sxm "
                    f"launch.nnodes={max(1, cfg.world_size // 8)}")
        peak = summary["peak_memory_gib_per_device"] or summary["memory_lower_bound_gib"]
        beyond = (f" by more than the prediction's measured error of {summary['memory_margin']['measured_error']:.0%}"
                  if summary["memory_margin"]["measured_error"] else "")
        _refused_at_launch(cfg, f"launch.memory_budget_gb: predicted peak {peak:.2f} "
                                f"GiB per device exceeds the budget of {summary['memory_budget_gib']:.2f} GiB{beyond} "
                                f"({hint})")


def _job_failed(outcome: LaunchOutcome) -> LaunchOutcome:
    """A sweep goes on after a failed job (Hydra would stop at an exception) and ends failed; the
    job's value is NaN (``float(outcome)``), which a sweeper such as Optuna records as a failed trial."""
    print(f"sweep: job failed (exit code {outcome.exit_code}); going on with the next", file=sys.stderr, flush=True)
    return outcome


def _write_pictures(cfg, plan) -> None:
    """The dry run's placement picture and table, under ./meshflow-plan (``tracking.pictures``)."""
    if cfg.tracking.pictures:
        paths = write_placement(cfg, plan, DRY_RUN_DIR)
        print(f"placement picture: {paths['png'].resolve()}\nplacement table: {paths['json'].resolve()}")


def _plan_despite_batch(raw: dict, err: ConfigError) -> None:
    """A plan for a big mesh is useful before the batch arithmetic is settled; all else must hold."""
    cfg = RunConfig.model_validate(raw)
    plan, issues = check_against_model(cfg)
    if issues:
        print(ConfigError(err.issues + issues), file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    assert plan is not None, "a config without issues has a plan"
    text, summary = dry_run_report(cfg, plan)
    print(text)
    _write_pictures(cfg, plan)
    _failed_prediction(summary)
    _refused_at_launch(cfg, str(err))


def _failed_prediction(summary: dict) -> None:
    """A dry run whose memory or step prediction failed printed what it could; it exits 1, naming
    what failed, so that neither a reader nor a script takes the rest for a whole prediction."""
    if summary["errors"]:
        failed = "\n".join(f"  {error}" for error in summary["errors"])
        print(f"\nthe dry run's prediction failed (a bug of the planner for this layout, not of the config: "
              f"please report it):\n{failed}", file=sys.stderr)
        sys.exit(EXIT_FAILED)


def _refused_at_launch(cfg: RunConfig, why: str) -> None:
    """A dry run of a config a launch would refuse: the report was printed; exit 2 (a script
    planning many configs sees which fail) unless ``dry_run_exit_zero=true`` asks for 0."""
    print(f"\nthis config would be refused at launch:\n{why}", file=sys.stderr)
    if not cfg.dry_run_exit_zero:
        print("(exit 2; add dry_run_exit_zero=true to exit 0 with this report)", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
