"""What a launch ends with: its exit code and rank 0's summary, as a value (:class:`LaunchOutcome`).

Kept apart from the launcher so that the command line, a sweep's callback and the Slurm follower name
the exit codes without importing torch: ``python -m trainer`` starts the workers' fork server before
those imports (:mod:`trainer.cli.main`), and its imports then run beside the launcher's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_SIGINT, EXIT_SIGTERM = 0, 1, 2, 130, 143


@dataclass(frozen=True)
class LaunchOutcome:
    """What one launch ended with: :func:`trainer.launch.launcher.launch` returns it, and nothing of it is
    kept elsewhere, so launches in threads of one process (a sweep's, the control plane's) each read their own.

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
