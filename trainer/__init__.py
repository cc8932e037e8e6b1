"""Meshflow trainer: compose -> validate -> launch workers -> train. Run: ``python -m trainer``.

Engines that run the trainer themselves call ``trainer.train(config)`` (:mod:`trainer.launch.entry`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["train", "TrainingFailed"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        # start-up: imported on first use; `python -m trainer` and the workers do not pay for the launcher
        from trainer.launch import entry

        return getattr(entry, name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
