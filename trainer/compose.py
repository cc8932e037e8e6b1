"""Compose a run config from ``conf/`` with Hydra overrides, outside ``@hydra.main``.

Hydra lives at the edge: the composed ``DictConfig`` becomes a plain dict here, and
nothing below sees a ``DictConfig``. The CLI and the control plane both use this.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def compose_dict(overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The resolved config for ``overrides`` (as typed after ``python -m trainer``), as a plain dict."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="meshflow"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return to_plain(cfg)


def to_plain(cfg: Any) -> dict[str, Any]:
    """A composed DictConfig as a plain dict without Hydra's own `hydra` node."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(cfg, resolve=True)
    raw.pop("hydra", None)
    return raw
