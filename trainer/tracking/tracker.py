"""The tracker protocol the training loop calls unconditionally, the null object non-main ranks get
(it never imports MLflow), and a run's lifecycle: :func:`run_lifecycle` and
:func:`install_signal_handlers` guarantee that a run ends FINISHED, FAILED or KILLED, never stuck
RUNNING, even when the job is stopped with SIGTERM (:func:`uninterrupted` defers it past a write).

    with install_signal_handlers():
        tracker = make_tracker(cfg.tracking, is_main=rank == 0)   # trainer.tracking.mlflow_tracker
        with run_lifecycle(tracker):
            tracker.log_metrics({"loss": 2.3}, step=1)
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, Protocol

log = logging.getLogger(__name__)

RunStatus = Literal["FINISHED", "FAILED", "KILLED"]


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM; a BaseException so ``except Exception`` can't swallow it."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(f"terminated by signal {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """The shell convention for death by signal: 128 + signal number (143 for SIGTERM)."""
        return 128 + self.signum


class TrackingError(RuntimeError):
    """The tracking configuration cannot be used (unknown run id, deleted experiment)."""


class Tracker(Protocol):
    """What the training loop may log. Implementations: :class:`MLflowTracker`, :class:`NullTracker`."""

    @property
    def run_id(self) -> str | None: ...

    def log_params(self, params: Mapping[str, Any]) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int, *, at_ms: int | None = None) -> None: ...

    def log_summary(self, values: Mapping[str, float]) -> None: ...

    def log_artifact_text(self, text: str, name: str) -> None: ...

    def log_artifact(self, path: str | Path, artifact_dir: str | None = None) -> None: ...

    def set_tag(self, key: str, value: Any) -> None: ...

    def set_tags(self, tags: Mapping[str, Any]) -> None: ...

    def log_dataset(self, name: str, source: str | None, digest: str, context: str = "training") -> None: ...

    def finish(self, status: RunStatus) -> None: ...


class NullTracker:
    """Logs nothing; used on non-main ranks and with ``tracking.backend=none``."""

    run_id: str | None = None
    experiment_id: str | None = None

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int, *, at_ms: int | None = None) -> None:
        pass

    def log_summary(self, values: Mapping[str, float]) -> None:
        pass

    def log_artifact_text(self, text: str, name: str) -> None:
        pass

    def log_artifact(self, path: str | Path, artifact_dir: str | None = None) -> None:
        pass

    def set_tag(self, key: str, value: Any) -> None:
        pass

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        pass

    def log_dataset(self, name: str, source: str | None, digest: str, context: str = "training") -> None:
        pass

    def finish(self, status: RunStatus) -> None:
        pass

    def __repr__(self) -> str:
        return "NullTracker()"


class _SignalState(threading.local):
    depth = 0                # how many uninterrupted MLflow writes the main thread is inside
    pending: int | None = None


_SIGNALS = _SignalState()


def uninterrupted(method):
    """Run an MLflow write whole: a SIGTERM that arrives meanwhile is raised when it returns.

    :class:`Terminated` is raised wherever the main thread happens to be; raised inside a write to
    the store (SQLAlchemy holding a pooled connection, SQLite a write lock) it can leave that held,
    and the KILLED update that follows, or the system-metrics thread's next write, then waits on
    it for good."""
    @functools.wraps(method)
    def whole(*args, **kwargs):
        _SIGNALS.depth += 1
        try:
            return method(*args, **kwargs)
        finally:
            _SIGNALS.depth -= 1
            if _SIGNALS.depth == 0 and _SIGNALS.pending is not None:
                signum, _SIGNALS.pending = _SIGNALS.pending, None
                raise Terminated(signum)
    return whole


def _finish_quietly(tracker: Tracker, status: RunStatus) -> None:
    # While an error propagates, a failure to reach the tracking store must not replace it.
    try:
        tracker.finish(status)
    except Exception:
        log.exception("could not mark tracking run %s as %s", tracker.run_id, status)


@contextmanager
def run_lifecycle(tracker: Tracker) -> Iterator[Tracker]:
    """End the run FINISHED on normal exit (or ``sys.exit(0)``), KILLED on Ctrl-C or
    :class:`Terminated`, FAILED on any other exception; exceptions are re-raised."""
    try:
        yield tracker
    except (KeyboardInterrupt, Terminated):
        _finish_quietly(tracker, "KILLED")
        raise
    except SystemExit as exc:
        _finish_quietly(tracker, "FINISHED" if exc.code in (0, None) else "FAILED")
        raise
    except BaseException:
        _finish_quietly(tracker, "FAILED")
        raise
    tracker.finish("FINISHED")


@contextmanager
def install_signal_handlers() -> Iterator[None]:
    """Make SIGTERM raise :class:`Terminated` in the main thread; restore the old handler on exit.

    Only the first SIGTERM raises: later ones (a launcher repeating itself while the run is
    being closed) are ignored so they cannot interrupt the cleanup. Outside the main thread
    Python cannot install handlers, so this does nothing there.
    """
    if threading.current_thread() is not threading.main_thread():
        log.warning("install_signal_handlers: not the main thread; SIGTERM keeps its current handler")
        yield
        return
    raised = False

    def on_sigterm(signum: int, frame: Any) -> None:
        nonlocal raised
        if raised:
            log.warning("signal %d again while shutting down; ignored", signum)
            return
        raised = True
        if _SIGNALS.depth:  # inside an MLflow write: raised when it is done
            _SIGNALS.pending = signum
            return
        raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
