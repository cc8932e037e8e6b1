"""Experiment tracking in MLflow on the main rank, behind the :class:`~trainer.tracking.tracker.Tracker`
protocol: :func:`make_tracker` hands non-main ranks (and ``tracking.backend=none``) a
:class:`~trainer.tracking.tracker.NullTracker`, which never imports MLflow. Keys and values are
made acceptable to MLflow here (its limits, its characters), so a config can always be logged.

    with install_signal_handlers():
        tracker = make_tracker(cfg.tracking, is_main=rank == 0)
        with run_lifecycle(tracker):
            tracker.log_params(cfg.model_dump(mode="json"))
            tracker.log_metrics({"loss": 2.3}, step=1)            # a series: a chart
            tracker.log_summary({"pipeline_bubble": 0.19})        # once per run: the overview's params
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import warnings
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.config.schema import TrackingConfig
from trainer.tracking.credentials import connect_uri
from trainer.tracking.tracker import NullTracker, RunStatus, Tracker, TrackingError, uninterrupted

log = logging.getLogger(__name__)


# MLflow 3's UI opens an experiment in the view its kind names; without the tag it guesses, and
# an experiment with no runs yet (or with traces) opens in the GenAI view.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"
ARTIFACTS_DIR = "mlartifacts"  # beside a SQLite store's file: its experiments' run artifacts

# MLflow's limits (mlflow.utils.validation), repeated so NullTracker users need not import mlflow.
MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
MAX_KEY_LENGTH = 250
MAX_PARAM_VALUE_LENGTH = 6000

# MLflow accepts alphanumerics, _ . - space : and /; "/" is replaced too, since MLflow rejects
# keys that are not normalised paths ("a//b", "a/../b") and a config key never needs one.
_BAD_KEY_CHARS = re.compile(r"[^\w.\- :]")


# --------------------------------------------------------------------------- params


def _mlflow_key(key: str) -> str:
    """A valid MLflow key: characters MLflow rejects (globs like ``layers.*.w[qkv]``) become ``_``."""
    clean = _BAD_KEY_CHARS.sub("_", key)
    return clean if len(clean) <= MAX_KEY_LENGTH else _disambiguate(key, clean)


def _disambiguate(key: str, clean: str) -> str:
    # A short digest of the original key keeps apart keys that clean or truncate to the same text.
    digest = hashlib.sha1(key.encode()).hexdigest()[:8]
    return f"{clean[: MAX_KEY_LENGTH - 9]}-{digest}"


def _mlflow_keys(keys: list[str]) -> dict[str, str]:
    """Valid, still distinct MLflow keys for ``keys``: valid keys keep their names, and a
    cleaned key that collides (``w[13]`` -> ``w_13_`` next to a real ``w_13_``) gets a digest."""
    clean = {key: _mlflow_key(key) for key in keys}
    kept = {key for key, value in clean.items() if key == value}
    counts = Counter(clean.values())
    return {
        key: _disambiguate(key, value) if key != value and (value in kept or counts[value] > 1) else value
        for key, value in clean.items()
    }


def readable_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Dotted params: ``{"train": {"seq_len": 128}}`` -> ``{"train.seq_len": "128"}``. A list, and a
    mapping with a key MLflow cannot take (the globs of ``parallel.placements``), is one JSON value
    (a mangled ``layers._.attn.w_qkv_.weight`` key helps nobody); None is ``null``."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value and not any(_BAD_KEY_CHARS.search(str(k)) for k in value):
            flat.update(readable_params(value, prefix=f"{name}."))
        elif isinstance(value, str):
            flat[name] = value
        else:
            flat[name] = json.dumps(value, default=str)
    return flat


def summary_value(value: float) -> str:
    """A once-per-run number as a param: an int as it is, a float to 4 decimals (``0.1883``, ``56.25``)."""
    return str(value) if isinstance(value, int) else str(round(float(value), 4))


# --------------------------------------------------------------------------- MLflow


def sqlite_file(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` store (None for any other store, or SQLite in memory)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    path = tracking_uri.removeprefix("sqlite:///").partition("?")[0]
    return Path(path) if path and path != ":memory:" else None


def experiment_artifacts(root: Path, experiment: str) -> str:
    """``<root>/<experiment name, made a file name>`` as a file URI. Names that differ only in odd
    characters share a directory; their runs (one directory per run id) do not collide."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", experiment).lstrip(".") or "_"
    return (root.absolute() / name).as_uri()


def get_or_create_experiment(client: Any, name: str, artifact_location: str | None = None) -> str:
    """The id of MLflow experiment ``name`` in ``client``'s store, created when missing (also when
    another process creates it at the same moment); :class:`TrackingError` if it is deleted.
    ``artifact_location``: where a new experiment's runs keep their artifacts; null: for a SQLite
    store, ``mlartifacts/<name>`` beside its file (MLflow's own default, ``./mlruns`` below whichever
    directory the first run started in, breaks every later run once that directory is gone); for a
    server, its own setting. The SQLite file's directory is made when missing (the first run's
    ``~/.meshflow``)."""
    from mlflow.exceptions import MlflowException

    database = sqlite_file(client.tracking_uri)
    if database is not None:
        database.parent.mkdir(parents=True, exist_ok=True)
        artifact_location = artifact_location or experiment_artifacts(database.parent / ARTIFACTS_DIR, name)
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location,
                                            tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING})
        except MlflowException:  # another process created it first
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
    if experiment.lifecycle_stage == "deleted":
        raise TrackingError(
            f"tracking.experiment: MLflow experiment {name!r} is deleted in {client.tracking_uri!r}; restore it "
            f"(`MLFLOW_TRACKING_URI={client.tracking_uri} mlflow experiments restore --experiment-id "
            f"{experiment.experiment_id}`) or choose another name"
        )
    if experiment.tags.get(EXPERIMENT_KIND_TAG) in (None, "", "no_inferred_type", "custom_model_development_inferred"):
        # made before the kind was set, or only guessed by the UI: say what it is. A kind someone
        # chose (e.g. genai_development) is theirs to keep.
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
    return experiment.experiment_id


class MLflowTracker:
    """One MLflow run, written through ``MlflowClient`` (no global fluent state).

    Creates a run named ``cfg.run_name`` in experiment ``cfg.experiment`` (created when
    missing), or attaches to an existing run (``run_id`` argument, else ``cfg.run_id``):
    that is how worker rank 0 logs into the run the launcher or control plane created.
    """

    @uninterrupted
    def __init__(self, cfg: TrackingConfig, *, run_id: str | None = None, run_name: str | None = None) -> None:
        from mlflow.exceptions import MlflowException  # lazy: `tracking=none` needs no MLflow
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=connect_uri(cfg.tracking_uri))  # credentials from the environment
        self._uri = cfg.tracking_uri
        self._finished = False
        self._last_step: dict[str, int] = {}  # a metric's last logged step in a run attached to (see log_metrics)
        self._attached = False  # a run created elsewhere, or earlier: it may have params already
        run_id = run_id or cfg.run_id
        if run_id is None:
            experiment_id = get_or_create_experiment(self._client, cfg.experiment)
            run = self._client.create_run(experiment_id, run_name=run_name or cfg.run_name)
            self._run_id, self.experiment_id = run.info.run_id, experiment_id
            return
        try:
            run = self._client.get_run(run_id)
        except MlflowException as exc:
            raise TrackingError(
                f"tracking.run_id: MLflow run {run_id!r} not found in {cfg.tracking_uri!r} ({exc.message}); "
                "use the id of an existing run in this store, or null to create a new run"
            ) from exc
        if run.info.status != "RUNNING":  # e.g. a restarted worker after a failed attempt
            self._client.update_run(run_id, status="RUNNING")
        self._run_id, self.experiment_id = run_id, run.info.experiment_id
        for key in run.data.metrics:  # what an earlier attempt logged: its steps are not logged twice
            self._last_step[key] = max(m.step for m in self._client.get_metric_history(run_id, key))
        self._attached = True

    @property
    def run_id(self) -> str:
        return self._run_id

    @uninterrupted
    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log a nested dict (the resolved config) as :func:`readable_params`, 100 per request.

        Values over MLflow's 6000 characters are cut in the param and logged whole as the
        text artifact ``params/<key>.txt``. In a run this tracker attached to, a param it has already
        keeps its value, with a warning when it differs (a resumed run continued in its run:
        ``train.checkpoint.resume`` is now ``auto``): MLflow refuses to change a param.
        """
        from mlflow.entities import Param

        flat = readable_params(params)
        keys = _mlflow_keys(list(flat))
        batch: list[Param] = []
        for raw_key, value in flat.items():
            key = keys[raw_key]
            if len(value) > MAX_PARAM_VALUE_LENGTH:
                artifact = f"params/{key}.txt"
                self._client.log_text(self._run_id, value, artifact)
                note = f"... [truncated; full value in artifact {artifact}]"
                value = value[: MAX_PARAM_VALUE_LENGTH - len(note)] + note
            batch.append(Param(key, value))
        if self._attached:
            existing = self._client.get_run(self._run_id).data.params
            if kept := sorted(p.key for p in batch if existing.get(p.key, p.value) != p.value):
                log.warning("kept the values MLflow has of %s (a param is written once)", ", ".join(kept))
            batch = [p for p in batch if p.key not in existing]
        for start in range(0, len(batch), MAX_PARAMS_PER_BATCH):
            self._client.log_batch(self._run_id, params=batch[start : start + MAX_PARAMS_PER_BATCH])

    @uninterrupted
    def log_metrics(self, metrics: Mapping[str, float], step: int, *, at_ms: int | None = None) -> None:
        """Log all metrics of one step in one request (one timestamp, so they line up). In a run attached
        to, a metric at or below the step an earlier attempt logged it last is left out: a restarted
        attempt replays the steps after its checkpoint, and MLflow would draw each of them twice. ``at_ms``: when
        they were measured (ms since the epoch; a relayed write is made later), else now."""
        from mlflow.entities import Metric

        now_ms = at_ms if at_ms is not None else int(time.time() * 1000)
        batch = [Metric(key, float(v), now_ms, step) for k, v in metrics.items()
                 if step > self._last_step.get(key := _mlflow_key(k), -1)]
        for start in range(0, len(batch), MAX_METRICS_PER_BATCH):
            self._client.log_batch(self._run_id, metrics=batch[start : start + MAX_METRICS_PER_BATCH])

    @uninterrupted
    def log_summary(self, values: Mapping[str, float]) -> None:
        """Numbers a run has once (the pipeline bubble, the predicted peak memory) as params, which the
        run's overview lists, rather than as metrics, which MLflow draws as one-point charts. A param
        keeps its first value: a restarted attempt that measures again keeps the first one's."""
        from mlflow.entities import Param

        given = {_mlflow_key(key): summary_value(value) for key, value in values.items()}
        existing = self._client.get_run(self._run_id).data.params
        if kept := sorted(key for key, value in given.items() if existing.get(key, value) != value):
            log.warning("kept the values MLflow has of %s (a param is written once)", ", ".join(kept))
        fresh = [Param(key, value) for key, value in given.items() if key not in existing]
        if fresh:
            self._client.log_batch(self._run_id, params=fresh)

    @uninterrupted
    def log_artifact_text(self, text: str, name: str) -> None:
        self._client.log_text(self._run_id, text, name)

    @uninterrupted
    def log_artifact(self, path: str | Path, artifact_dir: str | None = None) -> None:
        """Upload the file ``path`` into the run's artifacts, under ``artifact_dir`` if given."""
        self._client.log_artifact(self._run_id, str(path), artifact_dir)

    @uninterrupted
    def set_tag(self, key: str, value: Any) -> None:
        self._client.set_tag(self._run_id, _mlflow_key(key), str(value))

    @uninterrupted
    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set all ``tags`` in one request."""
        from mlflow.entities import RunTag

        self._client.log_batch(self._run_id, tags=[RunTag(_mlflow_key(k), str(v)) for k, v in tags.items()])

    @uninterrupted
    def log_dataset(self, name: str, source: str | None, digest: str, context: str = "training") -> None:
        """Record the run's data as an MLflow dataset input (the run page's "Datasets used"):
        ``source`` a local path or URL it was read from, None for data generated in code."""
        from mlflow.data.code_dataset_source import CodeDatasetSource
        from mlflow.data.dataset_source_registry import resolve_dataset_source
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.entities import DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        with warnings.catch_warnings():  # a local path matches two registered source kinds; either is right
            warnings.simplefilter("ignore", UserWarning)
            origin = resolve_dataset_source(source) if source else CodeDatasetSource(tags={"generator": name})
        # mlflow types MetaDataset's profile abstract; the class is concrete.
        dataset = MetaDataset(origin, name=name, digest=digest)._to_mlflow_entity()  # type: ignore[abstract]
        self._client.log_inputs(self._run_id, [DatasetInput(dataset, tags=[InputTag(MLFLOW_DATASET_CONTEXT, context)])])

    def finish(self, status: RunStatus) -> None:
        """End the run with ``status``; only the first call has an effect."""
        if self._finished:
            return
        self._finished = True
        self._client.set_terminated(self._run_id, status)

    def __repr__(self) -> str:
        return f"MLflowTracker(tracking_uri={self._uri!r}, run_id={self._run_id!r})"


def make_tracker(cfg: TrackingConfig, *, is_main: bool, run_id: str | None = None,
                 run_name: str | None = None) -> Tracker:
    """An :class:`MLflowTracker` on the main rank with ``backend=mlflow``, else a :class:`NullTracker`."""
    if cfg.backend == "none" or not is_main:
        return NullTracker()
    return MLflowTracker(cfg, run_id=run_id, run_name=run_name)


