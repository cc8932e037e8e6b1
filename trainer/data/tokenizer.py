"""Byte-level tokenizer: token ids are the UTF-8 bytes of the text (vocabulary 256).

Nothing is downloaded or trained, every string is encodable, and the text source's byte
stream *is* already its token stream, so this class is only needed at the edges
(prompting, printing samples)::

    tok = ByteTokenizer()
    tok.decode(tok.encode("héllo"))  # -> "héllo"
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class ByteTokenizer:
    """UTF-8 bytes as tokens; ``vocab_size`` is 256."""

    vocab_size: int = 256

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` as a list of ints in [0, 256)."""
        return list(text.encode("utf-8"))

    def encode_tensor(self, text: str) -> Tensor:
        """The UTF-8 bytes of ``text`` as a 1-D int64 tensor (the dtype embeddings take)."""
        return torch.tensor(self.encode(text), dtype=torch.int64)

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        """Text from token ids; byte sequences that are not valid UTF-8 become U+FFFD.

        ``errors="replace"`` because a model's samples (or a window cut mid-character) need
        not be valid UTF-8, and printing them must not raise.
        """
        if isinstance(ids, Tensor):
            ids = ids.reshape(-1).tolist()
        bad = [i for i in ids if not 0 <= int(i) < self.vocab_size]
        if bad:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}); got {bad[:5]}")
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"
