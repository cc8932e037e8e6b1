"""What every data source is, and the pieces the token sources share.

A *source* is an indexable dataset of fixed-size samples, fully determined by its config:
``len(source)`` samples per epoch and ``source[i] -> (inputs, targets)``. The loader
(:mod:`trainer.data.loader`) decides the order; sources never shuffle.
"""

from __future__ import annotations

import hashlib
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class Source(Protocol):
    """An indexable dataset of fixed-size ``(inputs, targets)`` pairs."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]: ...


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
        tokens: 1-D integer tensor (any integer dtype; uint8 keeps byte streams small).
        seq_len: tokens per sample.
        what: how to name the stream in the error raised when it is too short.
    """

    def __init__(self, tokens: Tensor, seq_len: int, *, what: str = "the token stream") -> None:
        if tokens.dim() != 1:
            raise ValueError(f"expected a 1-D token stream, got shape {tuple(tokens.shape)}")
        if seq_len < 1:
            raise ValueError(f"train.seq_len: must be >= 1, got {seq_len}")
        num_windows = (tokens.numel() - 1) // seq_len
        if num_windows < 1:
            raise ValueError(
                f"{what} has {tokens.numel()} tokens, fewer than train.seq_len + 1 = {seq_len + 1}; "
                "provide more data or lower train.seq_len"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self._num_windows = num_windows

    def __len__(self) -> int:
        return self._num_windows

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not 0 <= index < self._num_windows:
            raise IndexError(f"window {index} out of range [0, {self._num_windows})")
        start = index * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1].to(torch.int64)
        return window[:-1], window[1:]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tokens={self.tokens.numel()}, seq_len={self.seq_len}, windows={len(self)})"
