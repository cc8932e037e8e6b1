"""The ``tracking`` section of the run configuration, beside :mod:`trainer.config.schema`, which
re-exports it, and where a run's MLflow store is when the config names none.

One default store per user, not per working directory: ``$MESHFLOW_HOME/mlflow.db`` (default
``~/.meshflow/mlflow.db``), its runs' artifacts beside it in ``mlartifacts/``, so every run a user
starts, from any directory, is in the store that one ``mlflow ui`` serves:

    mlflow ui --backend-store-uri sqlite:///$HOME/.meshflow/mlflow.db --port 5000

A store of one's own stays one override away: ``tracking.tracking_uri=sqlite:///mlflow.db``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field

from parallel.config import Section as _Section

HOME_ENV = "MESHFLOW_HOME"
STORE_FILE = "mlflow.db"
# Where `mlflow ui` serves when given no --port: the run links of a local store point there.
DEFAULT_UI_URL = "http://127.0.0.1:5000"


def meshflow_home() -> Path:
    """``$MESHFLOW_HOME``, else ``~/.meshflow``, as an absolute path (a relative one would make the store
    per-directory again); the working directory's ``.meshflow`` where no home directory is known."""
    if configured := os.environ.get(HOME_ENV):
        return Path(configured).expanduser().absolute()
    try:
        return Path.home() / ".meshflow"
    except RuntimeError:  # a container user without $HOME or a passwd entry
        return Path(".meshflow").absolute()


def default_tracking_uri() -> str:
    """``sqlite:///<meshflow home>/mlflow.db``: the one store of this user's runs."""
    return f"sqlite:///{meshflow_home() / STORE_FILE}"


class TrackingConfig(_Section):
    backend: Literal["mlflow", "none"] = Field("mlflow",
                                               description="`mlflow` logs one run per job; `none` logs nothing.")
    tracking_uri: str = Field(
        default_factory=default_tracking_uri, description="MLflow tracking URI (sqlite, file, or an http(s) server). "
        "Default: this user's store, `sqlite:///$MESHFLOW_HOME/mlflow.db` (`~/.meshflow/mlflow.db`), the same from "
        "every directory; `sqlite:///mlflow.db` keeps a store in the working directory.")
    ui_url: str | None = Field(
        None, description="Base URL of the MLflow UI that shows this store, for the run links the trainer prints. "
        "null: the server itself for an http(s) tracking_uri, else http://127.0.0.1:5000, where the printed "
        "`mlflow ui --backend-store-uri ... --port 5000` serves it.")
    experiment: str = Field("meshflow", min_length=1, description="MLflow experiment name.")
    run_name: str | None = Field(None, description="MLflow run name; null names it after the preset and the mesh "
                                 "(`3d-2x2x2`).")
    tags: dict[str, str] = Field(
        default_factory=dict, description="Extra MLflow run tags (`+tracking.tags.team=nlp`); the CLI and the "
        "control plane set `preset` to the config group the run came from. The `meshflow.` and `mlflow.` namespaces "
        "are reserved: refused over REST, and on the CLI never replacing the trainer's own (`mlflow.user`).")
    run_id: str | None = Field(
        None, description="Log into this existing MLflow run instead of creating one (set by the control plane)."
    )
    pictures: bool = Field(
        True, description="Draw the pipeline timeline (Chrome trace + PNG) and the placement picture, log them as "
        "MLflow artifacts under `pictures/` and print their paths; false skips both.")
    # Every step adds an event per micro-batch, stage and pass to the trace and the picture, kept in memory
    # until the end: 1000 steps is 500x the default, far more than a picture can show.
    timeline_steps: int = Field(
        2, ge=1, le=1000, description="Optimizer steps the measured pipeline timeline records (the run's last ones, "
        "so start-up is not in the picture); at most 1000.")
    system_metrics: bool = Field(
        True, description="Record MLflow's system metrics (CPU, memory, disk, network; GPU with pynvml) on the "
        "main rank every `system_metrics_interval` seconds.")
    # A sample reads CPU, memory, disk, network and GPU counters and logs them: faster than once a second
    # spends the main rank's CPU and floods the store; slower than an hour records next to nothing.
    system_metrics_interval: float = Field(10.0, ge=1, le=3600, description="Seconds between system-metric "
                                           "samples; from 1 to 3600.")
    log_model: bool | None = Field(
        None, description="The final weights as MLflow artifacts, gathered from every rank over the process group at "
        "the end of the run (no checkpoint is read, so nodes need not share a disk): `model/model.safetensors` (python "
        "-m trainer.export's file; train.init_from starts a run from it) and, for a model with a Hugging Face layout, "
        "`model/hf/` (a directory transformers loads). null: logged, and a failure is reported and recorded on the run "
        "(tag `meshflow.end_of_run_errors`) while the run still ends as its training did; true: required, a failure "
        "fails the run (exit 1); false: not logged.")
