"""What the launcher itself puts on the console: the resolved config when a run starts, and each
warning of the workers once.

    show_config(cfg)                     # `config (differs from the defaults):` + one line per section
    with one_warning_each() as repeats:  # the workers' identical warnings, shown by the first rank only
        ...launch the workers...
"""

from __future__ import annotations

import re
import sys
import threading
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import yaml
from pydantic import BaseModel

from trainer.config.schema import RunConfig
from trainer.tracking.run_info import SWEEP_JOB_TAG, public_config

CONFIG_ARTIFACT = "config_changes.yaml"
# Set by the CLI on every run (the config group it came from; a sweep's job number): not choices the user made.
_NOT_CHANGES = (("tracking", "tags", "preset"), ("tracking", "tags", SWEEP_JOB_TAG))


def config_changes(cfg: RunConfig) -> dict[str, Any]:
    """The config's values that differ from the defaults (``python -m trainer`` with no overrides),
    by section, secrets masked as in MLflow (:func:`trainer.tracking.run_info.public_config`)."""
    changes = _diff(cfg, RunConfig())
    for path in _NOT_CHANGES:
        node: dict[str, Any] | None = changes
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(path[-1], None)
    return public_config(_drop_empty(changes))


def _diff(model: BaseModel, base: BaseModel | None) -> dict[str, Any]:
    """``model``'s fields that differ from ``base`` (an instance of the same class), or with ``base``
    None, from the class's defaults and keeping its tag (``arch``, ``kind``): a section the default
    config lacks or has of another kind, whose own sub-sections are shown whole (nulls left out)."""
    out: dict[str, Any] = {}
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        default = getattr(base, name) if base is not None else field.get_default(call_default_factory=True)
        if isinstance(value, BaseModel):
            if default is None:  # at the top a preset's section (parallel): else a sub-section of one, whole
                out[name] = _diff(value, None) if base is not None else value.model_dump(mode="json", exclude_none=True)
            elif type(default) is not type(value):
                out[name] = _diff(value, None)
            elif changed := _diff(value, default):
                out[name] = changed
        elif base is None and _is_tag(field.annotation):
            out[name] = value
        elif value != default:
            out[name] = _plain(value)
    return out


def _is_tag(annotation: Any) -> bool:
    return typing.get_origin(annotation) is Literal and len(typing.get_args(annotation)) == 1


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)  # e.g. a placement, Shard(1): written as the config writes it


def _drop_empty(node: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in node.items():
        value = _drop_empty(value) if isinstance(value, dict) else value
        if value != {}:
            out[key] = value
    return out


def config_text(changes: dict[str, Any]) -> str:
    """``config (differs from the defaults):`` and one flow-style YAML line per section."""
    if not changes:
        return "config: the defaults (python -m trainer --help lists them)"
    lines = ["config (differs from the defaults; --help lists them):"]
    for key, value in changes.items():
        text = yaml.safe_dump({key: value}, default_flow_style=True, sort_keys=False, width=10**6).strip()
        lines.append("  " + text[1:-1])  # without the outer braces: `train: {steps: 25}`
    return "\n".join(lines)


def show_config(cfg: RunConfig) -> None:
    """Print the config's changes (``train.print_config``); the run logs them either way
    (:func:`config_changes_artifact`)."""
    if cfg.train.print_config:
        print(config_text(config_changes(cfg)), flush=True)


def config_changes_artifact(cfg: RunConfig) -> dict[str, str]:
    """The config's changes as the run's ``config_changes.yaml`` (by name), whatever ``train.print_config`` says."""
    return {CONFIG_ARTIFACT: yaml.safe_dump(config_changes(cfg), sort_keys=False)}


# `<file>:<line>: <Category>Warning: <message>`, as Python's warnings module prints it
_WARNING = re.compile(r"^\S.*:\d+: \w*Warning: ")
_PREFIX = re.compile(r"^(\[[^\]]*\]: )?(.*)$", re.DOTALL)  # torch elastic's `[rank1]: ` on each tee'd line


class _OneWarningEach:
    """A text stream that passes lines on to ``stream`` but a warning (and the source line Python
    prints under it) that another line already showed, whatever rank's prefix it has."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._seen: set[str] = set()
        self._skipping: dict[str, bool] = {}  # by prefix: the last warning of that rank was a repeat
        self._lock = threading.Lock()
        self.repeats = 0

    def write(self, text: str) -> int:
        match = _PREFIX.match(text)
        assert match is not None, "the pattern matches any text"
        prefix, body = match.groups()
        prefix = prefix or ""
        with self._lock:
            if _WARNING.match(body):
                repeat = body in self._seen
                self._seen.add(body)
                self._skipping[prefix] = repeat
                self.repeats += repeat
            elif not (self._skipping.get(prefix) and body.startswith("  ")):
                self._skipping[prefix] = False
            if self._skipping.get(prefix):
                return len(text)
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextmanager
def one_warning_each() -> Iterator[_OneWarningEach]:
    """While the block runs, ``sys.stderr`` (where torch elastic's tee writes the workers' errors)
    shows each distinct warning once: the same warning from every rank (FSDP2's, for one) is not
    repeated; a line afterwards says how many were left out. Every rank's ``stderr.log`` keeps its own.
    Launches that overlap in threads each filter their own workers' lines (torch elastic's tee holds
    the stream it found) and the last one out puts the real stream back."""
    real = sys.stderr._stream if isinstance(sys.stderr, _OneWarningEach) else sys.stderr
    stream = _OneWarningEach(real)
    sys.stderr = stream
    try:
        yield stream
    finally:
        if sys.stderr is stream:
            sys.stderr = real
        if stream.repeats:
            print(f"({stream.repeats} repeat{'s' if stream.repeats > 1 else ''} of a warning shown above left out: "
                  "the same warning from other ranks; each rank's stderr.log has its own)", file=real, flush=True)
