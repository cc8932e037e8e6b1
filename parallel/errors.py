"""Config errors that name the config path, the reason and the fix.

The engine reports what it cannot build from a plan in the same form as the validator, so
they live here, at the bottom of the import order."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass


@dataclass(frozen=True)
class ConfigIssue:
    """One thing wrong with a config.

    Example: ``ConfigIssue("train.seq_len", "must be >= 1, got 0", "set train.seq_len to a positive int")``
    renders as ``train.seq_len: must be >= 1, got 0 (set train.seq_len to a positive int)``.
    """

    path: str
    reason: str
    fix: str  # prose; an override in it is written as :func:`override` prints it, runnable as printed

    def __str__(self) -> str:
        return f"{self.path}: {self.reason} ({self.fix})"

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path, "reason": self.reason, "fix": self.fix}


class ConfigError(ValueError):
    """A config that must not start a worker; carries every issue found."""

    def __init__(self, issues: list[ConfigIssue]):
        self.issues = list(issues)
        n = len(self.issues)
        head = f"invalid config: {n} problem{'s' if n != 1 else ''}"
        super().__init__("\n".join([head, *(f"  - {issue}" for issue in self.issues)]))


def format_path(*parts: object) -> str:
    """Join path parts the way a user writes them: ``parallel.placements["a.*.w"].tp``, ``mesh[1]``."""
    out = ""
    bracket_next = False
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif bracket_next or not str(part).isidentifier():
            out += f'["{part}"]'
        else:
            out += f".{part}" if out else str(part)
        bracket_next = part in ("placements", "layouts")
    return out


_PLAIN = re.compile(r"[\w.*?/+-]+")  # what Hydra's override grammar reads unquoted, in a key or a value


def override(key: str, value: object) -> str:
    """``key=value`` as a user types it after ``python -m trainer`` in a POSIX shell: Hydra's
    override grammar (a mapping's glob keys double-quoted, which the CLI accepts), single-quoted
    for the shell when it holds anything a shell would read. A fix quotes overrides this way so
    that it can be copied exactly as printed:

    >>> print(override("parallel.placements", {"layers.*.attn.w[qkv].weight": {"tp": "Replicate"}}))
    'parallel.placements={"layers.*.attn.w[qkv].weight": {tp: Replicate}}'
    >>> print(override("train.global_batch_size", 16))
    train.global_batch_size=16
    """
    return shlex.quote(f"{key}={_value(value)}")


def override_key(*parts: object) -> str:
    """A config path as an override's key, list indices as Hydra reads them: ``override_key("parallel",
    "pipeline", "stages", 1, "context_parallel")`` is ``parallel.pipeline.stages.1.context_parallel``."""
    return ".".join(str(p) for p in parts)


def _value(value: object) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k if str(k).isidentifier() else json.dumps(str(k))}: {_value(v)}"
                               for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_value(v) for v in value) + "]"
    return _text(str(value)) if isinstance(value, str) else str(value)


def _text(text: str) -> str:
    return text if _PLAIN.fullmatch(text) else json.dumps(text)
