"""A request from outside to stop after the current step with a checkpoint: Slurm's warning before a time
limit or a preemption, passed on by the job's script (:mod:`trainer.launch.slurm`) as a file.

    stop = StopRequest.from_environment(pm, device, rank=rank)   # inert unless $MESHFLOW_REQUEUE_DIR is set
    if stop.requested():          # a collective when active: every rank stops after the same step
        ...save a checkpoint, leave the loop

The script exports ``MESHFLOW_REQUEUE_DIR`` (the job's folder, shared by its nodes) and, on ``USR1``,
creates ``<dir>/stop`` there. Rank 0 looks for it after each step and every rank learns its answer by
one all-reduce of a single integer, so all stop after the same step. A run started without the
variable (every local run) does nothing of this.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

REQUEUE_DIR_ENV = "MESHFLOW_REQUEUE_DIR"
STOP_FILE = "stop"           # created by the job script when Slurm warns
RUN_ID_FILE = "mlflow_run_id"  # written by node 0's launcher when it stops: the requeued job continues that run
EXIT_REQUEUE = 75  # a run that saved a checkpoint on Slurm's warning and stopped, to be requeued (BSD's EX_TEMPFAIL)


def requeue_dir() -> Path | None:
    """The job's folder when this run is a Slurm job that may be requeued, else None."""
    value = os.environ.get(REQUEUE_DIR_ENV)
    return Path(value) if value else None


class StopRequest:
    """Whether the job was asked to stop after this step (see the module docstring)."""

    def __init__(self, stop_file: Path | None, *, distributed: bool, device: torch.device, rank: int) -> None:
        self.stop_file, self.distributed, self.device, self.rank = stop_file, distributed, device, rank

    @classmethod
    def from_environment(cls, *, distributed: bool, device: torch.device, rank: int) -> StopRequest:
        folder = requeue_dir()
        return cls(folder / STOP_FILE if folder else None, distributed=distributed, device=device, rank=rank)

    def requested(self) -> bool:
        """True on every rank once rank 0 has seen the stop file (a collective when the run is distributed)."""
        if self.stop_file is None:
            return False
        seen = self.rank == 0 and self.stop_file.exists()
        if not self.distributed:
            return seen
        import torch.distributed as dist

        flag = torch.tensor([int(seen)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
