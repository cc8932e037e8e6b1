"""A launch's workers through torch's elastic launcher: ``prod(mesh) / nnodes`` of them on this node,
forked from the fork server the launch entered (:class:`trainer.launch.launcher.LaunchSession`).

    summary = launch_workers(cfg, relay, log_dir, rdzv_id, pictures_dir)   # rank 0's loop summary

Every worker reads the resolved config from a JSON file written here (:mod:`trainer.launch.worker`), and the
launcher's resolved plan from another beside it (``resolved_plan.json``, :class:`parallel.plan.serial.ResolvedPlan`),
which it checks against its own model build instead of resolving the plan again;
their logs go under ``<log_dir>/<rdzv id>_<random>/``; a worker that fails, or a rendezvous that does
not gather every node, is raised as :class:`WorkerFailure` / :class:`RendezvousFailure` naming the rank
or the node and how it ended.
"""

from __future__ import annotations

import json
import socket
import tempfile
from pathlib import Path
from typing import Any

from parallel.plan.serial import ResolvedPlan
from parallel.plan.spec import ParallelPlan
from trainer.config.schema import RunConfig
from trainer.launch.console import one_warning_each
from trainer.launch.processes import START_METHOD, cheap_method_names
from trainer.launch.rendezvous import LOOPBACK, is_loopback_run, register_rendezvous
from trainer.launch.worker import node_ordered_rank, worker_main
from trainer.planner.memory.budget import predicted_peak_mib
from trainer.tracking.relay import RelayAddress
from trainer.tracking.tracker import Terminated
from trainer.launch.disk_checks import checkpoint_sharing_warning

# torch's rank; on several hosts the trainer numbers ranks by node (node_ordered_rank), and the
# prefix names the node and the local rank instead
WORKER_LINE_PREFIX = "[rank${rank}]: "
PLAN_FILE = "resolved_plan.json"  # beside config.json (the dry run's meshflow-plan/plan.json is its predictions)


class WorkerFailure(RuntimeError):
    """A worker process failed; the message names its rank (and node) and how it ended."""


class RendezvousFailure(RuntimeError):
    """The nodes of a run did not all meet at the rendezvous in time."""


def launch_workers(cfg: RunConfig, relay: RelayAddress | None, log_dir: Path, rdzv_id: str, pictures_dir: str, *,
                   plan: ResolvedPlan | None = None) -> dict:
    """This node's workers, from start to end, inside the launch's fork server: rank 0's summary
    (this node's lowest rank's on another node), ``{}`` when it returned none. ``relay``: where rank 0
    logs (the launcher's tracker, :mod:`trainer.tracking.relay`); None: nothing is logged. ``plan``: the config's,
    as the launcher resolved it (priced here for rank 0 to report, and written for the workers to read;
    without it each worker resolves its own)."""
    launch_config = _launch_config(cfg, log_dir, rdzv_id)
    _say_what_starts(cfg, log_dir, rdzv_id)
    with tempfile.TemporaryDirectory(prefix="meshflow-") as tmp:
        config_path = Path(tmp) / "config.json"
        config_path.write_text(cfg.model_dump_json())
        plan_path = Path(tmp) / PLAN_FILE
        if plan is not None:
            plan.write(plan_path)
        cheap_method_names()
        with one_warning_each():
            results = _run_elastic(launch_config, (str(config_path), relay, pictures_dir,
                                                   _predicted_peak_mib(cfg, plan.plan if plan else None),
                                                   str(plan_path) if plan is not None else None), cfg)
    ln = cfg.launch
    if ln.nnodes > 1:
        print(f"node {ln.node_rank} of {ln.nnodes}: its {cfg.world_size // ln.nnodes} workers finished", flush=True)
    # keyed by torch's global rank; this node's local rank 0 is its lowest (rank 0 itself on node 0)
    return results[min(results)] or {} if results else {}


def _launch_config(cfg: RunConfig, log_dir: Path, rdzv_id: str) -> Any:
    """torch's :class:`LaunchConfig` for this node's workers."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std  # start-up: a launch of workers only
    from torch.distributed.launcher.api import LaunchConfig

    ln = cfg.launch
    nproc = cfg.world_size // ln.nnodes
    # Every worker writes its stdout and stderr to files (<log_dir>/<rdzv id>/attempt_<n>/<local
    # rank>/); the console shows rank 0's output and every rank's errors, each line prefixed
    # with its global rank, as torchrun's --tee does.
    main_node = ln.node_rank == 0
    logs = DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL,
                            tee={r: Std.ALL if main_node and r == 0 else Std.ERR for r in range(nproc)})
    loopback = is_loopback_run(cfg)  # then every store and gloo listen on 127.0.0.1 only
    backend = register_rendezvous(loopback)  # the launcher serves the workers' store (trainer.launch.rendezvous)
    return LaunchConfig(
        min_nodes=ln.nnodes,
        max_nodes=ln.nnodes,
        nproc_per_node=nproc,
        logs_specs=logs,
        log_line_prefix_template=WORKER_LINE_PREFIX if ln.nnodes == 1 else f"[node{ln.node_rank}.${{local_rank}}]: ",
        run_id=rdzv_id,
        rdzv_backend=backend,
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


def _say_what_starts(cfg: RunConfig, log_dir: Path, rdzv_id: str) -> None:
    """The console's line before the workers start: how many, on which mesh (and, on a node other
    than 0, which ranks join which rendezvous)."""
    ln = cfg.launch
    nproc = cfg.world_size // ln.nnodes
    if ln.nnodes > 1:  # a node other than 0 shows nothing else of the run: say what it does
        first = ln.node_rank * nproc
        print(f"node {ln.node_rank} of {ln.nnodes}: workers rank {first}..{first + nproc - 1} join the rendezvous "
              f"{rdzv_id} at {ln.rdzv_endpoint} (logs: {log_dir})", flush=True)
        if warning := checkpoint_sharing_warning(cfg):
            print(f"node {ln.node_rank} of {ln.nnodes}: {warning}", flush=True)
    if ln.node_rank == 0:
        dims = ", ".join(cfg.parallel.dims) if cfg.parallel else ""
        kept = f"; each rank's output under {log_dir}/{rdzv_id}_*/" if ln.log_dir else ""  # else a temporary folder
        print(f"starting {nproc} workers: mesh {list(cfg.mesh_shape)}, dims [{dims}]{kept}", flush=True)


def _predicted_peak_mib(cfg: RunConfig, plan: ParallelPlan | None) -> float | None:
    """The plan's per-rank peak for rank 0 to report; the validation and plan.txt priced this
    config already, so it is looked up, not a meta pass in rank 0 that every rank would wait for.
    None when it cannot be priced (no plan: the model cannot be planned on the meta device): rank 0
    tries and says why."""
    if plan is None:
        return None
    try:
        return predicted_peak_mib(cfg, plan)
    except Exception:  # noqa: BLE001 - e.g. a custom module the meta device cannot run
        return None


def _run_elastic(launch_config: Any, worker_args: tuple, cfg: RunConfig) -> dict:
    # start-up: torch's elastic agent, in a launch of workers only
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


def _describe_failures(err: Any, cfg: RunConfig) -> str:
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
