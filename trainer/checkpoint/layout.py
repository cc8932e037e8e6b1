"""Where a run's checkpoints lie on disk, without importing torch: ``<dir>/step_<step:08d>``, finished
when it holds the ``COMPLETE`` marker (:mod:`trainer.checkpoint.dcp` writes them). The launcher reads
this before it starts a run (:mod:`trainer.launch.disk_checks`), so it stays light.

    finished_checkpoints("checkpoints")   # [(100, Path("checkpoints/step_00000100"))], oldest first
"""

from __future__ import annotations

import re
from pathlib import Path

COMPLETE_MARKER = "COMPLETE"
STEP_DIR = re.compile(r"^step_(\d{8,})$")
SHARED_DIR_EXAMPLE = "/mnt/shared/checkpoints"  # what a fix names for a directory every node of a run mounts


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def finished_checkpoints(ckpt_dir: str | Path) -> list[tuple[int, Path]]:
    """Finished checkpoints in ``ckpt_dir`` as (step, path), oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = []
    for child in ckpt_dir.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir() and (child / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The finished ``step_*`` directory with the highest step, or None."""
    found = finished_checkpoints(ckpt_dir)
    return found[-1][1] if found else None
