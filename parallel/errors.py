"""Config errors that name the config path, the reason and the fix.

The engine reports what it cannot build from a plan in the same form as the validator, so
they live here, at the bottom of the import order."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConfigIssue:
    """One thing wrong with a config.

    Example: ``ConfigIssue("train.seq_len", "must be >= 1, got 0", "set train.seq_len to a positive int")``
    renders as ``train.seq_len: must be >= 1, got 0 (set train.seq_len to a positive int)``.
    """

    path: str
    reason: str
    fix: str

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
