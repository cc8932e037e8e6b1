"""Documents from your files: jsonl, json, parquet or plain text, tokenized once, packed into one stream.

    python -m trainer data=files 'data.paths=[/data/corpus/*.jsonl]' data.text_field=text data.tokenizer=/data/llama-tiny

The files are read by Hugging Face ``datasets`` (Arrow, memory-mapped; a plain text file is one
document), every document is tokenized (batched, in ``data.num_proc`` processes) and followed
by the end-of-document token, and the ids are written once to a token file
(``tokens-<key>.bin``, uint16 or uint32) in ``data.cache_dir``. Every rank of a host then
memory-maps that same file, so the corpus is never read whole into a process; the first rank
to get there builds it under a file lock while the others wait. The key hashes the files (path,
size, mtime), the tokenizer, the EOS id and the text field, so a changed corpus is tokenized
again and an unchanged one never is.

The stream is cut into ``seq_len + 1`` windows exactly like the built-in text
(:class:`~trainer.data.base.TokenWindows`): documents are packed back to back with their EOS
separators, every token is a target once per epoch (the tail shorter than a window excepted),
and the loader's seeded, resumable order applies unchanged.
"""  # noqa: E501 (the command, whole: a reader copies it)

from __future__ import annotations

import fcntl
import glob as globlib
import hashlib
import json
import os
from pathlib import Path

import numpy as np
from torch import Tensor

from parallel.errors import ConfigError, ConfigIssue
from trainer.config.schema import FilesDataConfig
from trainer.data.base import TokenWindows, document_positions
from trainer.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

Tokenizer = ByteTokenizer | HFTokenizer
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # any other suffix: plain text


def expand_paths(paths: list[str], key: str = "data.paths") -> list[Path]:
    """Every file the paths and globs name, sorted, each once.

    Raises:
        ConfigError: every pattern (``data.paths[i]``) that matches no file, or an empty list.
    """
    if not paths:
        raise ConfigError([ConfigIssue(key, "names no files", "give files or globs, e.g. "
                                                              f"{key}=[/data/corpus/*.jsonl]")])
    found: set[Path] = set()
    issues = []
    for index, pattern in enumerate(paths):
        matched = [Path(p) for p in globlib.glob(os.path.expanduser(pattern), recursive=True) if Path(p).is_file()]
        if not matched:
            issues.append(ConfigIssue(f"{key}[{index}]", f"{pattern!r} matches no file",
                                      "give an existing file, or a glob that selects some (`**` recurses)"))
        found.update(p.resolve() for p in matched)
    if issues:
        raise ConfigError(issues)
    return sorted(found)


def file_format(files: list[Path], key: str = "data.paths") -> str:
    """The ``datasets`` builder for the files: json, parquet or text (one per run)."""
    kinds = {FORMATS.get(p.suffix.lower(), "text") for p in files}
    if len(kinds) > 1:
        raise ConfigError([ConfigIssue(key, f"mixes formats {sorted(kinds)}", "give files of one format")])
    return kinds.pop()


def corpus_key(files: list[Path], tokenizer: Tokenizer, text_field: str) -> str:
    """What the token file depends on, hashed: the files' identity, the tokenizer, EOS and field."""
    stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    blob = json.dumps([stats, tokenizer.identity(), tokenizer.eos_id, text_field])
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def build_token_file(files: list[Path], tokenizer: Tokenizer, *, text_field: str, cache_dir: Path,
                     num_proc: int = 1) -> Path:
    """The token file of ``files``: built once (under a lock; written under a temporary name and
    renamed, so a killed build leaves nothing that looks finished), then reused."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / f"tokens-{corpus_key(files, tokenizer, text_field)}.bin"
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per host; the others wait here, then reuse
        if not target.exists():
            _write_tokens(files, tokenizer, text_field=text_field, cache_dir=cache_dir, target=target,
                          num_proc=num_proc)
    return target


def _write_tokens(files: list[Path], tokenizer: Tokenizer, *, text_field: str, cache_dir: Path, target: Path,
                  num_proc: int) -> None:
    import datasets

    fmt = file_format(files)
    extra = {"sample_by": "document"} if fmt == "text" else {}  # a plain text file is one document
    datasets.disable_progress_bars()
    dataset = datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train",
                                    cache_dir=str(cache_dir / "datasets"), **extra)
    if text_field not in dataset.column_names:
        raise ConfigError([ConfigIssue("data.text_field", f"{text_field!r} is not a field of the records in "
                                       f"{str(files[0].parent)!r}; they have {dataset.column_names}",
                                       "set data.text_field to the field holding the text")])
    ids = dataset.map(lambda batch: {"ids": tokenizer.encode_documents(batch[text_field])}, batched=True,
                      remove_columns=dataset.column_names, num_proc=num_proc if num_proc > 1 else None)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    partial = target.with_suffix(f".tmp-{os.getpid()}")
    count = 0
    with open(partial, "wb") as out:
        for batch in ids.iter(batch_size=1024):
            for document in batch["ids"]:
                out.write(np.asarray(document, dtype=dtype).tobytes())
                count += len(document)
    meta = {"dtype": np.dtype(dtype).name, "tokens": count, "documents": len(ids), "files": [str(f) for f in files]}
    target.with_suffix(".json").write_text(json.dumps(meta))
    os.replace(partial, target)


class FilesSource(TokenWindows):
    """Next-token windows over the memory-mapped token file of ``paths``.

    Args:
        cfg: the ``data`` section (``kind: files``).
        seq_len: tokens per sample (``train.seq_len``).
        paths: the file list to use instead of ``cfg.paths`` (``cfg.val_paths`` for validation).
        key: the config path the file list is reported at.
        tokenizer: ``cfg.tokenizer`` already loaded (the validation split reuses the training one's).
    """

    def __init__(self, cfg: FilesDataConfig, seq_len: int, *, paths: list[str] | None = None,
                 key: str = "data.paths", tokenizer: Tokenizer | None = None) -> None:
        self.cfg = cfg
        self.files = expand_paths(cfg.paths if paths is None else paths, key)
        self.tokenizer = tokenizer or load_tokenizer(cfg.tokenizer, cfg.eos_token)
        path = build_token_file(self.files, self.tokenizer, text_field=cfg.text_field,
                                cache_dir=Path(cfg.cache_dir).expanduser(), num_proc=cfg.num_proc)
        meta = json.loads(path.with_suffix(".json").read_text())
        self.num_documents = meta["documents"]
        tokens = np.memmap(path, dtype=meta["dtype"], mode="r") if meta["tokens"] else np.zeros(0, np.uint16)
        super().__init__(tokens, seq_len, what=f"the {len(self.files)} file(s) of {key}")

    def __getitem__(self, index: int) -> tuple[Tensor, ...]:
        inputs, targets = super().__getitem__(index)
        if not self.cfg.packing:
            return inputs, targets
        return inputs, targets, document_positions(inputs, self.tokenizer.eos_id)  # documents kept apart

    def notes(self) -> list[str]:
        packed = ", documents kept apart (data.packing)" if self.cfg.packing else ""
        return [f"data: {len(self.files)} file(s), {self.num_documents} documents, {len(self.tokens)} tokens "
                f"({type(self.tokenizer).__name__}, vocab {self.tokenizer.vocab_size}), {len(self)} windows{packed}"]
