"""Sweeps: ``python -m trainer --multirun optim.lr=1e-3,3e-3`` as one parent MLflow run with a child per job.

Hydra runs a sweep's jobs (its basic launcher: one after another in this process; a sweeper
plugin such as Optuna chooses the values). :class:`SweepParentRun`, a Hydra callback named in
``conf/config.yaml``, opens the parent run before the first job and closes it after the last;
each job's run names it as ``mlflow.parentRunId`` (MLflow's UI nests the children under it),
found in the ``MESHFLOW_SWEEP_PARENT_RUN`` environment variable this callback sets. The parent
holds the swept overrides as params, one row per job in ``sweep.json`` and the best final loss.
On the console: each job's own overrides as it starts, and at the end a table of the jobs (final
loss, peak memory, MLflow run) and the winner. Hydra's files for the sweep (``multirun.yaml``,
Optuna's ``optimization_results.yaml``) go to ``hydra.sweep.dir``, ``multirun/<date>_<time>/``.

    python -m trainer --multirun optim.lr=1e-3,3e-3 train.steps=20
    python -m trainer --multirun hydra/sweeper=optuna hydra.sweeper.n_trials=8 "optim.lr=interval(1e-4,1e-2)"
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import time
from typing import Any, cast

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from trainer.config.tracking_schema import default_tracking_uri
from trainer.launch.outcome import LaunchOutcome
from trainer.tracking.credentials import connect_uri
from trainer.tracking.mlflow_tracker import get_or_create_experiment
from trainer.tracking.run_info import public_config, redact, run_url

PARENT_RUN_ENV = "MESHFLOW_SWEEP_PARENT_RUN"

log = logging.getLogger(__name__)


def fixed_keys(overrides: list[str]) -> set[str]:
    """The keys of a sweep's command-line overrides that every job has as written (``train.steps=2``),
    not swept (``optim.lr=1e-3,3e-3``, ``optim.lr=interval(1e-4,1e-2)``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return {o.key_or_group for o in OverridesParser.create().parse_overrides(overrides) if not o.is_sweep_override()}


def _plain(node: DictConfig) -> dict[str, Any]:
    """A node of Hydra's own config as a plain dict, unresolved (an override's ${...} stays as typed)."""
    return cast(dict[str, Any], OmegaConf.to_container(node, resolve=False))  # Hydra's nodes: names to values


def _key(override: str) -> str:
    """``optim.lr`` of ``optim.lr=0.001``, ``parallel`` of ``+parallel=dp``, as Hydra's ``key_or_group``."""
    return override.split("=", 1)[0].lstrip("+~")


class SweepParentRun(Callback):
    """Hydra callback: the console's account of a multirun (each job's overrides as it starts, a table
    of the jobs and the winner at the end) and its parent MLflow run; nothing happens in a single run."""

    def __init__(self) -> None:
        self._client: Any = None
        self._run_id: str | None = None
        self._experiment_id: str | None = None
        self._tracking_uri = ""
        self._ui_url: str | None = None
        self._jobs: list[dict[str, Any]] = []
        self._fixed: set[str] = set()
        self._maximize = False
        self._sweeper = "basic"
        self._sweeping = False  # Hydra calls the job callbacks in a single run too

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        choices = config.hydra.runtime.choices
        sweeper = choices.get("hydra/sweeper") or "basic"
        self._sweeping, self._jobs = True, []
        self._fixed = fixed_keys(list(config.hydra.overrides.task))
        self._maximize = "maximize" in str(config.hydra.sweeper.get("direction", "minimize"))
        self._sweeper = sweeper
        files = {"basic": " (multirun.yaml)", "optuna": " (optimization_results.yaml)"}.get(sweeper, "")
        print(f"sweep: {sweeper} sweeper; its files{files} go to {config.hydra.sweep.dir}", flush=True)
        tracking = config.get("tracking") or {}
        if tracking.get("backend", "mlflow") != "mlflow":
            return
        from mlflow.tracking import MlflowClient

        self._tracking_uri = tracking.get("tracking_uri") or default_tracking_uri()
        self._ui_url = tracking.get("ui_url")
        self._client = MlflowClient(tracking_uri=connect_uri(self._tracking_uri))
        self._experiment_id = get_or_create_experiment(self._client, tracking.get("experiment", "meshflow"))
        sweep = _plain(config.hydra.overrides)
        preset = next((choices[g] for g in ("examples", "parallel") if choices.get(g)), "single")
        name = tracking.get("run_name") or f"sweep-{preset}-{time.strftime('%Y%m%d-%H%M%S')}"
        run = self._client.create_run(self._experiment_id, run_name=name, tags={
            "meshflow.sweep": "parent", "sweeper": sweeper, "mlflow.source.name": "python -m trainer --multirun"})
        self._run_id = run.info.run_id
        os.environ[PARENT_RUN_ENV] = self._run_id
        atexit.register(self._close, "KILLED")  # a no-op once on_multirun_end closed it
        params = {"sweep.task_overrides": json.dumps(public_config({"o": sweep.get("task", [])})["o"])}
        sweeper_params = _plain(config.hydra.sweeper).get("params") or {}
        params.update({f"sweep.params.{k}": redact(str(v)) for k, v in sweeper_params.items()})
        from mlflow.entities import Param

        self._client.log_batch(self._run_id, params=[Param(k, v[:6000]) for k, v in params.items()])
        print(f"sweep: parent MLflow run {self._run_id} ({name})", flush=True)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not self._sweeping:
            return
        own = self._own(config.hydra.overrides.task)
        print(f"sweep: job {config.hydra.job.num} starts: {' '.join(own) or '(the command line only)'}", flush=True)

    def _own(self, overrides: Any) -> list[str]:
        """A job's overrides but those every job has (the command line's that were not swept)."""
        return [redact(str(o)) for o in overrides or [] if _key(str(o)) not in self._fixed]

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if not self._sweeping:
            return
        from hydra.core.utils import JobStatus

        # the job's own outcome, as trainer.cli.main returns it (a failed launch's too, so the sweep goes on)
        returned = job_return.return_value if job_return.status == JobStatus.COMPLETED else None
        launched = returned if isinstance(returned, LaunchOutcome) else None
        done = launched is not None and launched.ok
        self._jobs.append({"job": len(self._jobs), "overrides": list(job_return.overrides or []),
                           "swept": self._own(job_return.overrides), "status": "COMPLETED" if done else "FAILED",
                           "run_id": launched.run_id if launched else None,
                           "final_loss": launched.losses[-1] if launched and launched.ok and launched.losses else None,
                           "peak_memory_mb": launched.details.get("peak_memory_mb") if launched else None})

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        print(self.table(), flush=True)
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

    def winner(self) -> dict[str, Any] | None:
        """The job with the lowest final loss (what a job returns: Optuna's objective; the highest
        when the Optuna sweeper's direction is maximize), or None when no job finished."""
        done = [j for j in self._jobs if j["final_loss"] is not None and not math.isnan(j["final_loss"])]
        pick = max if self._maximize else min
        return pick(done, key=lambda j: j["final_loss"]) if done else None

    def table(self) -> str:
        """``sweep: 3 jobs, 3 completed``, a row per job and the winner."""
        jobs = self._jobs
        lines = [f"sweep: {len(jobs)} jobs, {sum(j['status'] == 'COMPLETED' for j in jobs)} completed",
                 f"  {'job':>3}  {'final loss':>10}  {'peak MiB':>8}  {'run':<32}  overrides"]
        for j in jobs:
            loss = f"{j['final_loss']:.4f}" if j["final_loss"] is not None else "failed"
            peak = f"{j['peak_memory_mb']:.0f}" if j.get("peak_memory_mb") is not None else "-"
            lines.append(f"  {j['job']:>3}  {loss:>10}  {peak:>8}  {j['run_id'] or '-':<32}  "
                         f"{' '.join(j['swept']) or '-'}")
        if best := self.winner():
            how = "highest" if self._maximize else "lowest"
            objective = " (Optuna's objective)" if self._sweeper == "optuna" else ""
            url = run_url(self._tracking_uri, self._experiment_id, best["run_id"],
                          self._ui_url) if best["run_id"] else None
            lines.append(f"sweep: best job {best['job']} ({' '.join(best['swept']) or 'the command line only'}): "
                         f"final loss {best['final_loss']:.4f}{objective}, the {how} of {len(jobs)}"
                         + (f"; run {url}" if url else ""))
        return "\n".join(lines)

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
