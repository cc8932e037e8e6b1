"""Start the training: in-process on one device, or prod(mesh) workers through torch's elastic launcher.

The launcher owns the MLflow run (created here, ended here with FINISHED / FAILED / KILLED)
and the exit code; worker rank 0 logs metrics into that run; the other ranks log nothing.
Workers get the resolved, validated config as a JSON file the launcher writes, and read it
back into the same :class:`RunConfig`: nothing re-composes or re-validates it on the way.

A config that was validated elsewhere (the control plane writes ``job.json``) is launched with

    python -m trainer.launch job.json

and the plan resolved where it was validated, when a ``resolved_plan.json`` lies beside it, goes to the
workers once this launcher's meta model is seen to be its model: nothing resolves it again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parallel.errors import ConfigError
from parallel.plan.serial import ResolvedPlan
from parallel.plan.spec import ParallelPlan
from trainer.config.schema import RunConfig, TrackingConfig
from trainer.launch.console import log_config_changes, show_config
from trainer.launch.disk_checks import launch_disk_issues
from trainer.launch.elastic import PLAN_FILE, RendezvousFailure, WorkerFailure, launch_workers
from trainer.launch.processes import worker_server
from trainer.run.metrics import Progress
from trainer.tracking.mlflow_tracker import make_tracker
from trainer.tracking.end_of_run import AfterTraining
from trainer.tracking.run_info import run_name, run_url, ui_command
from trainer.tracking.run_record import launch_plan, record_start, summary, system_metrics, tee_output, upload_logs
from trainer.tracking.tracker import Terminated, install_signal_handlers, run_lifecycle

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_SIGINT, EXIT_SIGTERM = 0, 1, 2, 130, 143


@dataclass(frozen=True)
class LaunchOutcome:
    """What one launch ended with: :func:`launch` returns it, and nothing of it is kept elsewhere, so
    launches in threads of one process (a sweep's, the control plane's) each read their own.

    ``exit_code`` is the process's (:data:`EXIT_OK`, :data:`EXIT_FAILED`, ...); ``run_id`` the MLflow
    run's (None without tracking); ``losses`` and ``step_times`` rank 0's, one per step of this run;
    ``wall_s`` the launch's seconds; ``details`` rank 0's whole summary (``val_loss``, ``peak_memory_mb``,
    ``last_checkpoint``, ``pictures``, ...), empty when the run did not finish. ``float(outcome)`` is
    the final loss (NaN when there is none): what a sweep's job returns to a sweeper such as Optuna."""

    exit_code: int
    run_id: str | None = None
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.exit_code == EXIT_OK

    @property
    def final_loss(self) -> float:
        return self.losses[-1] if self.ok and self.losses else math.nan

    def __float__(self) -> float:
        return self.final_loss

    def as_dict(self) -> dict[str, Any]:
        """Rank 0's summary with the run id, as :func:`trainer.train` returns it."""
        return {**self.details, "run_id": self.run_id}


class LaunchSession:
    """The one place a launch enters the workers' fork server (:func:`trainer.launch.processes.worker_server`).

        with LaunchSession(raw["tracking"]) as session:   # the CLI: the server imports while it validates
            session.start_workers_server()
            outcome = session.launch(validated_config)

    :meth:`launch` starts the server itself for a config of several ranks (:func:`launch` is a session
    of one launch); the server stops when the session ends. ``tracking``: the tracking section, or its
    composed dict before validation (what rank 0 preloads: :func:`worker_preload`). ``started``: when the
    process started (``time.monotonic()``; the CLI's entry), from which the first launch's wall time
    counts, so that the summary's wall time is the command's; else each launch counts from its own call."""

    def __init__(self, tracking: TrackingConfig | Mapping[str, Any], *, started: float | None = None) -> None:
        self._tracking = tracking
        self._started = started
        self._stack = ExitStack()
        self._serving = False

    def __enter__(self) -> LaunchSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def start_workers_server(self) -> None:
        """Start the fork server now (once), so that its imports run beside what comes before the workers."""
        if not self._serving:
            self._stack.enter_context(worker_server(also_preload=worker_preload(self._tracking)))
            self._serving = True

    def launch(self, cfg: RunConfig, *, plan: ParallelPlan | ResolvedPlan | None = None) -> LaunchOutcome:
        """Train as ``cfg`` says: one device in this process, or the workers, forked from this session's server.
        ``plan``: the config's, as validation resolved it (a stored one is checked against the model first);
        else resolved here, once. Either goes to the
        workers (or the loop, on one device) with its model's fingerprint: none of them resolves it again."""
        began, self._started = self._started or time.monotonic(), None
        if issues := launch_disk_issues(cfg):  # this directory, as the run would use it
            print(ConfigError(issues), file=sys.stderr)
            return LaunchOutcome(EXIT_CONFIG)
        if cfg.world_size > 1:  # the workers' fork server imports while the launcher makes the run
            self.start_workers_server()
        return _launch_tracked(cfg, began, launch_plan(cfg, plan))


def launch(cfg: RunConfig, *, plan: ParallelPlan | ResolvedPlan | None = None) -> LaunchOutcome:
    """Train as the config says, in a :class:`LaunchSession` of its own; return the outcome (its
    ``exit_code`` is the process's exit code). ``plan``: the config's resolved plan, when the caller has it."""
    with LaunchSession(cfg.tracking) as session:
        return session.launch(cfg, plan=plan)


def worker_preload(tracking: TrackingConfig | Mapping[str, Any]) -> tuple[str, ...]:
    """What rank 0 imports beyond :data:`~trainer.launch.processes.PRELOAD`: MLflow's client and the
    store its tracking URI names (about 5 CPU-seconds), when the run logs to MLflow. ``tracking``:
    the section, or its composed dict before validation (the CLI starts the server that early)."""
    fields = tracking.model_dump() if isinstance(tracking, TrackingConfig) else tracking
    if fields.get("backend", "mlflow") != "mlflow":
        return ()
    uri = str(fields.get("tracking_uri") or "sqlite:")  # the default store is a SQLite file
    store = ("rest_store" if uri.startswith(("http://", "https://")) else
             "file_store" if uri.startswith("file:") or "://" not in uri else "sqlalchemy_store")
    return "mlflow.tracking", "mlflow.entities", f"mlflow.store.tracking.{store}"


def _launch_tracked(cfg: RunConfig, began: float, plan: ResolvedPlan | None) -> LaunchOutcome:
    """:meth:`LaunchSession.launch` inside the workers' server: the MLflow run, the training, the summary."""
    if cfg.launch.node_rank == 0:  # node 0 shows the run, as it owns its MLflow run: first, what runs
        show_config(cfg)
    # One run per job: node 0's launcher owns it (another node's would make a second one).
    tracker = make_tracker(cfg.tracking, is_main=cfg.launch.node_rank == 0, run_id=cfg.tracking.run_id,
                           run_name=run_name(cfg))
    url = run_url(cfg.tracking.tracking_uri, getattr(tracker, "experiment_id", None), tracker.run_id,
                  cfg.tracking.ui_url)
    if url:  # start-up says what it is doing: the run's page exists from now on, served by the command beside it
        serve = ui_command(cfg.tracking.tracking_uri, cfg.tracking.ui_url)
        print(f"mlflow run: {url}" + (f"  (serve it: {serve})" if serve else ""), flush=True)
    try:
        with install_signal_handlers(), run_lifecycle(tracker), system_metrics(cfg.tracking, tracker):
            if cfg.launch.node_rank == 0:
                log_config_changes(cfg, tracker)
            outcome = _train_and_record(cfg, tracker, began, plan)
        code = EXIT_OK if outcome.get("stopped_at") is None else _stopped_to_requeue(cfg, tracker.run_id, outcome)
        return LaunchOutcome(code, run_id=tracker.run_id, losses=list(outcome.get("losses") or []),
                             step_times=list(outcome.get("step_times") or []), wall_s=time.monotonic() - began,
                             details=outcome)
    except KeyboardInterrupt:
        print("interrupted: run stopped (MLflow run KILLED)", file=sys.stderr)
        return LaunchOutcome(EXIT_SIGINT, run_id=tracker.run_id, wall_s=time.monotonic() - began)
    except Terminated:
        print("terminated: run stopped (MLflow run KILLED)", file=sys.stderr)
        return LaunchOutcome(EXIT_SIGTERM, run_id=tracker.run_id, wall_s=time.monotonic() - began)
    except WorkerFailure as err:
        print(f"training failed: {err}", file=sys.stderr)
        return LaunchOutcome(EXIT_FAILED, run_id=tracker.run_id, wall_s=time.monotonic() - began)
    except RendezvousFailure as err:
        print(f"training did not start: {err}", file=sys.stderr)
        return LaunchOutcome(EXIT_FAILED, run_id=tracker.run_id, wall_s=time.monotonic() - began)


def _stopped_to_requeue(cfg: RunConfig, run_id: str | None, outcome: dict) -> int:
    """A run that stopped with a checkpoint when asked (Slurm's warning, :mod:`trainer.run.stop_request`):
    node 0 leaves its MLflow run's id for the requeued job to continue; the exit code asks for the requeue."""
    # start-up: torch's collectives behind the stop request load only in a run that was asked to stop
    from trainer.run.stop_request import EXIT_REQUEUE, RUN_ID_FILE, requeue_dir

    folder = requeue_dir()
    if folder is not None and run_id and cfg.launch.node_rank == 0:
        (folder / RUN_ID_FILE).write_text(run_id)
    print(f"stopped after step {outcome['stopped_at']} with checkpoint {outcome.get('last_checkpoint')}: "
          f"exit {EXIT_REQUEUE} (requeue)", flush=True)
    return EXIT_REQUEUE


def _train_and_record(cfg: RunConfig, tracker, began: float, plan: ResolvedPlan | None) -> dict:
    """The run's pictures, its training, its logs uploaded and (node 0) its summary printed: rank 0's
    summary of the loop, with the pictures and what failed after the last step (``end_of_run_errors``)."""
    rdzv_id = rendezvous_id(cfg)
    with _worker_logs(cfg) as log_base:
        pictures = record_start(tracker, cfg, Path(_pictures_dir(log_base, rdzv_id)), plan=plan.plan if plan else None,
                                artifacts=_auto_plan_artifacts(cfg))
        try:
            outcome = _train(cfg, tracker, log_base, rdzv_id, plan)
        finally:
            # torch elastic puts this run's logs in <log_base>/<rdzv id>_<random>/
            log_dir = _newest_log_dir(log_base, rdzv_id)
            upload_logs(tracker, log_dir)
        # the training finished: what fails from here on is reported and recorded, not the run's exit code
        after = AfterTraining(tracker, say=lambda line: print(line, flush=True),
                              errors=outcome.get("end_of_run_errors"))
        with after.guard("the placement picture"):
            outcome["pictures"] = {**pictures.result(), **(outcome.get("pictures") or {})}
        outcome["end_of_run_errors"] = after.errors
        if cfg.launch.node_rank == 0:  # node 0 owns the run's summary, as it owns its MLflow run
            print(summary(cfg, outcome, tracker, wall_s=time.monotonic() - began,
                          log_dir=log_dir if cfg.launch.log_dir else None), flush=True)
    return outcome


def rendezvous_id(cfg: RunConfig) -> str:
    """The id under which this run's nodes meet: ``launch.rdzv_id``; else, on one host, a fresh
    one; on several, a digest of what every node's config has in common (all but this node's
    rank and address), so launchers started with the same overrides meet without an agreed id."""
    if cfg.launch.rdzv_id:
        return cfg.launch.rdzv_id
    if cfg.launch.nnodes == 1:
        return f"{run_name(cfg)}-{uuid.uuid4().hex[:8]}"
    common = cfg.model_dump(mode="json")
    for per_node in ("node_rank", "local_addr", "log_dir"):
        common["launch"].pop(per_node)
    common["tracking"].pop("run_id")  # node 0's own run; the others have none
    return f"{run_name(cfg)}-{hashlib.sha256(json.dumps(common, sort_keys=True).encode()).hexdigest()[:12]}"


def _auto_plan_artifacts(cfg: RunConfig) -> dict[str, str]:
    """``+parallel=auto``: the planner's ranking as the run's artifacts; nothing for a hand-written layout."""
    if cfg.parallel is None or cfg.parallel.auto is None:
        return {}
    # start-up: the planner, and the validation its search runs, only for a run the planner chose
    from trainer.planner.auto.plan import ranking_artifacts

    return ranking_artifacts(cfg)


def _train(cfg: RunConfig, tracker, log_base: Path, rdzv_id: str, plan: ResolvedPlan | None) -> dict:
    """One device in this process, or the workers through torch's elastic launcher: rank 0's outcome."""
    if cfg.world_size == 1:
        # start-up: the training loop (DTensor, pipelining: about 0.7 s) only where training runs here,
        # not in a launcher that starts workers, validates or plans.
        from trainer.run.loop import train

        # the same layout as the workers' logs: the console's copy is this run's job log
        with tee_output(log_base / f"{rdzv_id}_local" / "attempt_0" / "0" / "stdout.log"):
            return train(cfg, tracker=tracker, progress=Progress(), pictures_dir=_pictures_dir(log_base, rdzv_id),
                         plan=plan).summary()
    return launch_workers(cfg, tracker.run_id, log_base, rdzv_id, _pictures_dir(log_base, rdzv_id), plan=plan)


def _newest_log_dir(log_base: Path, rdzv_id: str) -> Path | None:
    """This run's ``<rdzv id>_<random>`` log folder: the newest one (a rendezvous id given by the
    user or derived from the config is the same for every run of that config), not the pictures."""
    found = [d for d in log_base.glob(f"{rdzv_id}_*") if d.is_dir() and d.name != f"{rdzv_id}_pictures"]
    return max(found, key=lambda d: d.stat().st_mtime_ns, default=None)


def _pictures_dir(log_base: Path, rdzv_id: str) -> str:
    """Where a run's pictures are kept on disk: beside its logs (and in MLflow under ``pictures/``)."""
    return str((log_base / f"{rdzv_id}_pictures").resolve())


@contextmanager
def _worker_logs(cfg: RunConfig) -> Iterator[Path]:
    """The folder the per-rank logs go under: ``launch.log_dir``, or a temporary one (removed
    afterwards) when that is null."""
    if cfg.launch.log_dir is None:
        with tempfile.TemporaryDirectory(prefix="meshflow-logs-") as tmp:
            yield Path(tmp)
    else:
        yield Path(cfg.launch.log_dir)


def main(argv: list[str] | None = None) -> int:
    """``python -m trainer.launch CONFIG.json [--node-rank N | --node-rank-env VAR] [--rdzv-endpoint
    HOST:PORT] [--rdzv-id ID] [--local-addr ADDR] [--resume auto|PATH] [--run-id ID]``: launch a resolved
    config that was validated elsewhere (the control plane's ``job.json``) on this node. The options set the
    ``launch.*`` fields that differ between the nodes of one job, so an engine (Ray, a Kubernetes JobSet) runs
    the same file on every node; ``--node-rank-env JOB_COMPLETION_INDEX`` reads the rank from the
    environment. The exit code is :func:`launch`'s outcome's."""
    parser = argparse.ArgumentParser(prog="python -m trainer.launch", description=(main.__doc__ or "").split("\n\n")[0])
    parser.add_argument("config", help="a resolved config, as RunConfig.model_dump_json() writes it")
    rank = parser.add_mutually_exclusive_group()
    rank.add_argument("--node-rank", type=int, help="launch.node_rank of this node")
    rank.add_argument("--node-rank-env", metavar="VAR", help="read launch.node_rank from this environment variable")
    parser.add_argument("--rdzv-endpoint", help="launch.rdzv_endpoint (host:port of node 0's rendezvous)")
    parser.add_argument("--rdzv-id", help="launch.rdzv_id (the same on every node)")
    parser.add_argument("--local-addr", help="launch.local_addr (this node's address as the others reach it)")
    parser.add_argument("--resume", help="train.checkpoint.resume (a requeued Slurm job: auto, its last checkpoint)")
    parser.add_argument("--run-id", help="tracking.run_id (a requeued Slurm job: the MLflow run it continues)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = RunConfig.model_validate_json(Path(args.config).read_text())
        cfg = _with_node_options(cfg, args)
    except (OSError, ValueError) as err:  # pydantic's ValidationError is a ValueError
        first = str(err).splitlines()[0]
        print(f"{args.config}: not a resolved config for this node ({first}); write it with "
              "RunConfig.model_dump_json(), or run python -m trainer with overrides instead", file=sys.stderr)
        return EXIT_CONFIG
    return launch(cfg, plan=stored_plan(Path(args.config))).exit_code


def stored_plan(config_path: Path) -> ResolvedPlan | None:
    """The plan resolved where the config was validated: ``resolved_plan.json`` beside it (the control plane
    writes one beside ``job.json``), or None (none there, or unreadable: resolved here then, with a warning)."""
    path = config_path.parent / PLAN_FILE
    if not path.is_file():
        return None
    try:
        return ResolvedPlan.read(path)
    except (OSError, ValueError, KeyError, TypeError) as err:  # a file of another version or a damaged one
        print(f"{path}: not used, the plan is resolved again ({type(err).__name__}: {err})", file=sys.stderr)
        return None


def _with_node_options(cfg: RunConfig, args: argparse.Namespace) -> RunConfig:
    """The config with the node options applied, validated again (a node rank past nnodes is refused)."""
    node_rank = args.node_rank
    if args.node_rank_env is not None:
        raw = os.environ.get(args.node_rank_env, "")
        if not raw.isdigit():
            raise ValueError(f"--node-rank-env {args.node_rank_env}: the variable is {raw!r}, not a node rank")
        node_rank = int(raw)
    updates = {k: v for k, v in (("node_rank", node_rank), ("rdzv_endpoint", args.rdzv_endpoint),
                                 ("rdzv_id", args.rdzv_id), ("local_addr", args.local_addr)) if v is not None}
    if args.resume is not None:  # the same directory and keep; only where the run starts from
        checkpoint = cfg.train.checkpoint.model_copy(update={"resume": args.resume})
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"checkpoint": checkpoint})})
    if args.run_id is not None:
        cfg = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"run_id": args.run_id})})
    if not updates:
        return cfg  # the config as the service validated it: nothing is checked again

    launch_section = cfg.launch.model_validate({**cfg.launch.model_dump(), **updates})
    cfg = cfg.model_copy(update={"launch": launch_section})
    # start-up: a validated job.json launches without importing validation; only --node-rank overrides
    # are checked here, by the launch section's own checks.
    from trainer.validate.launch_checks import check_launch

    issues = check_launch(cfg)
    if issues:
        raise ValueError("; ".join(map(str, issues)))
    return cfg


if __name__ == "__main__":
    sys.exit(main())
