"""Sweeps: ``python -m trainer --multirun optim.lr=1e-3,3e-3`` as one parent MLflow run with a child per job.

Hydra runs a sweep's jobs (its basic launcher: one after another in this process; a sweeper
plugin such as Optuna chooses the values). :class:`SweepParentRun`, a Hydra callback named in
``conf/config.yaml``, opens the parent run before the first job and closes it after the last;
each job's run names it as ``mlflow.parentRunId`` (MLflow's UI nests the children under it),
found in the ``MESHFLOW_SWEEP_PARENT_RUN`` environment variable this callback sets. The parent
holds the swept overrides as params, one row per job in ``sweep.json`` and the best final loss.

    python -m trainer --multirun optim.lr=1e-3,3e-3 train.steps=20
    python -m trainer --multirun hydra/sweeper=optuna hydra.sweeper.n_trials=8 "optim.lr=interval(1e-4,1e-2)"
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import time
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from trainer.config.tracking_schema import default_tracking_uri
from trainer.launch import launcher as launch
from trainer.tracking.credentials import connect_uri
from trainer.tracking.mlflow_tracker import get_or_create_experiment
from trainer.tracking.run_info import public_config, redact

PARENT_RUN_ENV = "MESHFLOW_SWEEP_PARENT_RUN"

log = logging.getLogger(__name__)


class SweepParentRun(Callback):
    """Hydra callback: the parent MLflow run of a multirun (nothing happens in a single run)."""

    def __init__(self) -> None:
        self._client: Any = None
        self._run_id: str | None = None
        self._jobs: list[dict[str, Any]] = []

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        tracking = config.get("tracking") or {}
        if tracking.get("backend", "mlflow") != "mlflow":
            return
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=connect_uri(tracking.get("tracking_uri") or default_tracking_uri()))
        experiment_id = get_or_create_experiment(self._client, tracking.get("experiment", "meshflow"))
        sweep = OmegaConf.to_container(config.hydra.overrides, resolve=False)
        choices = config.hydra.runtime.choices
        preset = next((choices[g] for g in ("examples", "parallel") if choices.get(g)), "single")
        name = tracking.get("run_name") or f"sweep-{preset}-{time.strftime('%Y%m%d-%H%M%S')}"
        run = self._client.create_run(experiment_id, run_name=name, tags={
            "meshflow.sweep": "parent", "sweeper": choices.get("hydra/sweeper") or "basic",
            "mlflow.source.name": "python -m trainer --multirun"})
        self._run_id = run.info.run_id
        os.environ[PARENT_RUN_ENV] = self._run_id
        atexit.register(self._close, "KILLED")  # a no-op once on_multirun_end closed it
        params = {"sweep.task_overrides": json.dumps(public_config({"o": sweep.get("task", [])})["o"])}
        sweeper_params = OmegaConf.to_container(config.hydra.sweeper, resolve=False).get("params") or {}
        params.update({f"sweep.params.{k}": redact(str(v)) for k, v in sweeper_params.items()})
        from mlflow.entities import Param

        self._client.log_batch(self._run_id, params=[Param(k, v[:6000]) for k, v in params.items()])
        print(f"sweep: parent MLflow run {self._run_id} ({name})", flush=True)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if self._run_id is None:
            return
        from hydra.core.utils import JobStatus

        # trainer.cli.main clears the outcome of a job that failed (it returns NaN so the sweep goes on)
        outcome = launch.LAST_OUTCOME if job_return.status == JobStatus.COMPLETED else None
        losses = (outcome or {}).get("losses") or [None]
        self._jobs.append({"job": len(self._jobs), "overrides": list(job_return.overrides or []),
                           "status": "COMPLETED" if outcome else "FAILED", "run_id": (outcome or {}).get("run_id"),
                           "final_loss": losses[-1]})

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self._run_id is None:
            return
        run_id = self._run_id
        from mlflow.entities import Metric

        finals = [job["final_loss"] for job in self._jobs if job.get("final_loss") is not None]
        self._client.log_text(run_id, json.dumps(self._jobs, indent=1), "sweep.json")
        if finals:
            self._client.log_batch(run_id, metrics=[Metric("best_final_loss", min(finals), 0, 0),
                                                          Metric("jobs", len(self._jobs), 0, 0)])
        self._close("FAILED" if any(job["status"] != "COMPLETED" for job in self._jobs) else "FINISHED")
        print(f"sweep: {len(self._jobs)} jobs, {sum(j['status'] == 'COMPLETED' for j in self._jobs)} completed"
              + (f", best final loss {min(finals):.4f}" if finals else ""), flush=True)

    def _close(self, status: str) -> None:
        """End the parent run once; also at exit, when the sweep was stopped (Ctrl-C) before its end."""
        if self._run_id is None:
            return
        run_id, self._run_id = self._run_id, None
        os.environ.pop(PARENT_RUN_ENV, None)
        try:
            self._client.set_terminated(run_id, status)
        except Exception:  # noqa: BLE001 - at exit the store may be gone; say so, don't crash
            log.warning("could not end the sweep's parent run %s", run_id, exc_info=True)
