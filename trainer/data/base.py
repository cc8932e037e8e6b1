"""What every data source is, and the pieces the token sources share.

A *source* is an indexable dataset of fixed-size samples, fully determined by its config:
``len(source)`` samples per epoch and ``source[i] -> (inputs, targets)``. The loader
(:mod:`trainer.data.loader`) decides the order; sources never shuffle.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor


@runtime_checkable
class Source(Protocol):
    """An indexable dataset of fixed-size ``(inputs, targets)`` pairs (and each input token's position
    in its document, where a source keeps packed documents apart)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> tuple[Tensor, ...]: ...


@runtime_checkable
class CountedSource(Source, Protocol):
    """A source whose rows mask some targets out of the loss (chat data): it says how many count."""

    def target_count(self, index: int) -> int: ...


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed derived from ``parts``, e.g. ``derive_seed(seed, "epoch", 3)``.

    Hashing (rather than ``seed + epoch``) keeps the streams of neighbouring seeds unrelated:
    with addition, (seed=0, epoch=1) and (seed=1, epoch=0) would share a permutation.
    """
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # manual_seed wants a non-negative int64


class TokenWindows:
    """Non-overlapping next-token windows over one flat token stream.

    Sample ``i`` is ``stream[i*seq_len : i*seq_len + seq_len + 1]`` split into
    ``inputs = window[:-1]`` and ``targets = window[1:]`` (both int64). Consecutive windows
    share one token, so every token in the stream is a target exactly once.

    Args:
        tokens: 1-D integer tensor (any integer dtype; uint8 keeps byte streams small), or a 1-D
            numpy array such as a read-only ``np.memmap`` (only the windows read are paged in).
        seq_len: tokens per sample.
        what: how to name the stream in the error raised when it is too short.
    """

    def __init__(self, tokens: Tensor | np.ndarray, seq_len: int, *, what: str = "the token stream") -> None:
        if tokens.ndim != 1:
            raise ValueError(f"expected a 1-D token stream, got shape {tuple(tokens.shape)}")
        if seq_len < 1:
            raise ValueError(f"train.seq_len: must be >= 1, got {seq_len}")
        num_windows = (len(tokens) - 1) // seq_len
        if num_windows < 1:
            raise ValueError(
                f"{what} has {len(tokens)} tokens, fewer than train.seq_len + 1 = {seq_len + 1}; "
                "provide more data or lower train.seq_len"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self._num_windows = num_windows

    def __len__(self) -> int:
        return self._num_windows

    def __getitem__(self, index: int) -> tuple[Tensor, ...]:
        if not 0 <= index < self._num_windows:
            raise IndexError(f"window {index} out of range [0, {self._num_windows})")
        start = index * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1]
        window = torch.from_numpy(window.astype(np.int64)) if isinstance(window, np.ndarray) else window.to(torch.int64)
        return window[:-1], window[1:]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tokens={len(self.tokens)}, seq_len={self.seq_len}, windows={len(self)})"


def document_positions(inputs: Tensor, eos_id: int) -> Tensor:
    """Each token's position in its document, counting from the row's start or the token after an
    end-of-document id: ``[5, 9, EOS, 7, 3] -> [0, 1, 2, 0, 1]``. A document cut by a row boundary
    starts again at 0 in the next row (positions stay below the row length)."""
    index = torch.arange(len(inputs))
    starts = torch.zeros(len(inputs), dtype=torch.bool)
    starts[0] = True
    starts[1:] = inputs[:-1] == eos_id
    first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=0).values
    return index - first


class WindowRange:
    """Samples ``start .. stop - 1`` of ``source``, renumbered from 0: a train or validation split.

    Splitting at a window boundary keeps the two halves apart: no target token is in both.
    """

    def __init__(self, source: Source, start: int, stop: int) -> None:
        if not 0 <= start < stop <= len(source):
            raise ValueError(f"window range [{start}, {stop}) is empty or outside [0, {len(source)})")
        self.source, self.start, self.stop = source, start, stop
        if isinstance(source, CountedSource):  # rows with masked targets (chat): their counts, renumbered too
            self.target_count: Callable[[int], int] = lambda index: source.target_count(start + index)

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int) -> tuple[Tensor, ...]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range [0, {len(self)})")
        return self.source[self.start + index]

    def __repr__(self) -> str:
        return f"WindowRange({self.source!r}, {self.start}, {self.stop})"


def split_tail(source: Source, fraction: float, *, path: str) -> tuple[Source, Source | None]:
    """``(train, validation)``: the last ``fraction`` of the windows held out (``None`` for 0).

    Raises:
        ValueError: naming ``path`` when either side would be empty.
    """
    if fraction <= 0:
        return source, None
    n_val = int(len(source) * fraction)
    if n_val < 1 or n_val >= len(source):
        raise ValueError(f"{path}: {fraction} of {len(source)} windows leaves an empty "
                         f"{'validation' if n_val < 1 else 'training'} split (use a fraction that keeps at least "
                         "one window on each side, or more data)")
    cut = len(source) - n_val
    return WindowRange(source, 0, cut), WindowRange(source, cut, len(source))
