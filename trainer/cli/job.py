"""One composed job of ``python -m trainer``, after :func:`trainer.cli.main.run_job` started the workers'
fork server: validated (the planner's search first for ``+parallel=auto``), then launched, planned
(``dry_run=true``: the report and pictures, exit codes a script can read) or only checked.

Here come validation, the planner and torch: :mod:`trainer.cli.main` imports this module once the
server is started, so that the server's imports run beside these.
"""

from __future__ import annotations

import sys

from parallel.errors import ConfigError
from trainer.config.schema import RunConfig
from trainer.launch.launcher import LaunchSession
from trainer.launch.outcome import EXIT_CONFIG, EXIT_FAILED, LaunchOutcome
from trainer.launch.slurm import dry_run_script, submit_and_follow
from trainer.pictures.placement import DRY_RUN_DIR, write_placement
from trainer.planner.auto.plan import resolve_and_validate
from trainer.planner.forecast.plan_file import dry_run_report
from trainer.tracking.run_record import launch_plan
from trainer.validate.model_checks import check_against_model

_BATCH_PATHS = {"train.global_batch_size", "parallel.pipeline.microbatches"}


def run(raw: dict, sweeping: bool, session: LaunchSession) -> LaunchOutcome | None:
    """The composed config validated (``+parallel=auto``: chosen by the planner first), then launched
    in ``session``, planned (``dry_run=true``) or only checked (``validate_only=true``). A bad config
    exits 2, or in a sweep returns its failed outcome."""
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
