"""Meshflow trainer: compose -> validate -> launch workers -> train. Run: ``python -m trainer``.

Engines that run the trainer themselves call ``trainer.train(config)`` (:mod:`trainer.launch.entry`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["train", "TrainingFailed"]


def __getattr__(name: str) -> Any:
    # Imported on first use: `python -m trainer` and the workers should not pay for it.
    if name in __all__:
        from trainer.launch import entry as api
        return getattr(api, name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
