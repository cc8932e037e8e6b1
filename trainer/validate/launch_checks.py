"""The ``launch`` section's checks: node rank and count, the rendezvous endpoint, Slurm's numbering, and a
checkpoint directory that several nodes must share to resume from.

    issues = check_launch(cfg)      # [] when the section holds; the launcher asks it again of --node-rank overrides
"""

from __future__ import annotations

import platform
from pathlib import Path

from parallel.errors import ConfigIssue
from parallel.topology import mesh_rank_ids
from trainer.checkpoint.layout import SHARED_DIR_EXAMPLE
from trainer.config.schema import RunConfig
from trainer.planner.memory.host import has_mallopt
from trainer.validate.hardware_checks import plans_elsewhere


def check_launch(cfg: RunConfig) -> list[ConfigIssue]:
    """The ``launch`` section against the mesh: node rank, node count, the rendezvous endpoint."""
    issues = []
    ln = cfg.launch
    if ln.node_rank >= ln.nnodes:
        issues.append(ConfigIssue("launch.node_rank", f"{ln.node_rank} is not below launch.nnodes {ln.nnodes} "
                                  "(hosts are numbered from 0)",
                                  f"use a node_rank from 0 to {ln.nnodes - 1}, e.g. launch.node_rank=0, "
                                  "or raise launch.nnodes"))
    if cfg.world_size % ln.nnodes:
        issues.append(ConfigIssue("launch.nnodes", f"world size {cfg.world_size} does not split over {ln.nnodes} hosts",
                                  "use an nnodes that divides the number of mesh devices"))
    if mesh_rank_ids(cfg.mesh) is not None and ln.nnodes > 1:
        # An id names a device slot on the worker's host, but the elastic launcher gives each host
        # a block of torch ranks, so an id could name a slot on another host.
        issues.append(ConfigIssue("mesh", "explicit rank ids are supported on one host only: a rank id names a "
                                  "device of the worker's own host, and several hosts each run a fixed block of ranks",
                                  "use a mesh shape with several hosts"))
    host, _, port = ln.rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        issues.append(ConfigIssue("launch.rdzv_endpoint", f"{ln.rdzv_endpoint!r} is not host:port",
                                  "write it as host:port, e.g. launch.rdzv_endpoint=127.0.0.1:29500"))
    # a plan starts no rendezvous; a Slurm job's nodes meet on the first node of its allocation
    elif ln.nnodes > 1 and int(port) == 0 and not plans_elsewhere(cfg) and ln.executor != "slurm":
        issues.append(ConfigIssue("launch.rdzv_endpoint", f"port 0 with launch.nnodes={ln.nnodes}: the other nodes "
                                  "cannot know which free port node 0 picked",
                                  "give node 0's address and a fixed port, "
                                  "e.g. launch.rdzv_endpoint=10.0.0.1:29500, the same on every node"))
    if ln.executor == "slurm" and ln.node_rank:
        issues.append(ConfigIssue("launch.node_rank", f"{ln.node_rank} with launch.executor=slurm: one command "
                                  "submits the job for every node, and Slurm numbers them",
                                  "leave it out, e.g. launch.node_rank=0"))
    issues += _check_checkpoint_sharing(cfg)
    if ln.unmap_freed_memory and not has_mallopt():
        issues.append(ConfigIssue("launch.unmap_freed_memory", "needs glibc's mallopt; this host's C library is "
                                  f"{platform.libc_ver()[0] or 'unknown'}", "set launch.unmap_freed_memory=false"))
    return issues


def _check_checkpoint_sharing(cfg: RunConfig) -> list[ConfigIssue]:
    """Several nodes resuming from a relative ``train.checkpoint.dir``: each node's launcher has its own
    working directory, so unless it is on a disk they share, no node holds a whole checkpoint to resume
    from. Refused for what resumes (elastic restarts, ``train.checkpoint.resume``); a warning otherwise
    (:func:`trainer.launch.disk_checks.checkpoint_sharing_warning`)."""
    ln, ckpt = cfg.launch, cfg.train.checkpoint
    if ln.nnodes == 1 or Path(ckpt.dir).is_absolute() or plans_elsewhere(cfg):
        return []
    resuming = [what for what, on in ((f"launch.max_restarts={ln.max_restarts} (a restart resumes from the latest "
                                       "checkpoint)", ln.max_restarts > 0),
                                      (f"train.checkpoint.resume={ckpt.resume}", ckpt.resume != "none")) if on]
    if not resuming:
        return []
    return [ConfigIssue("train.checkpoint.dir", f"{ckpt.dir!r} is relative with launch.nnodes={ln.nnodes}: each node "
                        "writes its ranks' shards under its own working directory, and "
                        f"{' and '.join(resuming)} needs every shard of a checkpoint on every node",
                        "give a directory every node mounts at the same path, e.g. "
                        f"train.checkpoint.dir={SHARED_DIR_EXAMPLE}")]
