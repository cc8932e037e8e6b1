"""What fails after the last step (the final model's export, the pictures, an MLflow upload) is not the
training: it is reported in one line, recorded on the run, and the run still ends as its training did,
unless the user asked for that artifact explicitly (``tracking.log_model=true``).

    after = AfterTraining(tracker, say=progress.log)
    with after.guard("the final model (MLflow model/)", required=cfg.tracking.log_model is True):
        log_final_model(...)
    after.errors      # ["the final model (MLflow model/): OSError: [Errno 28] No space left on device"]

The run's record: the tag :data:`ERRORS_TAG` (every failure, ``; ``-separated) and, in the launcher's
summary, a line each (:func:`error_lines`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from trainer.tracking.tracker import Tracker

ERRORS_TAG = "meshflow.end_of_run_errors"
_MAX_TAG = 5000  # MLflow's tag values hold up to 8000 characters


class AfterTraining:
    """The failures after the last step, each kept as ``what: Type: message`` (one line)."""

    def __init__(self, tracker: Tracker, *, say: Callable[[str], None], errors: list[str] | None = None) -> None:
        self.tracker, self.say = tracker, say
        self.errors: list[str] = list(errors or [])

    @contextmanager
    def guard(self, what: str, *, required: bool = False) -> Iterator[None]:
        """Run the block; an ``Exception`` in it is reported, recorded and swallowed, or raised again when
        ``required`` (the user asked for this artifact). A stop (SIGINT, SIGTERM) is never swallowed."""
        try:
            yield
        except Exception as err:
            if required:
                raise
            self.add(f"{what}: {one_line(err)}")

    def add(self, error: str) -> None:
        """Record one failure: the console line and the run's tag (a failing tracker only loses the tag)."""
        self.errors.append(error)
        self.say(f"after training: {error} (the training itself finished)")
        try:
            self.tracker.set_tag(ERRORS_TAG, "; ".join(self.errors)[:_MAX_TAG])
        except Exception:  # noqa: BLE001 - the store itself may be what failed; the line above says it
            pass


def one_line(err: BaseException) -> str:
    """``Type: message`` on one line, at most 300 characters."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}"[:300]


def error_lines(errors: list[str]) -> list[str]:
    """The summary's lines for the failures after the last step."""
    return [f"  not done after training: {error}" for error in errors]
