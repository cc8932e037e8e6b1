"""``PathText``: a config value that names a file or directory (a path, a glob, a built-in name).

One rule for every path field, in the schema rather than at each place that opens a file: a NUL
byte, which no file name can hold, is refused with the config path (it used to reach ``open`` and
end the CLI in a traceback, the control plane in an HTTP 500: ``ValueError: embedded null byte``).

    class CheckpointConfig(Section):
        dir: PathText = Field("checkpoints", description="...")
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator


NUL_REASON = "holds a NUL byte (\\x00), which no file name can hold"
NUL_FIX = "remove the NUL byte from the value"


def no_nul_byte(value: str) -> str:
    """``value``, unless it holds a NUL byte (ValueError naming the fix)."""
    if "\x00" in value:
        raise ValueError(NUL_REASON)
    return value


PathText = Annotated[str, AfterValidator(no_nul_byte)]
