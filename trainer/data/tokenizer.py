"""Tokenizers: UTF-8 bytes (the default, vocabulary 256) or a Hugging Face ``tokenizers`` file.

Both speak the same small interface, used by the files source (documents -> ids + EOS) and by
generation (prompt -> ids -> text)::

    tok = load_tokenizer(None)                        # ByteTokenizer: ids are UTF-8 bytes, EOS = NUL
    tok = load_tokenizer("/data/llama-tiny")          # HFTokenizer from the directory's tokenizer.json
    tok.decode(tok.encode("héllo"))                   # -> "héllo"
    tok.encode_documents(["a", "b"])                  # [[..ids of a.., eos], [..ids of b.., eos]]
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from parallel.errors import ConfigError, ConfigIssue

# Tried in order when neither data.eos_token nor tokenizer_config.json names the end of a document.
COMMON_EOS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>")


class ByteTokenizer:
    """UTF-8 bytes as tokens; ``vocab_size`` is 256 and NUL (never in text) ends a document."""

    vocab_size: int = 256
    eos_id: int = 0

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` as a list of ints in [0, 256)."""
        return list(text.encode("utf-8"))

    def encode_tensor(self, text: str) -> Tensor:
        """The UTF-8 bytes of ``text`` as a 1-D int64 tensor (the dtype embeddings take)."""
        return torch.tensor(self.encode(text), dtype=torch.int64)

    def encode_documents(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids followed by the end-of-document id."""
        return [[*text.encode("utf-8"), self.eos_id] for text in texts]

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

    def identity(self) -> str:
        """What the token ids depend on (part of the token cache's key)."""
        return "bytes"

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer read from ``file`` (a tokenizer.json), with its EOS id.

    Raises:
        ConfigError: at ``data.eos_token`` when no end-of-document token can be found.
    """

    def __init__(self, file: Path, eos_token: str | None = None) -> None:
        from tokenizers import Tokenizer

        self.file = file
        self._tok = Tokenizer.from_file(str(file))
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_id = self._find_eos(eos_token)

    def _find_eos(self, eos_token: str | None) -> int:
        if eos_token:
            candidates: list[str | None] = [eos_token]
        else:
            candidates = [_configured_eos(self.file.parent / "tokenizer_config.json"), *COMMON_EOS]
        for token in candidates:
            if token and (token_id := self._tok.token_to_id(token)) is not None:
                return token_id
        raise ConfigError([ConfigIssue("data.eos_token",
                                       f"the tokenizer {str(self.file)!r} has no end-of-document token among "
                                       f"{[c for c in candidates if c]}",
                                       "set data.eos_token to the token that ends a document")])

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_tensor(self, text: str) -> Tensor:
        return torch.tensor(self.encode(text), dtype=torch.int64)

    def encode_documents(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids followed by the end-of-document id (batched: the Rust side uses every core)."""
        return [[*encoding.ids, self.eos_id] for encoding in self._tok.encode_batch(list(texts),
                                                                                    add_special_tokens=False)]

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        if isinstance(ids, Tensor):
            ids = ids.reshape(-1).tolist()
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def identity(self) -> str:
        return hashlib.sha256(self.file.read_bytes()).hexdigest()

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.file)!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def _configured_eos(config: Path) -> str | None:
    """The eos_token a tokenizer_config.json beside the tokenizer names, if any."""
    try:
        eos = json.loads(config.read_text()).get("eos_token") if config.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos if isinstance(eos, str) else None


def tokenizer_file(path: str) -> Path:
    """The tokenizer.json ``path`` names (the file, or a directory holding it).

    Raises:
        ConfigError: at ``data.tokenizer`` when there is no such file.
    """
    file = Path(path).expanduser()
    file = file / "tokenizer.json" if file.is_dir() else file
    if not file.is_file():
        raise ConfigError([ConfigIssue("data.tokenizer", f"{str(file)!r} does not exist",
                                       "give a tokenizer.json file, or a model directory holding one "
                                       "(null = byte-level tokens)")])
    return file


def load_tokenizer(path: str | None, eos_token: str | None = None) -> ByteTokenizer | HFTokenizer:
    """The tokenizer ``data.tokenizer`` names; ``None`` is the byte-level one."""
    if path is None:
        return ByteTokenizer()
    file = tokenizer_file(path)
    try:
        return HFTokenizer(file, eos_token)
    except ConfigError:
        raise
    except Exception as err:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ConfigError([ConfigIssue("data.tokenizer", f"{str(file)!r} is not a tokenizers file: {err}",
                                       "give a tokenizer.json written by Hugging Face tokenizers")]) from None
