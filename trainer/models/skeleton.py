"""The model's skeleton on the meta device, built once per process and model config, and shared by all that
only reads its names and shapes: validation and the plan it resolves, the plan's numbers and memory, the
placement picture, the launcher's price of the plan.

    model = meta_model(cfg.model)     # the same object for the same config: read it; deepcopy it to change it

A worker's model is not this one: the engine splits and shards the model it is given, in place.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

from torch import nn

from trainer.models import ModelCfg, build_model

_KEEP = 8  # configs kept: a control plane validates a few models at once
_LOCK = threading.Lock()  # the control plane's pool validates in threads
_BUILT: OrderedDict[tuple[str, str], nn.Module] = OrderedDict()


def meta_model(cfg: ModelCfg) -> nn.Module:
    """``build_model(cfg, device="meta")``, built on the first call for this config and kept. Shared: a caller
    that changes the model (the meta pass gives parameters their local shapes) works on a deep copy."""
    key = _key(cfg)
    if key is None:
        return build_model(cfg, device="meta")
    with _LOCK:
        if (model := _BUILT.get(key)) is not None:
            _BUILT.move_to_end(key)
            return model
    model = build_model(cfg, device="meta")  # outside the lock: a large model takes a while, others need not wait
    with _LOCK:
        model = _BUILT.setdefault(key, model)
        while len(_BUILT) > _KEEP:
            _BUILT.popitem(last=False)
    return model


def _key(cfg: ModelCfg) -> tuple[str, str] | None:
    """The config, and for a Hugging Face directory its ``config.json`` (the shapes are what it says, and it
    may change between two jobs of a control plane); None when that file cannot be read (the build says why)."""
    files = ""
    if cfg.arch == "hf":
        try:
            if cfg.path is None:
                return None
            files = (Path(cfg.path) / "config.json").read_text()
        except (OSError, TypeError):
            return None
    return cfg.model_dump_json(), files


__all__ = ["meta_model"]
