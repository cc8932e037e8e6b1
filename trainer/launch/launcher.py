"""Start the training: in-process on one device, or prod(mesh) workers through torch's elastic launcher.

The launcher owns the MLflow run (created here, ended here with FINISHED / FAILED / KILLED)
and the exit code; worker rank 0 logs metrics into that run; the other ranks log nothing.
Workers get the resolved, validated config as a JSON file the launcher writes, and read it
back into the same :class:`RunConfig`: nothing re-composes or re-validates it on the way.

A config that was validated elsewhere (the control plane writes ``job.json``) is launched with

    python -m trainer.launch job.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from trainer.config.schema import RunConfig, TrackingConfig
from trainer.launch.console import log_config_changes, one_warning_each, show_config
from trainer.launch.processes import START_METHOD, cheap_method_names, worker_server
from trainer.launch.rendezvous import BACKEND as RDZV_BACKEND
from trainer.launch.rendezvous import LOOPBACK, is_loopback_run, register_loopback_rendezvous
from trainer.launch.worker import node_ordered_rank, worker_main
from trainer.planner.memory.budget import predicted_peak_mib
from trainer.run.metrics import Progress
from trainer.tracking.mlflow_tracker import make_tracker
from trainer.tracking.run_info import run_name, run_url
from trainer.tracking.run_record import log_final_model, record_start, summary, system_metrics, tee_output, upload_logs
from trainer.tracking.tracker import Terminated, install_signal_handlers, run_lifecycle

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_SIGINT, EXIT_SIGTERM = 0, 1, 2, 130, 143


def launch(cfg: RunConfig) -> int:
    """Train as the config says; return the process exit code. The outcome of the last launch in
    this process (losses, timings; a sweep reads it) is kept in :data:`LAST_OUTCOME`."""
    global LAST_OUTCOME
    LAST_OUTCOME = None
    began = time.monotonic()
    with ExitStack() as server:
        if cfg.world_size > 1:  # the workers' fork server imports while the launcher makes the run
            server.enter_context(worker_server(also_preload=worker_preload(cfg.tracking)))
        return _launch_tracked(cfg, began)


def worker_preload(tracking: TrackingConfig | dict) -> tuple[str, ...]:
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


def _launch_tracked(cfg: RunConfig, began: float) -> int:
    """:func:`launch` inside the workers' server: the MLflow run, the training, the summary."""
    global LAST_OUTCOME
    if cfg.launch.node_rank == 0:  # node 0 shows the run, as it owns its MLflow run: first, what runs
        show_config(cfg)
    # One run per job: node 0's launcher owns it (another node's would make a second one).
    tracker = make_tracker(cfg.tracking, is_main=cfg.launch.node_rank == 0, run_id=cfg.tracking.run_id,
                           run_name=run_name(cfg))
    url = run_url(cfg.tracking.tracking_uri, getattr(tracker, "experiment_id", None), tracker.run_id, cfg.tracking.ui_url)
    if url:  # start-up says what it is doing: the run's page exists from now on
        print(f"mlflow run: {url}", flush=True)
    try:
        with install_signal_handlers(), run_lifecycle(tracker), system_metrics(cfg.tracking, tracker):
            if cfg.launch.node_rank == 0:
                log_config_changes(cfg, tracker)
            rdzv_id = rendezvous_id(cfg)
            with _worker_logs(cfg) as log_base:
                pictures = record_start(tracker, cfg, Path(_pictures_dir(log_base, rdzv_id)),
                                        artifacts=_auto_plan_artifacts(cfg))
                try:
                    outcome = _train(cfg, tracker, log_base, rdzv_id)
                    outcome["pictures"] = {**pictures.result(), **(outcome.get("pictures") or {})}
                finally:
                    # torch elastic puts this run's logs in <log_base>/<rdzv id>_<random>/
                    log_dir = _newest_log_dir(log_base, rdzv_id)
                    upload_logs(tracker, log_dir)
                log_final_model(tracker, cfg, outcome)
                if cfg.launch.node_rank == 0:  # node 0 owns the run's summary, as it owns its MLflow run
                    print(summary(cfg, outcome, tracker, wall_s=time.monotonic() - began,
                                  log_dir=log_dir if cfg.launch.log_dir else None), flush=True)
        LAST_OUTCOME = {**outcome, "run_id": tracker.run_id}
        return EXIT_OK
    except KeyboardInterrupt:
        print("interrupted: run stopped (MLflow run KILLED)", file=sys.stderr)
        return EXIT_SIGINT
    except Terminated:
        print("terminated: run stopped (MLflow run KILLED)", file=sys.stderr)
        return EXIT_SIGTERM
    except WorkerFailure as err:
        print(f"training failed: {err}", file=sys.stderr)
        return EXIT_FAILED
    except RendezvousFailure as err:
        print(f"training did not start: {err}", file=sys.stderr)
        return EXIT_FAILED


LAST_OUTCOME: dict | None = None


class WorkerFailure(RuntimeError):
    """A worker process failed; the message names its rank (and node) and how it ended."""


class RendezvousFailure(RuntimeError):
    """The nodes of a run did not all meet at the rendezvous in time."""


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


def _train(cfg: RunConfig, tracker, log_base: Path | None, rdzv_id: str) -> dict:
    """One device in this process, or the workers through torch's elastic launcher: rank 0's outcome."""
    if cfg.world_size == 1:
        # start-up: the training loop (DTensor, pipelining: about 0.7 s) only where training runs here,
        # not in a launcher that starts workers, validates or plans.
        from trainer.run.loop import train

        # the same layout as the workers' logs: the console's copy is this run's job log
        with tee_output(log_base / f"{rdzv_id}_local" / "attempt_0" / "0" / "stdout.log"):
            return train(cfg, tracker=tracker, progress=Progress(), pictures_dir=_pictures_dir(log_base, rdzv_id)).summary()
    return _launch_workers(cfg, tracker.run_id, log_base, rdzv_id)


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


def _launch_workers(cfg: RunConfig, run_id: str | None, log_dir: Path, rdzv_id: str) -> dict:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    ln = cfg.launch
    nproc = cfg.world_size // ln.nnodes
    # With the rendezvous store shared into the workers (torch's default), a restarted round
    # reuses that store and the workers' process sub-groups read the dead round's addresses
    # (gloo: "connectFullMesh ... Connection refused"). A fresh worker store per round avoids it.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # Every worker writes its stdout and stderr to files (<log_dir>/<rdzv id>/attempt_<n>/<local
    # rank>/); the console shows rank 0's output and every rank's errors, each line prefixed
    # with its global rank, as torchrun's --tee does.
    main_node = ln.node_rank == 0
    logs = DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL,
                            tee={r: Std.ALL if main_node and r == 0 else Std.ERR for r in range(nproc)})
    loopback = is_loopback_run(cfg)
    if loopback:  # every store and gloo listen on 127.0.0.1 only (trainer.launch.rendezvous)
        register_loopback_rendezvous()
    launch_config = LaunchConfig(
        min_nodes=ln.nnodes,
        max_nodes=ln.nnodes,
        nproc_per_node=nproc,
        logs_specs=logs,
        log_line_prefix_template=WORKER_LINE_PREFIX if ln.nnodes == 1 else f"[node{ln.node_rank}.${{local_rank}}]: ",
        run_id=rdzv_id,
        rdzv_backend=RDZV_BACKEND if loopback else "c10d",
        rdzv_endpoint=ln.rdzv_endpoint,
        local_addr=LOOPBACK if loopback else ln.local_addr,
        # node 0 serves the rendezvous store on rdzv_endpoint; the others dial it
        # (read_timeout: how long a node dials node 0's store before giving up, as long as the join)
        rdzv_configs={"join_timeout": ln.rdzv_timeout_s, "read_timeout": ln.rdzv_timeout_s,
                      **({"is_host": main_node} if ln.nnodes > 1 else {})},
        max_restarts=ln.max_restarts,
        start_method=START_METHOD,  # forked from a server that imported torch once (trainer.launch.processes)
        monitor_interval=0.2,
    )
    if ln.nnodes > 1:  # a node other than 0 shows nothing else of the run: say what it does
        first = ln.node_rank * nproc
        print(f"node {ln.node_rank} of {ln.nnodes}: workers rank {first}..{first + nproc - 1} join the rendezvous "
              f"{rdzv_id} at {ln.rdzv_endpoint} (logs: {log_dir})", flush=True)
        if cfg.train.checkpoint.every and main_node:
            print(f"node 0 of {ln.nnodes}: checkpoints go to {cfg.train.checkpoint.dir}, which every node must share "
                  "(each rank writes its own shards there)", flush=True)
    if main_node:
        dims = ", ".join(cfg.parallel.dims) if cfg.parallel else ""
        kept = f"; each rank's output under {log_dir}/{rdzv_id}_*/" if ln.log_dir else ""  # else a temporary folder
        print(f"starting {nproc} workers: mesh {list(cfg.mesh_shape)}, dims [{dims}]{kept}", flush=True)
    with tempfile.TemporaryDirectory(prefix="meshflow-") as tmp:
        config_path = Path(tmp) / "config.json"
        config_path.write_text(cfg.model_dump_json())
        cheap_method_names()
        with worker_server(), one_warning_each():  # launch() started the server; alone, it starts here
            results = _run_elastic(launch_config, (str(config_path), run_id, _pictures_dir(log_dir, rdzv_id),
                                                   _predicted_peak_mib(cfg)), cfg)
    if ln.nnodes > 1:
        print(f"node {ln.node_rank} of {ln.nnodes}: its {nproc} workers finished", flush=True)
    # keyed by torch's global rank; this node's local rank 0 is its lowest (rank 0 itself on node 0)
    return results[min(results)] or {} if results else {}


# torch's rank; on several hosts the trainer numbers ranks by node (node_ordered_rank), and the
# prefix names the node and the local rank instead
WORKER_LINE_PREFIX = "[rank${rank}]: "


def _predicted_peak_mib(cfg: RunConfig) -> float | None:
    """The plan's per-rank peak for rank 0 to report; the validation and plan.txt priced this
    config already, so it is looked up, not a meta pass in rank 0 that every rank would wait for.
    None when it cannot be priced: rank 0 tries and says why."""
    try:
        return predicted_peak_mib(cfg)
    except Exception:  # noqa: BLE001 - e.g. a custom module the meta device cannot run
        return None


def _run_elastic(launch_config, worker_args: tuple, cfg: RunConfig) -> dict:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError
    from torch.distributed.launcher.api import elastic_launch

    try:
        return elastic_launch(launch_config, worker_main)(*worker_args)
    except SignalException as err:
        # The elastic agent already stopped every worker; report it as the signal it was.
        raise (KeyboardInterrupt() if err.sigval.name == "SIGINT" else Terminated()) from None
    except ChildFailedError as err:
        raise WorkerFailure(_describe_failures(err, cfg)) from None
    except RendezvousTimeoutError:
        ln = cfg.launch
        raise RendezvousFailure(
            f"node {ln.node_rank} of {ln.nnodes}: the rendezvous {launch_config.run_id} at {ln.rdzv_endpoint} did "
            f"not gather all {ln.nnodes} nodes within launch.rdzv_timeout_s={ln.rdzv_timeout_s:g} s; start every node "
            f"with launch.nnodes={ln.nnodes}, its own launch.node_rank (0..{ln.nnodes - 1}), the same "
            f"launch.rdzv_endpoint and launch.rdzv_id={launch_config.run_id}, or raise launch.rdzv_timeout_s") from None
    except RendezvousConnectionError:
        ln = cfg.launch
        raise RendezvousFailure(
            f"node {ln.node_rank} of {ln.nnodes}: no rendezvous store answered at {ln.rdzv_endpoint} within "
            f"launch.rdzv_timeout_s={ln.rdzv_timeout_s:g} s; start node 0 (launch.node_rank=0) on the host that "
            "address names, with the same launch.rdzv_endpoint, or raise launch.rdzv_timeout_s") from None


def _describe_failures(err, cfg: RunConfig) -> str:
    """Each failed worker by its rank in the run (and its node, when there are several), with how it ended."""
    ln = cfg.launch
    nproc = cfg.world_size // ln.nnodes
    where = f" on node {ln.node_rank} ({socket.gethostname()})" if ln.nnodes > 1 else ""
    parts = []
    for torch_rank, failure in sorted(err.failures.items()):
        rank = node_ordered_rank(cfg, failure.local_rank, nproc) if ln.nnodes > 1 else torch_rank
        how = (f"was killed by signal {failure.signal_name()}" if failure.exitcode < 0
               else f"exited with code {failure.exitcode}")
        message = failure.message if isinstance(failure.message, str) else json.dumps(failure.message)[:500]
        parts.append(f"worker rank {rank}{where} (pid {failure.pid}) {how}"
                     + (f": {message}" if message and failure.exitcode > 0 else ""))
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """``python -m trainer.launch CONFIG.json [--node-rank N | --node-rank-env VAR] [--rdzv-endpoint
    HOST:PORT] [--rdzv-id ID] [--local-addr ADDR]``: launch a resolved config that was validated
    elsewhere (the control plane's ``job.json``) on this node. The options set the ``launch.*``
    fields that differ between the nodes of one job, so an engine (Ray, a Kubernetes JobSet) runs
    the same file on every node; ``--node-rank-env JOB_COMPLETION_INDEX`` reads the rank from the
    environment. The exit code is :func:`launch`'s."""
    parser = argparse.ArgumentParser(prog="python -m trainer.launch", description=main.__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a resolved config, as RunConfig.model_dump_json() writes it")
    rank = parser.add_mutually_exclusive_group()
    rank.add_argument("--node-rank", type=int, help="launch.node_rank of this node")
    rank.add_argument("--node-rank-env", metavar="VAR", help="read launch.node_rank from this environment variable")
    parser.add_argument("--rdzv-endpoint", help="launch.rdzv_endpoint (host:port of node 0's rendezvous)")
    parser.add_argument("--rdzv-id", help="launch.rdzv_id (the same on every node)")
    parser.add_argument("--local-addr", help="launch.local_addr (this node's address as the others reach it)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = RunConfig.model_validate_json(Path(args.config).read_text())
        cfg = _with_node_options(cfg, args)
    except (OSError, ValueError) as err:  # pydantic's ValidationError is a ValueError
        first = str(err).splitlines()[0]
        print(f"{args.config}: not a resolved config for this node ({first}); write it with "
              "RunConfig.model_dump_json(), or run python -m trainer with overrides instead", file=sys.stderr)
        return EXIT_CONFIG
    return launch(cfg)


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
    if not updates:
        return cfg  # the config as the service validated it: nothing is checked again

    launch_section = cfg.launch.model_validate({**cfg.launch.model_dump(), **updates})
    cfg = cfg.model_copy(update={"launch": launch_section})
    # start-up: a validated job.json launches without importing validation; only --node-rank overrides
    # are checked here, by the launch section's own checks.
    from trainer.validate.checks import check_launch

    issues = check_launch(cfg)
    if issues:
        raise ValueError("; ".join(map(str, issues)))
    return cfg


if __name__ == "__main__":
    sys.exit(main())
