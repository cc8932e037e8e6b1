"""The ``data`` sections of the run configuration (a tagged union on ``kind``), beside
:mod:`trainer.config.schema`, which re-exports them; the same rules hold here: every default once,
every field described (``python -m trainer --help`` and the REST API's schema show them).
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import Field

from parallel.config import Section as _Section
from trainer.config.path_text import PathText
from trainer.config.chat_data import ChatDataConfig



class TextDataConfig(_Section):
    kind: Literal["text"] = Field("text", description="Byte-level tokens from local text files.")
    root: PathText = Field(
        "stdlib",
        description="Directory searched for files; `stdlib` means the Python standard library's own source, "
        "which exists offline wherever the project runs.",
    )
    glob: PathText = Field("**/*.py", description="Glob (relative to root) selecting the files, read in sorted order.")
    # Every rank holds the text in memory (a byte per token): 1 GiB is 130x the default and past any
    # byte-level experiment; bigger corpora are data=files' job, which memory-maps its tokens.
    max_bytes: int = Field(8_000_000, ge=1024, le=2**30, description="Read at most this many bytes of the sorted "
                           "files (the run says when it cuts the text short); at most 1073741824 (1 GiB: every rank "
                           "holds the text in memory; use data=files for more).")
    val_fraction: float = Field(0.0, ge=0, lt=1, description="Hold out this fraction of the token windows, from the "
                                "end of the text, for validation.")


class SyntheticDataConfig(_Section):
    kind: Literal["synthetic"] = Field("synthetic",
                                       description="A seeded order-k Markov chain with a known entropy rate.")
    order: int = Field(1, ge=1, le=3, description="Markov order k: each token depends on the previous k.")
    num_symbols: int = Field(16, ge=2, le=256, description="Alphabet size (token ids 0 .. num_symbols-1).")
    concentration: float = Field(0.1, gt=0, description="Dirichlet concentration of the transition rows; "
                                                        "small = peaky.")
    # Generating the stream takes ~17 bytes a token at once (float64 uniforms, int64 states) on every rank:
    # 2**27 tokens is 2.3 GB, 67x the default, more than any entropy-rate experiment needs.
    num_tokens: int = Field(2_000_000, ge=1024, le=2**27, description="Length of the generated token stream; at most "
                            "134217728 (generated in memory on every rank).")
    seed: int = Field(1234, description="Seed of the chain and of the stream (independent of train.seed).")


class RegressionDataConfig(_Section):
    kind: Literal["regression"] = Field("regression",
                                        description="x ~ N(0, 1), y = teacher(x) + noise; for the mlp model.")
    # Samples are made on demand, but every epoch's order is a permutation of all of them (8 bytes each).
    num_samples: int = Field(65536, ge=16, le=2**27, description="Number of (x, y) pairs; at most 134217728 (each "
                             "epoch's order is a permutation of them all, in memory).")
    noise_std: float = Field(0.01, ge=0, description="Std of the Gaussian noise added to the teacher's output.")
    seed: int = Field(1234, description="Seed of the teacher and the samples.")


class FilesDataConfig(_Section):
    kind: Literal["files"] = Field("files", description="Documents from your files (jsonl, json, parquet or "
                                                        "text), tokenized.")
    paths: list[PathText] = Field(
        default_factory=list, description="Files or globs (`**` recurses); jsonl/json/parquet give records, any other "
        "suffix is plain text with one document per file. Each must match at least one file.")
    text_field: str = Field("text", min_length=1, description="The record field holding a document's text.")
    tokenizer: PathText | None = Field(
        None, description="A tokenizer.json, or a model directory holding one (Hugging Face `tokenizers`); "
        "null = UTF-8 bytes (256 ids, NUL ends a document).")
    eos_token: str | None = Field(
        None, description="The token appended to each document; null = the tokenizer's own (tokenizer_config.json, "
        "then the usual names such as </s> or <|endoftext|>).")
    cache_dir: PathText = Field(
        ".cache/meshflow-tokens", min_length=1, description="Where the tokenized corpus is kept (one memory-mapped "
        "file per corpus and tokenizer, shared by the ranks of a host and reused by later runs).")
    num_proc: int = Field(1, ge=1, le=256, description="Processes tokenizing the corpus the first time.")
    val_paths: list[PathText] = Field(default_factory=list,
                                      description="Separate validation files or globs (see paths).")
    val_fraction: float = Field(
        0.0, ge=0, lt=1, description="Hold out this fraction of the token windows, from the end of the corpus, "
        "for validation (when val_paths is empty).")
    packing: bool = Field(
        False, description="Keep documents apart inside a window: each token attends only to its own document "
        "and positions restart after every end-of-document token (false = the window is one sequence).")


DataConfig = Annotated[TextDataConfig | SyntheticDataConfig | RegressionDataConfig | FilesDataConfig | ChatDataConfig,
                       Field(discriminator="kind")]
DATA_SECTIONS = get_args(get_args(DataConfig)[0])
