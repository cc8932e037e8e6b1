"""Start the training: in-process on one device, or prod(mesh) workers through torch's elastic launcher.

The launcher owns the MLflow run (made here, beside the workers' start, and ended here with FINISHED / FAILED /
KILLED) and the exit code; worker rank 0 logs into that run through the launcher's MLflow client
(:mod:`trainer.tracking.relay`: one client per job); the other ranks log nothing.
Workers get the resolved, validated config as a JSON file the launcher writes, and read it
back into the same :class:`RunConfig`: nothing re-composes or re-validates it on the way.

A config that was validated elsewhere (the control plane writes ``job.json``) is launched with

    python -m trainer.launch job.json

and the plan resolved where it was validated, when a ``resolved_plan.json`` lies beside it, goes to the
workers once this launcher's meta model is seen to be its model: nothing resolves it again.

This module stays light (no torch, no MLflow at import): ``python -m trainer`` opens a
:class:`LaunchSession`, which starts the workers' fork server, before it imports validation and torch,
so that the server's imports run beside the command line's. The launch itself is
:func:`trainer.launch.tracked.launch_tracked`, imported when a launch begins.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from parallel.errors import ConfigError
from trainer.config.schema import RunConfig
from trainer.launch.disk_checks import launch_disk_issues
from trainer.launch.outcome import EXIT_CONFIG, LaunchOutcome
from trainer.launch.processes import worker_server

if TYPE_CHECKING:
    from parallel.plan.serial import ResolvedPlan
    from parallel.plan.spec import ParallelPlan


class LaunchSession:
    """The one place a launch enters the workers' fork server (:func:`trainer.launch.processes.worker_server`).

        with LaunchSession() as session:   # the CLI: the server imports while it validates
            session.start_workers_server()
            outcome = session.launch(validated_config)

    :meth:`launch` starts the server itself for a config of several ranks (:func:`launch` is a session
    of one launch); the server stops when the session ends. ``started``: when the
    process started (``time.monotonic()``; the CLI's entry), from which the first launch's wall time
    counts, so that the summary's wall time is the command's; else each launch counts from its own call."""

    def __init__(self, *, started: float | None = None) -> None:
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
            self._stack.enter_context(worker_server())
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
        # start-up: torch, the elastic agent and MLflow load here, once the server above imports beside them
        from trainer.launch.tracked import launch_tracked
        from trainer.tracking.run_record import launch_plan

        return launch_tracked(cfg, began, launch_plan(cfg, plan))


def launch(cfg: RunConfig, *, plan: ParallelPlan | ResolvedPlan | None = None) -> LaunchOutcome:
    """Train as the config says, in a :class:`LaunchSession` of its own; return the outcome (its
    ``exit_code`` is the process's exit code). ``plan``: the config's resolved plan, when the caller has it."""
    with LaunchSession() as session:
        return session.launch(cfg, plan=plan)


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
    # start-up: the plan's types bring torch; the job's file is read once the command line has started
    from parallel.plan.serial import ResolvedPlan
    from trainer.launch.elastic import PLAN_FILE

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
