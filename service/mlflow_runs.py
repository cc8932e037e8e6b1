"""The service's side of MLflow: pre-create a job's run, end it if the job could not, read metrics.

The trainer owns a run while it runs (``tracking.run_id=<id>`` makes it log into the run made
here); the service creates the run before the job is queued, so the job record carries its run
id and UI link from the start, and ends it KILLED / FAILED when the process died without doing so.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from parallel.errors import ConfigError, ConfigIssue
from trainer.tracking.mlflow_tracker import experiment_artifacts, get_or_create_experiment
from trainer.tracking.run_info import run_url, ui_base, ui_command
from trainer.tracking.tracker import TrackingError

log = logging.getLogger(__name__)


class TrackingUnavailable(RuntimeError):
    """The MLflow store could not be reached or refused the request."""


class MlflowRuns:
    """Thin, thread-safe wrapper over one ``MlflowClient``."""

    def __init__(self, tracking_uri: str, ui_url: str | None = None, *, sqlite_wal: bool = False,
                 artifact_root: Path | None = None) -> None:
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        # A database store puts a new experiment's artifacts in ./mlruns of whichever process creates
        # it: the server's working directory, outside the workspace. An MLflow server decides itself.
        self.artifact_root = artifact_root if is_local_store(tracking_uri) else None
        self.sqlite_wal = sqlite_wal
        self.ui_url = ui_url.rstrip("/") if ui_url else None
        self._client = MlflowClient(tracking_uri=tracking_uri)
        # SQLite stores take one writer at a time; serialising our own writes avoids lock storms.
        self._lock = threading.Lock()
        # experiment name -> id, looked up (and tagged) once: each look-up is several queries per submit
        self._experiments: dict[str, str] = {}

    def warm_up(self) -> None:
        """Create the store's tables now (seconds on a new SQLite file) instead of in the first request;
        with ``sqlite_wal``, switch a SQLite store to write-ahead logging."""
        with self._lock:
            self._client.search_experiments(max_results=1)
            if self.sqlite_wal:
                use_wal(self.tracking_uri)

    def create_run(self, experiment: str, run_name: str, tags: dict[str, str]) -> tuple[str, str]:
        """A new RUNNING run in ``experiment`` (created when missing): ``(experiment_id, run_id)``."""
        try:
            with self._lock:
                experiment_id = self._experiments.get(experiment)
                try:
                    run = self._client.create_run(experiment_id, run_name=run_name,
                                                  tags=tags) if experiment_id else None
                except Exception:  # deleted (or renamed) since it was looked up: look again
                    run = None
                if run is None:
                    experiment_id = get_or_create_experiment(self._client, experiment,
                                                             self.artifact_location(experiment))
                    run = self._client.create_run(experiment_id, run_name=run_name, tags=tags)
                    self._experiments[experiment] = experiment_id
        except TrackingError:
            raise ConfigError([self._deleted(experiment)]) from None
        except Exception as err:
            log.exception("could not create an MLflow run in %s", self.tracking_uri)
            raise TrackingUnavailable(f"the MLflow store did not accept a new run: {err}") from err
        assert experiment_id is not None, "the run was created in it"
        return experiment_id, run.info.run_id

    def _deleted(self, experiment: str) -> ConfigIssue:
        """A deleted experiment's refusal: restored through the MLflow server the jobs' links point at (a
        user of the service may not hold the store's own address, nor its credentials), or another name."""
        with self._lock:
            found = self._client.get_experiment_by_name(experiment)
        if found is None:  # removed for good since: the next submission makes it anew
            return ConfigIssue("tracking.experiment", f"MLflow experiment {experiment!r} was deleted", "submit again")
        ident, server = found.experiment_id, ui_base(self.tracking_uri, self.ui_url)
        restore = f"MLFLOW_TRACKING_URI={server} mlflow experiments restore --experiment-id {ident}"
        return ConfigIssue("tracking.experiment", f"MLflow experiment {experiment!r} (id {ident}) is deleted",
                           f"restore it through the MLflow server the job links point at (`{restore}`) "
                           "or choose another name")

    def artifact_location(self, experiment: str) -> str | None:
        """``<artifact root>/<experiment name, made a file name>`` as a file URI (null without a root)."""
        return None if self.artifact_root is None else experiment_artifacts(self.artifact_root, experiment)

    def run_status(self, run_id: str) -> str | None:
        try:
            with self._lock:
                return self._client.get_run(run_id).info.status
        except Exception:  # a missing run or an unreachable store: the caller decides
            log.exception("could not read MLflow run %s", run_id)
            return None

    def end_run_if_open(self, run_id: str, status: str) -> None:
        """Set ``status`` (KILLED / FAILED / FINISHED) unless the run already ended."""
        current = self.run_status(run_id)
        if current not in (None, "RUNNING", "SCHEDULED"):
            return
        try:
            with self._lock:
                self._client.set_terminated(run_id, status)
        except Exception:
            log.exception("could not end MLflow run %s as %s", run_id, status)

    def delete_run(self, run_id: str) -> None:
        try:
            with self._lock:
                self._client.delete_run(run_id)
        except Exception:
            log.exception("could not delete MLflow run %s", run_id)

    def metric_histories(self, run_id: str) -> tuple[str, dict[str, list[dict[str, Any]]]]:
        """``(run status, {metric: [{step, value, timestamp}, ...] sorted by step})``."""
        with self._lock:
            run = self._client.get_run(run_id)
            histories = {key: self._client.get_metric_history(run_id, key) for key in sorted(run.data.metrics)}
        out = {
            key: sorted(({"step": m.step, "value": m.value, "timestamp": m.timestamp} for m in history),
                        key=lambda point: (point["step"], point["timestamp"]))
            for key, history in histories.items()
        }
        return run.info.status, out

    def ui_link(self, experiment_id: str | None, run_id: str | None) -> str | None:
        """The run's page: on ``mlflow_ui_url``, else on the tracking server, else where :meth:`ui_command` serves
        it."""
        return run_url(self.tracking_uri, experiment_id, run_id, self.ui_url)

    def ui_command(self) -> str | None:
        """``mlflow ui --backend-store-uri <the jobs' store> --port <the links' port>``; None for a server."""
        return ui_command(self.tracking_uri, self.ui_url)


def ui_notice(tracking_uri: str, ui_url: str | None) -> str:
    """What ``python -m api`` says at start: where the jobs' run links point and, for a database store,
    the command that serves it there (the links work once it runs)."""
    base = ui_base(tracking_uri, ui_url)
    serve = ui_command(tracking_uri, ui_url)
    return f"MLflow: job run links point at {base}" + (f"; serve the jobs' store there with: {serve}" if serve else "")


def is_local_store(tracking_uri: str) -> bool:
    """Whether the service's process writes the store itself (a database or a directory), rather than
    asking an MLflow server (``http(s)://``, ``databricks``), which keeps artifacts where it is told."""
    scheme = tracking_uri.split(":", 1)[0].lower() if "://" in tracking_uri else "file"
    return scheme.split("+")[0] in ("sqlite", "postgresql", "mysql", "mssql", "file")


def use_wal(tracking_uri: str) -> bool:
    """Put a SQLite MLflow store into WAL mode (it stays so: the mode is kept in the file); other URIs
    are left alone. Returns whether the store is in WAL mode now.

    MLflow opens SQLite in its default rollback-journal mode: every commit syncs the journal and
    the database (~18 ms here, 4 ms in WAL), and a writer blocks the readers. A job's run is created
    at submit, so that time was paid by every submission, one after another. WAL needs every process
    that opens the file on one host (a shared-memory index), which holds for local jobs only: the
    control plane asks for it with the local executor.
    """
    import sqlite3

    from sqlalchemy.engine import make_url

    if not tracking_uri.startswith("sqlite:///"):
        return False
    path = make_url(tracking_uri).database
    if not path or path == ":memory:":
        return False
    with sqlite3.connect(path, timeout=30) as connection:
        mode = connection.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    connection.close()
    return str(mode).lower() == "wal"
