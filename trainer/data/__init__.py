"""Training data: sources by name, and the resumable global-batch loader.

``build_source(cfg.data, seq_len=..., model_cfg=cfg.model)`` dispatches on ``data.kind``
through a name-keyed registry (no ``_target_``: data configs also arrive over REST);
``build_splits`` adds the validation split (``data.val_fraction`` or ``data.val_paths``)::

    from trainer.data import GlobalBatchLoader, build_splits
    splits = build_splits(cfg.data, seq_len=cfg.train.seq_len, model_cfg=cfg.model)  # .train, .val (or None)
    loader = GlobalBatchLoader(splits.train, global_batch_size=cfg.train.global_batch_size,
                               dp_rank=dp_rank, dp_size=cfg.dp_size, seed=cfg.train.seed)
    inputs, targets = loader.next_batch()
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from parallel.errors import ConfigError, ConfigIssue
from trainer.config.schema import (
    ChatDataConfig,
    CustomModelConfig,
    FilesDataConfig,
    HFModelConfig,
    LlamaConfig,
    MLPConfig,
    RegressionDataConfig,
    SyntheticDataConfig,
    TextDataConfig,
)
from trainer.data.base import Source, TokenWindows, derive_seed, split_tail
from trainer.data.loader import GlobalBatchLoader
from trainer.data.regression import RegressionSource
from trainer.data.synthetic import MarkovSource
from trainer.data.text import TextSource
from trainer.data.tokenizer import ByteTokenizer

AnyDataConfig = TextDataConfig | SyntheticDataConfig | RegressionDataConfig | FilesDataConfig | ChatDataConfig
# The model the data feeds: a decoder's config (a Hugging Face directory's, as decoder_config reads it), the
# MLP, or a custom module (which takes any token ids).
AnyModelConfig = LlamaConfig | MLPConfig | HFModelConfig | CustomModelConfig

__all__ = [
    "SOURCE_REGISTRY",
    "ByteTokenizer",
    "DataSplits",
    "GlobalBatchLoader",
    "MarkovSource",
    "RegressionSource",
    "Source",
    "TextSource",
    "TokenWindows",
    "build_source",
    "build_splits",
    "derive_seed",
]


def _require_language_model(kind: str, model_cfg: AnyModelConfig, vocab_needed: int) -> None:
    """Token sources feed a model with an embedding table large enough for their ids."""
    if getattr(model_cfg, "arch", None) == "custom":  # its vocabulary is its own business (an embedding raises)
        return
    vocab_size = getattr(model_cfg, "vocab_size", None)
    if vocab_size is None:
        raise ValueError(
            f"data.kind: {kind} yields token ids, but model.arch: {getattr(model_cfg, 'arch', '?')} takes vectors "
            "(use model.arch: llama, or data.kind: regression)"
        )
    if vocab_size < vocab_needed:
        raise ValueError(
            f"model.vocab_size: {vocab_size} is smaller than the {vocab_needed} token ids data.kind: {kind} "
            f"produces (set model.vocab_size >= {vocab_needed})"
        )


def _build_text(cfg: TextDataConfig, *, seq_len: int, model_cfg: AnyModelConfig, model_path: str | None) -> Source:
    _require_language_model("text", model_cfg, ByteTokenizer.vocab_size)
    return TextSource(cfg, seq_len)


def _build_synthetic(cfg: SyntheticDataConfig, *, seq_len: int, model_cfg: AnyModelConfig,
                     model_path: str | None) -> Source:
    _require_language_model("synthetic", model_cfg, cfg.num_symbols)
    return MarkovSource(cfg, seq_len)


def _build_regression(cfg: RegressionDataConfig, *, seq_len: int, model_cfg: AnyModelConfig,
                      model_path: str | None) -> Source:
    del seq_len, model_path  # vectors, not sequences
    in_features = getattr(model_cfg, "in_features", None)
    out_features = getattr(model_cfg, "out_features", None)
    if in_features is None or out_features is None:
        raise ValueError(
            f"data.kind: regression needs a model with in_features/out_features, but model.arch is "
            f"{getattr(model_cfg, 'arch', '?')} (use model.arch: mlp, or data.kind: text / synthetic)"
        )
    return RegressionSource(cfg, in_features, out_features)


def _build_files(cfg: FilesDataConfig, *, seq_len: int, model_cfg: AnyModelConfig, model_path: str | None) -> Source:
    from trainer.data.files import FilesSource  # optional: datasets and tokenizers, the hf extra

    source = FilesSource(cfg, seq_len)
    _require_language_model("files", model_cfg, source.tokenizer.vocab_size)
    return source


def chat_tokenizer_path(cfg: ChatDataConfig, model_path: str | None) -> str:
    """``data.tokenizer``, else the model's own directory (model=hf).

    Raises:
        ConfigError: at ``data.tokenizer`` when neither is given.
    """
    if tokenizer := cfg.tokenizer or model_path:
        return tokenizer
    raise ConfigError([ConfigIssue("data.tokenizer", "chat data needs a tokenizer with a chat template, and the "
                                   "model (not model=hf) names no directory to take it from",
                                   "set data.tokenizer to a model directory holding tokenizer.json")])


def _build_chat(cfg: ChatDataConfig, *, seq_len: int, model_cfg: AnyModelConfig, model_path: str | None) -> Source:
    from trainer.data.chat import ChatSource  # optional: transformers and datasets, the hf extra

    source = ChatSource(cfg, seq_len, tokenizer=chat_tokenizer_path(cfg, model_path))
    _require_language_model("chat", model_cfg, source.vocab_size)
    return source


SOURCE_REGISTRY: dict[str, Callable[..., Source]] = {
    "text": _build_text,
    "synthetic": _build_synthetic,
    "regression": _build_regression,
    "files": _build_files,
    "chat": _build_chat,
}


def build_source(data_cfg: AnyDataConfig, *, seq_len: int, model_cfg: AnyModelConfig,
                 model_path: str | None = None) -> Source:
    """The source ``data_cfg.kind`` names, sized for ``seq_len`` and the model's input/output widths
    (``model_path``: a Hugging Face model's directory, whose tokenizer chat data uses by default).

    Raises:
        ValueError: an unknown kind, or data that the model cannot consume.
    """
    builder = SOURCE_REGISTRY.get(data_cfg.kind)
    if builder is None:
        raise ValueError(f"data.kind: {data_cfg.kind!r} is not a known source; choose one of {sorted(SOURCE_REGISTRY)}")
    return builder(data_cfg, seq_len=seq_len, model_cfg=model_cfg, model_path=model_path)


@dataclass
class DataSplits:
    """The training source, the validation source (None without a split), and what the run
    should tell the user about the data (e.g. that ``data.max_bytes`` cut the text short)."""

    train: Source
    val: Source | None
    notes: list[str]


def build_splits(data_cfg: AnyDataConfig, *, seq_len: int, model_cfg: AnyModelConfig,
                 model_path: str | None = None) -> DataSplits:
    """The sources of a run: ``data.val_paths`` (files, chat) are read like ``data.paths``; otherwise
    ``data.val_fraction`` holds out the last windows (rows) of the one source."""
    source = build_source(data_cfg, seq_len=seq_len, model_cfg=model_cfg, model_path=model_path)
    notes = source.notes() if hasattr(source, "notes") else []
    if isinstance(data_cfg, ChatDataConfig) and data_cfg.val_paths:
        from trainer.data.chat import ChatSource  # optional: transformers and datasets, the hf extra

        assert isinstance(source, ChatSource), "data.kind=chat builds a ChatSource"
        chat_val = ChatSource(data_cfg, seq_len, tokenizer="", paths=data_cfg.val_paths, key="data.val_paths",
                              tok=source.tok)
        return DataSplits(source, chat_val, notes + [f"validation {note}" for note in chat_val.notes()])
    if isinstance(data_cfg, FilesDataConfig) and data_cfg.val_paths:
        from trainer.data.files import FilesSource  # optional: datasets and tokenizers, the hf extra

        assert isinstance(source, FilesSource), "data.kind=files builds a FilesSource"
        files_val = FilesSource(data_cfg, seq_len, paths=data_cfg.val_paths, key="data.val_paths",
                                tokenizer=source.tokenizer)
        return DataSplits(source, files_val, notes + [f"validation {note}" for note in files_val.notes()])
    train, val = split_tail(source, getattr(data_cfg, "val_fraction", 0.0), path="data.val_fraction")
    if val is not None:
        notes.append(f"data: {len(val)} of {len(source)} windows held out for validation (data.val_fraction)")
    return DataSplits(train, val, notes)
