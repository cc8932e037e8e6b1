"""One launch inside its MLflow run: the run made (node 0, in a thread while the workers start), its record
written (in threads too), the training (one device here, or the workers through torch's elastic launcher,
rank 0 logging through this launcher's MLflow client), the logs uploaded, the summary printed.

:class:`trainer.launch.launcher.LaunchSession` calls :func:`launch_tracked` once the config passed the
launch's disk checks. This module brings torch, the elastic agent and MLflow's records; the launcher
imports it only then, so that ``python -m trainer`` starts the workers' fork server first.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from parallel.plan.serial import ResolvedPlan
from trainer.config.schema import RunConfig
from trainer.launch.console import config_changes_artifact, show_config
from trainer.launch.elastic import RendezvousFailure, WorkerFailure, launch_workers
from trainer.launch.outcome import EXIT_FAILED, EXIT_OK, EXIT_SIGINT, EXIT_SIGTERM, LaunchOutcome
from trainer.run.metrics import Progress
from trainer.tracking.end_of_run import AfterTraining
from trainer.tracking.mlflow_tracker import make_tracker
from trainer.tracking.run_info import run_name, run_url, ui_command
from trainer.tracking.run_record import record_start, summary, system_metrics, tee_output, upload_logs
from trainer.tracking.opening import OpeningRun
from trainer.tracking.relay import RelayServer
from trainer.tracking.tracker import (NullTracker, Terminated, Tracker, TrackingError, install_signal_handlers,
                                     run_lifecycle)


def launch_tracked(cfg: RunConfig, began: float, plan: ResolvedPlan | None) -> LaunchOutcome:
    """:meth:`~trainer.launch.launcher.LaunchSession.launch` inside the workers' server: the MLflow run,
    the training, the summary. ``began``: when the launch's wall time counts from."""
    if cfg.launch.node_rank == 0:  # node 0 shows the run, as it owns its MLflow run: first, what runs
        show_config(cfg)
    tracker = _open_run(cfg)
    try:
        with install_signal_handlers(), run_lifecycle(tracker), system_metrics(cfg.tracking, tracker):
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
    except (WorkerFailure, TrackingError) as err:
        print(f"training failed: {_cause(tracker, err)}", file=sys.stderr)
        return LaunchOutcome(EXIT_FAILED, run_id=tracker.run_id, wall_s=time.monotonic() - began)
    except RendezvousFailure as err:
        print(f"training did not start: {err}", file=sys.stderr)
        return LaunchOutcome(EXIT_FAILED, run_id=tracker.run_id, wall_s=time.monotonic() - began)


def _open_run(cfg: RunConfig) -> Tracker:
    """The job's MLflow run, made in a thread while the workers start (:mod:`trainer.tracking.opening`); its
    link printed once it exists. One run per job: node 0's launcher owns it (another node's would make a
    second one); NullTracker on the other nodes and with ``tracking.backend=none``."""
    if cfg.tracking.backend == "none" or cfg.launch.node_rank != 0:
        return NullTracker()

    def make() -> Tracker:
        tracker = make_tracker(cfg.tracking, is_main=True, run_id=cfg.tracking.run_id, run_name=run_name(cfg))
        url = run_url(cfg.tracking.tracking_uri, getattr(tracker, "experiment_id", None), tracker.run_id,
                      cfg.tracking.ui_url)
        if url:  # the run's page exists from now on, served by the command beside it
            serve = ui_command(cfg.tracking.tracking_uri, cfg.tracking.ui_url)
            print(f"mlflow run: {url}" + (f"  (serve it: {serve})" if serve else ""), flush=True)
        return tracker

    return OpeningRun(make)


def _cause(tracker: Tracker, err: Exception) -> BaseException:
    """What stopped the training: the MLflow run that could not be made (rank 0's writes failed on it), else ``err``."""
    failure = tracker.failure() if isinstance(tracker, OpeningRun) else None
    return failure if failure is not None else err


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


def _train_and_record(cfg: RunConfig, tracker: Tracker, began: float, plan: ResolvedPlan | None) -> dict:
    """The run's pictures, its training, its logs uploaded and (node 0) its summary printed: rank 0's
    summary of the loop, with the pictures and what failed after the last step (``end_of_run_errors``)."""
    rdzv_id = rendezvous_id(cfg)
    with _worker_logs(cfg) as log_base:
        artifacts = {**config_changes_artifact(cfg), **_auto_plan_artifacts(cfg)}
        record = record_start(tracker, cfg, Path(_pictures_dir(log_base, rdzv_id)), plan=plan.plan if plan else None,
                              artifacts=artifacts)
        try:
            outcome = _train(cfg, tracker, log_base, rdzv_id, plan)
        finally:
            # torch elastic puts this run's logs in <log_base>/<rdzv id>_<random>/
            log_dir = _newest_log_dir(log_base, rdzv_id)
            upload_logs(tracker, log_dir)
        # the training finished: what fails from here on is reported and recorded, not the run's exit code
        after = AfterTraining(tracker, say=lambda line: print(line, flush=True),
                              errors=outcome.get("end_of_run_errors"))
        with after.guard("the run's record (its params, config.yaml, plan.txt, placement picture)"):
            outcome["pictures"] = {**record.result(), **(outcome.get("pictures") or {})}
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


def _train(cfg: RunConfig, tracker: Tracker, log_base: Path, rdzv_id: str, plan: ResolvedPlan | None) -> dict:
    """One device in this process, or the workers through torch's elastic launcher: rank 0's outcome."""
    if cfg.world_size == 1:
        # start-up: the training loop (DTensor, pipelining: about 0.7 s) only where training runs here,
        # not in a launcher that starts workers, validates or plans.
        from trainer.run.loop import train

        # the same layout as the workers' logs: the console's copy is this run's job log
        with tee_output(log_base / f"{rdzv_id}_local" / "attempt_0" / "0" / "stdout.log"):
            return train(cfg, tracker=tracker, progress=Progress(), pictures_dir=_pictures_dir(log_base, rdzv_id),
                         plan=plan).summary()
    if isinstance(tracker, NullTracker):  # nothing to log (tracking=none), or another node's launcher
        return launch_workers(cfg, None, log_base, rdzv_id, _pictures_dir(log_base, rdzv_id), plan=plan)
    with RelayServer(tracker) as relay:  # rank 0 logs through this launcher's MLflow client
        return launch_workers(cfg, relay.address, log_base, rdzv_id, _pictures_dir(log_base, rdzv_id), plan=plan)


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
