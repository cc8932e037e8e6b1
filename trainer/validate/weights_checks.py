"""``train.init_from``: the file exists and is a safetensors file, read from its header alone.

A pickle (``torch.save``'s ``.pt``) or any other file named there used to pass validation and end
the run in its workers with a raw ``SafetensorError``; the header (a length and a JSON table of
tensor names, dtypes and shapes) says before launch whether the file is one, without loading a
tensor and without unpickling anything.

    issues = check_init_from(cfg.train.init_from)
"""

from __future__ import annotations

from pathlib import Path

from parallel.errors import ConfigIssue

FIX = "give a safetensors file written by python -m trainer.export (CHECKPOINT --out model.safetensors), " \
      "or train.init_from=null"


def check_init_from(path: str | None) -> list[ConfigIssue]:
    """Issues at ``train.init_from`` when ``path`` is not a readable safetensors file (none for null)."""
    if not path:
        return []
    if not Path(path).is_file():
        return [ConfigIssue("train.init_from", f"{path!r} is not a file", FIX)]
    from safetensors import safe_open  # the header only: names, dtypes, shapes

    try:
        with safe_open(path, framework="pt") as f:
            f.keys()
    except Exception as err:  # noqa: BLE001 - safetensors' own error type, an OSError, a header that is not JSON
        kind = "a pickle (torch.save)" if _is_pickle(path) else "not a safetensors file"
        return [ConfigIssue("train.init_from", f"{path!r} is {kind}: its header does not read ({err})", FIX)]
    return []


def _is_pickle(path: str) -> bool:
    """``torch.save``'s zip archive or a bare pickle (protocol 2+ starts with 0x80), for the message only."""
    with open(path, "rb") as f:
        head = f.read(4)
    return head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"
