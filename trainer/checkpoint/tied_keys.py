"""A tied parameter (input and output embeddings) is stored once, under its first name.

One device and tensor parallelism hold a tie as one parameter under several names; a pipeline
holds one copy per stage (:mod:`parallel.pipeline.ties`). Either way a checkpoint keeps only the
first name's entries (the model's tensor and, flattened, the optimizer's ``state.<fqn>.*`` and
``param_groups.<fqn>.*``), so checkpoints of every layout have the same keys, and on load every
copy reads the first name's:

    to_save = without_aliases(state, aliases)            # aliases: {"lm_head.weight": "model.embed_tokens.weight"}
    to_load, links = load_view(state, aliases)           # dcp.load(to_load, ...)
    restore_aliases(state, to_load, links)               # state[alias key] = the value loaded for its first name
"""

from __future__ import annotations

from typing import Any

_PREFIXES = ("", "state.", "param_groups.")  # a model key, and a flattened optimizer's


def first_key(key: str, aliases: dict[str, str]) -> str | None:
    """``key`` under its tie's first name when it belongs to an alias, else ``None``."""
    for alias, first in aliases.items():
        for prefix in _PREFIXES:
            head = prefix + alias
            if key == head or (prefix and key.startswith(head + ".")):
                return prefix + first + key[len(head):]
    return None


def without_aliases(state: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """``state`` without the entries of a tie's other names (the first name's are the same values)."""
    return {k: v for k, v in state.items() if first_key(k, aliases) is None}


def load_view(state: dict[str, Any], aliases: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """``(what to ask DCP for, {alias key: first-name key})``: an alias entry loads from its first
    name's key, into its own tensor when this rank lacks the first name (a pipeline's last stage)."""
    view: dict[str, Any] = {}
    links: dict[str, str] = {}
    for key, value in state.items():
        first = first_key(key, aliases)
        if first is None:
            view[key] = value
            continue
        links[key] = first
        if first not in state:
            view[first] = value
    return view, links


def restore_aliases(state: dict[str, Any], loaded: dict[str, Any], links: dict[str, str]) -> None:
    """Put the loaded first-name values back under the alias keys ``state`` expects."""
    for key, first in links.items():
        state[key] = loaded[first]
