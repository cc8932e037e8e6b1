"""How the control plane runs a job: the executor interface.

The scheduler decides *when* a job runs (queue, capacity, quotas); an executor decides *where*
and *how*: local processes (the default), a Ray placement group, a Kubernetes JobSet. Which one
serves the jobs is a service setting (``MESHFLOW_EXECUTOR``); users' configs never change. The job
store stays the record: an executor keeps nothing the store does not have except its ``ref``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # the settings' module is read only for the annotation
    from service.settings import Settings


@dataclass(frozen=True)
class JobLaunch:
    """Everything an executor needs to start (or find again) one job."""

    job_id: str
    workdir: Path                  # the job's own directory: job.json, job.log and exit_code live here
    config: dict[str, Any]         # the resolved, validated RunConfig (RunConfig.model_dump(mode="json"))
    world_size: int
    env: dict[str, str] = field(default_factory=dict)  # allow-listed (service.runner.job_environment): no secrets
    resolved_plan: dict[str, Any] | None = None  # the config's plan as resolved at submission (ResolvedPlan.to_dict())

    @property
    def nnodes(self) -> int:
        return int(self.config.get("launch", {}).get("nnodes", 1))


@dataclass(frozen=True)
class JobStatus:
    """What an executor knows of a job now."""

    alive: bool
    exit_code: int | None = None   # when it ended: the trainer's exit code, if it left one
    reason: str | None = None      # when it ended abnormally: why, naming the node / rank / pod


class Executor(ABC):
    """Start, watch and stop jobs somewhere. Every method is called from the scheduler's thread."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def from_settings(cls, settings: Settings) -> Executor:
        """The executor the service's settings describe (each reads the settings it needs)."""

    @abstractmethod
    def start(self, launch: JobLaunch) -> str:
        """Start the job; return its ``ref`` (stored in the job row, opaque to everyone else)."""

    @abstractmethod
    def poll(self, ref: str, launch: JobLaunch) -> JobStatus:
        """Whether the job still runs; when it has ended, its exit code (and why)."""

    @abstractmethod
    def stop(self, ref: str, *, force: bool = False) -> None:
        """Ask the job to stop (SIGTERM to every process of every node); ``force``: kill it now."""

    def adopt(self, launch: JobLaunch) -> str | None:
        """The ref of a job started just before the control plane died, before its ref was
        recorded; None if it is not running."""
        return None
