"""One worker of a launch: read the config the launcher wrote, bind to the device its rank (or rank
id) names, join the process group and train; the elastic launcher forks it from a server that
imported torch once (:mod:`trainer.launch.processes`, :func:`worker_main`).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from torch.distributed import DistNetworkError

from parallel.config import mesh_rank_ids
from parallel.mesh import device_slot, rank_id_of
from parallel.plan.serial import ResolvedPlan
from trainer.config.schema import RunConfig
from trainer.launch.rendezvous import WORKER_STORE_TIMEOUT, worker_store
from trainer.run.metrics import NullProgress, Progress
from trainer.tracking.relay import RelayAddress, RelayTracker
from trainer.tracking.tracker import NullTracker, Tracker


def node_ordered_rank(cfg: RunConfig, local_rank: int, local_world_size: int) -> int:
    """A worker's rank in the process group: node 0's workers are ranks 0..n-1, node 1's n..2n-1 and so on.

    torch's rendezvous numbers the nodes in the order of their descriptors (host name, pid), not
    by ``launch.node_rank``; the trainer renumbers them so that the node the user calls 0 holds
    rank 0 (and with it the MLflow logging, the progress bar and the summary) and the innermost
    mesh axes (tp) stay inside a node."""
    return cfg.launch.node_rank * local_world_size + local_rank


def _resume_latest(cfg: RunConfig) -> RunConfig:
    """The same run, continuing from the newest checkpoint (if any) in its checkpoint dir."""
    ckpt = cfg.train.checkpoint.model_copy(update={"resume": "auto"})
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"checkpoint": ckpt})})


def worker_main(config_path: str, relay: RelayAddress | None, pictures_dir: str | None = None,
                predicted_peak_mib: float | None = None, plan_path: str | None = None) -> dict:
    """One worker: join the process group, train, leave. Runs in a process the launcher spawned;
    ``relay``: where rank 0 logs (the launcher's MLflow run), None when nothing is logged;
    ``predicted_peak_mib`` is the launcher's price of the plan, which rank 0 reports; ``plan_path`` the
    launcher's resolved plan, which the worker checks against its own model build and uses (None: the
    worker resolves the plan of its build itself)."""
    import torch
    import torch.distributed as dist

    from trainer.run.loop import resolve_device, train  # start-up: see trainer.launch.tracked._train

    cfg = RunConfig.model_validate_json(Path(config_path).read_text())
    plan = ResolvedPlan.read(Path(plan_path)) if plan_path is not None else None
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        cfg = _resume_latest(cfg)  # the elastic agent restarted us after a failure
    torch_rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    rank = node_ordered_rank(cfg, local_rank,
                             int(os.environ["LOCAL_WORLD_SIZE"])) if cfg.launch.nnodes > 1 else torch_rank
    rank_id, device_index = bind_worker(cfg, rank, int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
    device = resolve_device(cfg.device, device_index)
    torch.set_num_threads(1)  # several CPU workers share few cores; more threads only contend
    timeout = WORKER_STORE_TIMEOUT
    # the store the launcher serves (trainer.launch.rendezvous); the group's ranks in node order
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=timeout,
                            store=worker_store(timeout), rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    try:
        is_main = rank == 0
        workers: list[Any] = [None] * dist.get_world_size()  # each rank's (pid, where), once gathered
        dist.all_gather_object(workers, (os.getpid(), _placement(rank, rank_id, device)))
        if is_main:  # lets an operator (and the tests) find and signal one worker
            print("workers: " + " ".join(f"rank{r}={pid}" for r, (pid, _) in enumerate(workers)), flush=True)
            if mesh_rank_ids(cfg.mesh) is not None:  # and see that each id runs where it names
                print("rank ids: " + " ".join(where for _, where in workers), flush=True)
        relayed = RelayTracker(relay) if relay is not None and is_main else None
        tracker: Tracker = relayed or NullTracker()
        progress = Progress() if is_main else NullProgress()
        try:
            result = train(cfg, tracker=tracker, progress=progress, rank=rank, device_index=device_index,
                           pictures_dir=pictures_dir, predicted_peak_mib=predicted_peak_mib, plan=plan)
            if relayed is not None:  # rank 0: every write made in the launcher's run before the worker ends
                relayed.close()
        except Exception as err:
            # The agent reports whichever worker it saw die first, often a peer whose collective
            # broke; every worker names its own error so the root cause is in the output.
            where = f" on node {cfg.launch.node_rank} ({socket.gethostname()})" if cfg.launch.nnodes > 1 else ""
            print(f"worker rank {rank}{where} failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            if lost_a_peer(err):
                # A peer ended first (killed, out of memory): it is the cause. Ending a moment later
                # lets the agent, which polls every 0.2 s and names one worker, find that one alone
                # (a forked worker's end reaches it through the fork server, a few ms late).
                time.sleep(PEER_LOSS_GRACE_S)
            raise
        return result.summary()
    finally:
        dist.destroy_process_group()


PEER_LOSS_GRACE_S = 2.0
# How a collective fails when the worker at the other end is gone (gloo's socket errors; torch's own
# network error type covers the stores and NCCL's transport).
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket closed")


def lost_a_peer(err: BaseException) -> bool:
    return isinstance(err, DistNetworkError) or any(text in str(err) for text in PEER_LOST)


def bind_worker(cfg: RunConfig, rank: int, local_rank: int, local_world_size: int) -> tuple[int, int]:
    """This worker's rank id and the index of the GPU it uses (unused on CPU).

    A plain mesh shape: the id is the torch rank, the GPU is ``local_rank``, and the OS schedules
    the worker on any CPU. Explicit rank ids (``mesh: [[2,4,5],[0,1,3]]``) are placement labels:
    the worker at torch rank ``r`` (its position in the row-major flattened mesh) has id
    ``flat_ids[r]`` and runs on the slot the id names, GPU ``id % local_world_size`` or, on CPU,
    pinned to the ``id % k``-th of the ``k`` CPUs the process may use (ids beyond the cores share
    them: on a 2-core host ids 0, 2, 4 run on the first core and 1, 3, 5 on the second)."""
    from trainer.run.loop import resolve_device  # start-up: see trainer.launch.tracked._train

    ids = mesh_rank_ids(cfg.mesh)
    if ids is None:
        return rank, local_rank
    rank_id = rank_id_of(ids, rank)
    device_index = device_slot(rank_id, local_world_size)
    if resolve_device(cfg.device, device_index).type == "cpu" and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        _pin_process({cpus[device_slot(rank_id, len(cpus))]})
    return rank_id, device_index


def _pin_process(cpus: set[int]) -> None:
    """Every thread of this process (and so each thread it starts later) on ``cpus``: the
    affinity call itself only moves the calling thread."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    os.sched_setaffinity(0, cpus)


def _placement(rank: int, rank_id: int, device) -> str:
    """Where this worker runs, as the launcher's ``rank ids:`` line shows it:
    ``rank3=0 (host=node1 device=cpu cpus=0)``."""
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0)))) if hasattr(os, "sched_getaffinity") else "any"
    return f"rank{rank}={rank_id} (host={socket.gethostname()} device={device} cpus={cpus})"
