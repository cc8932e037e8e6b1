"""The launcher's MLflow run, made beside the workers' start rather than before it.

Making the run costs the launcher MLflow's import and its store's (about 2 CPU-seconds on a small
host) and a round trip; the workers need none of it to start, since rank 0 logs through the launcher
(:mod:`trainer.tracking.relay`). :class:`OpeningRun` makes the run in a thread and is the tracker
meanwhile: each call waits until the run exists, then is the made tracker's.

    tracker = OpeningRun(lambda: make_tracker(cfg.tracking, is_main=True))   # returns at once
    launch_workers(...)                # starts now; rank 0's first writes wait for the run
    tracker.run_id                     # the run's id (None if it could not be made: tracker.failure())

A run that cannot be made (an unreachable store, a deleted experiment) fails every call that needs it
with the error that making it raised; :meth:`OpeningRun.finish` then has nothing to end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from trainer.tracking.tracker import RunStatus, Tracker


class OpeningRun:
    """A :class:`~trainer.tracking.tracker.Tracker` whose run ``make`` makes in a thread of its own."""

    def __init__(self, make: Callable[[], Tracker]) -> None:
        self._made: Future[Tracker] = Future()
        # a daemon: a store that never answers must not keep the launcher from exiting
        threading.Thread(target=self._open, args=(make,), name="meshflow-mlflow-run", daemon=True).start()

    def _open(self, make: Callable[[], Tracker]) -> None:
        try:
            self._made.set_result(make())
        except BaseException as err:  # noqa: BLE001 - kept for the calls that wait on the run
            self._made.set_exception(err)

    def made(self) -> Tracker:
        """The tracker, once its run exists; raises what making it raised."""
        return self._made.result()

    def failure(self) -> BaseException | None:
        """What making the run raised (after waiting for it), or None."""
        return self._made.exception()

    @property
    def run_id(self) -> str | None:
        return None if self.failure() is not None else self.made().run_id

    @property
    def experiment_id(self) -> str | None:
        return None if self.failure() is not None else getattr(self.made(), "experiment_id", None)

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.made().log_params(params)

    def log_metrics(self, metrics: Mapping[str, float], step: int, *, at_ms: int | None = None) -> None:
        self.made().log_metrics(metrics, step, at_ms=at_ms)

    def log_summary(self, values: Mapping[str, float]) -> None:
        self.made().log_summary(values)

    def log_artifact_text(self, text: str, name: str) -> None:
        self.made().log_artifact_text(text, name)

    def log_artifact(self, path: str | Path, artifact_dir: str | None = None) -> None:
        self.made().log_artifact(path, artifact_dir)

    def set_tag(self, key: str, value: Any) -> None:
        self.made().set_tag(key, value)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self.made().set_tags(tags)

    def log_dataset(self, name: str, source: str | None, digest: str, context: str = "training") -> None:
        self.made().log_dataset(name, source, digest, context)

    def finish(self, status: RunStatus) -> None:
        """End the run with ``status``; nothing when it was never made."""
        if self.failure() is None:
            self.made().finish(status)

    def __repr__(self) -> str:
        return f"OpeningRun({self._made!r})"
