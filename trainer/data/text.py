"""Byte-level token windows from local text files (default: the Python standard library).

``data.root: stdlib`` exists offline wherever the project runs, so the default run needs no
download. The files selected by ``data.glob`` are read in sorted relative-path order,
joined by blank lines and cut at ``data.max_bytes``; the bytes are the tokens
(see :class:`trainer.data.tokenizer.ByteTokenizer`)::

    src = TextSource(TextDataConfig(), seq_len=128)
    inputs, targets = src[0]          # int64 [128] each; targets[:-1] == inputs[1:]
"""

from __future__ import annotations

import fnmatch
import os
import sysconfig
from functools import lru_cache
from pathlib import Path, PurePosixPath

import torch

from trainer.config.schema import TextDataConfig
from trainer.data.base import TokenWindows

STDLIB = "stdlib"
# Installed packages live inside the stdlib directory (lib/python3.X/site-packages); they are
# not the standard library, they change with the environment (so would the data), and
# walking them costs seconds. dist-packages is Debian's name for the same thing.
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
FILE_SEPARATOR = b"\n\n"


def resolve_root(root: str) -> Path:
    """The directory ``data.root`` names; raises ``FileNotFoundError`` naming ``data.root``."""
    path = Path(sysconfig.get_paths()["stdlib"]) if root == STDLIB else Path(root).expanduser()
    if not path.is_dir():
        reason = "does not exist" if not path.exists() else "is not a directory"
        raise FileNotFoundError(
            f"data.root: {str(path)!r} {reason} "
            f"(set data.root to a directory of text files, or `{STDLIB}` for the Python standard library)"
        )
    return path


def _match_parts(path: tuple[str, ...], pattern: tuple[str, ...]) -> bool:
    """Glob match of path segments, with ``**`` standing for zero or more directories."""

    @lru_cache(maxsize=None)
    def match(i: int, j: int) -> bool:
        if j == len(pattern):
            return i == len(path)
        if pattern[j] == "**":
            # Zero directories here, or consume one and stay on `**`. A trailing `**` would
            # select only directories in pathlib; here it selects every file below instead.
            return match(i, j + 1) or (i < len(path) and match(i + 1, j))
        return i < len(path) and fnmatch.fnmatchcase(path[i], pattern[j]) and match(i + 1, j + 1)

    return match(0, 0)


def find_files(root: Path, glob: str, *, outside: list[Path] | None = None) -> list[Path]:
    """Files under ``root`` matching ``glob``, skipping :data:`SKIPPED_DIRS`, sorted by relative path.

    Same matching as ``Path(root).glob(glob)`` for the usual patterns, but the walk prunes the
    skipped directories instead of descending into them: on a machine with torch installed,
    the stdlib's site-packages alone holds ~20k ``.py`` files (a 1.4 s detour).

    With ``outside`` (a list), a matching file that is a symbolic link resolving outside ``root``
    is not returned but appended there: the folder is the dataset, and a link must not carry a
    job to files beside it (the job store, another job's files). Directory links are never
    followed (``os.walk``'s default), so only file links can lead out.
    """
    pattern = PurePosixPath(glob)
    if pattern.is_absolute() or not glob.strip():
        raise ValueError(f"data.glob: {glob!r} must be a non-empty pattern relative to data.root, e.g. '**/*.py'")
    pattern_parts = tuple(p for p in pattern.parts if p != ".")
    found: list[tuple[str, Path]] = []
    real_root = os.path.realpath(root)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]
        rel_dir = Path(dirpath).relative_to(root)
        for name in filenames:
            rel = rel_dir / name
            if _match_parts(rel.parts, pattern_parts):
                path = Path(dirpath) / name
                if outside is not None and path.is_symlink() and not _inside(os.path.realpath(path), real_root):
                    outside.append(path)
                    continue
                found.append((rel.as_posix(), path))
    found.sort(key=lambda item: item[0])
    return [path for _, path in found]


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def read_concatenated(files: list[Path], max_bytes: int) -> bytes:
    """The files' bytes joined by blank lines, reading no further than ``max_bytes``."""
    chunks: list[bytes] = []
    total = 0
    for index, path in enumerate(files):
        if total >= max_bytes:
            break
        if index:
            chunks.append(FILE_SEPARATOR)
            total += len(FILE_SEPARATOR)
        with open(path, "rb") as handle:
            # Read only what can still be used: the first file may be larger than max_bytes.
            data = handle.read(max(0, max_bytes - total))
        chunks.append(data)
        total += len(data)
    return b"".join(chunks)[:max_bytes]


class TextSource(TokenWindows):
    """Byte tokens of the files ``cfg.glob`` selects under ``cfg.root``, as next-token windows.

    Args:
        cfg: the ``data`` section (``kind: text``).
        seq_len: tokens per sample (``train.seq_len``).

    Raises:
        FileNotFoundError: ``data.root`` is not a directory.
        ValueError: ``data.glob`` selects no files, or the text is shorter than one window.
    """

    def __init__(self, cfg: TextDataConfig, seq_len: int) -> None:
        self.cfg = cfg
        self.root = resolve_root(cfg.root)
        # A folder someone named keeps its files to itself; the standard library is the interpreter's
        # own (some distributions link a file of it to /etc) and nothing a user can place links in.
        self.skipped_links: list[Path] | None = None if cfg.root == STDLIB else []
        self.files = find_files(self.root, cfg.glob, outside=self.skipped_links)
        if not self.files:
            links = (f"; {len(self.skipped_links)} matching symbolic links lead outside it and are skipped"
                     if self.skipped_links else "")
            raise ValueError(
                f"data.glob: {cfg.glob!r} matches no files under data.root {str(self.root)!r} "
                f"(directories named {', '.join(sorted(SKIPPED_DIRS))} are skipped{links}); "
                "use a glob that selects text files, e.g. '**/*.py' or '**/*.txt'"
            )
        data = read_concatenated(self.files, cfg.max_bytes)
        # What the files hold in all, so the run can say when max_bytes cut the text short.
        self.available_bytes = sum(f.stat().st_size for f in self.files) + len(FILE_SEPARATOR) * (len(self.files) - 1)
        # bytearray: frombuffer needs a writable buffer to avoid a warning; clone detaches it.
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()
        super().__init__(tokens, seq_len, what=f"the text under data.root {str(self.root)!r}")

    @property
    def num_bytes(self) -> int:
        return len(self.tokens)  # one byte a token

    def notes(self) -> list[str]:
        """What a user should know about the data actually used (printed and tagged at start)."""
        notes = [f"data: skipped {len(self.skipped_links)} files under data.root that are symbolic links to "
                 f"places outside it (e.g. {str(self.skipped_links[0])!r})"] if self.skipped_links else []
        if self.available_bytes <= self.num_bytes:
            return notes
        return notes + [f"data: using the first {self.num_bytes / 1e6:.1f} MB of {self.available_bytes / 1e6:.1f} MB "
                        f"of text ({len(self.files)} files): data.max_bytes={self.cfg.max_bytes} cuts the rest; raise "
                        "it to use more"]
