"""The one error every checkpoint reader raises: it names the path, the reason and the fix."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unfinished, unreadable or unsafe; the message names the path.

    ``reason`` and ``fix`` are kept apart so the config validator can report them as a
    :class:`~parallel.errors.ConfigIssue`; ``str()`` joins them as ``reason (fix)``.
    """

    def __init__(self, reason: str, *, fix: str | None = None):
        self.reason, self.fix = reason, fix
        super().__init__(f"{reason} ({fix})" if fix else reason)
