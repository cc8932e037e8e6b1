"""Conversations for fine-tuning: rendered with a chat template, targets on the assistant's tokens, packed.

    python -m trainer +recipe=finetune model=hf model.path=/data/smol data=chat 'data.paths=[/data/chats/*.jsonl]'

Each record holds a ``messages`` list (``{"role", "content"}``) or a prompt / completion pair (read
as a user turn and an assistant turn). A conversation is rendered with the tokenizer's own chat
template (``tokenizer_config.json``), a built-in one (``data.template=chatml``) or a ``.jinja``
file, through transformers' ``apply_chat_template``, and tokenized once with character offsets.
An assistant turn's tokens are found by rendering the conversation up to the turn twice: with the
generation prompt (the text before the reply) and with the reply (the text after it); the tokens
starting between the two are the reply's, its end-of-turn tokens included, and the whitespace the
template writes after them (ChatML's newline after ``<|im_end|>``) unless ``data.train_on_turn_separator=false``.
Every other target is ``IGNORE`` (-100), which the loss skips (``data.train_on=all`` keeps them all).

Rows: with ``data.packing`` (the default) conversations are packed back to back into rows of
``train.seq_len`` (next-fit, in file order; the rest of a row is padding), and each row carries
``positions``: every conversation's positions start at 0, and the model attends only within a
run of positions that starts at 0 (:func:`trainer.models.llama.document_mask`), so a packed
conversation gives the logits it gives alone. Without packing each row holds one conversation,
padded at its end. A conversation longer than a row is cut to it (the run's notes count them).

Every row knows how many targets it has (:meth:`ChatSource.target_count`): the training loop
divides the loss by the target count of the whole global batch, so every layout, micro-batching
and accumulation gives one device's loss (:class:`trainer.models.TargetMeanLoss`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from parallel.errors import ConfigError, ConfigIssue
from trainer.config.chat_data import TEMPLATES, ChatDataConfig
from trainer.data.files import expand_paths, file_format
from trainer.data.tokenizer import tokenizer_file

IGNORE = -100  # a target the loss skips (torch's cross_entropy ignore_index default)

def load_chat_tokenizer(path: str, template: str | None, *, key: str = "data.tokenizer") -> Any:
    """transformers' fast tokenizer of ``path`` (a directory or its tokenizer.json) with ``template``
    resolved into its ``chat_template``.

    Raises:
        ConfigError: at ``data.template`` when there is no template, or the name / file is unknown.
    """
    from transformers import PreTrainedTokenizerFast

    try:
        file = tokenizer_file(path)
    except ConfigError:
        raise ConfigError([ConfigIssue(key, f"{path!r} holds no tokenizer.json",
                                       f"set {key} to a model directory holding tokenizer.json")]) from None
    tok = (PreTrainedTokenizerFast.from_pretrained(str(file.parent), local_files_only=True)
           if file.name == "tokenizer.json" else PreTrainedTokenizerFast(tokenizer_file=str(file)))
    if template is not None:
        if template in TEMPLATES:
            tok.chat_template = TEMPLATES[template]
        elif Path(template).expanduser().is_file():
            tok.chat_template = Path(template).expanduser().read_text()
        else:
            raise ConfigError([ConfigIssue("data.template", f"{template!r} is neither a built-in template "
                                           f"({', '.join(TEMPLATES)}) nor a file",
                                           "data.template=chatml")])
    if not isinstance(tok.chat_template, str) or not tok.chat_template:
        raise ConfigError([ConfigIssue("data.template", f"the tokenizer at {str(file.parent)!r} has no chat template "
                                       "(tokenizer_config.json's chat_template, or chat_template.jinja)",
                                       "data.template=chatml")])
    try:  # a template whose replies cannot be located is refused here, before any data is read
        render(tok, PROBE)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - the template is the user's code: any failure to render is its own
        # (jinja2's syntax errors, an {% include %} with no loader, the sandbox refusing an attribute, ...)
        raise ConfigError([ConfigIssue("data.template", f"the chat template does not render a conversation: "
                                       f"{type(err).__name__}: {err}",
                                       "fix the template, or use a built-in one: data.template=chatml")]) from None
    return tok


PROBE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"},
         {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again?"},
         {"role": "assistant", "content": "Yes."}]


def conversation(record: dict, cfg: ChatDataConfig) -> list[dict[str, str]]:
    """The record's messages: its ``messages_field``, or its prompt / completion as two turns."""
    messages = record.get(cfg.messages_field)
    if messages:
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
    return [{"role": "user", "content": str(record[cfg.prompt_field])},
            {"role": "assistant", "content": str(record[cfg.completion_field])}]


def _render(tok: Any, messages: list[dict], *, prompt: bool = False) -> str:
    if not messages and not prompt:
        return ""
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)


def render(tok: Any, messages: list[dict], *, train_on: str = "assistant",
           turn_separator: bool = True) -> tuple[list[int], list[bool]]:
    """``(token ids, is_target)`` of one conversation: ``is_target[j]`` marks the assistant's tokens
    (every token with ``train_on="all"``); ``turn_separator`` (``data.train_on_turn_separator``): the
    whitespace after a reply's end-of-turn token (ChatML's newline after ``<|im_end|>``) among them.

    Raises:
        ConfigError: at ``data.template`` when the template does not render a conversation as a
            growing prefix (a turn's text changes once a later turn follows): the reply cannot be found.
    """
    text = _render(tok, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or train_on == "all":
            continue
        before, through = _render(tok, messages[:i], prompt=True), _render(tok, messages[: i + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise ConfigError([ConfigIssue(
                "data.template", "the chat template renders an earlier turn differently once later turns follow "
                "(e.g. it drops the reasoning of earlier replies), so the assistant's tokens cannot be located",
                "data.template=chatml")])
        end = len(through) if turn_separator else len(before) + len(through[len(before):].rstrip())
        spans.append((len(before), end))
    encoding = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoding["input_ids"])
    if train_on == "all":
        return ids, [True] * len(ids)
    return ids, [any(lo <= start < hi for lo, hi in spans) for start, _ in encoding["offset_mapping"]]


def read_records(paths: list[str], key: str) -> list[dict]:
    """Every record of the jsonl / json / parquet files ``paths`` names, in file order."""
    import datasets

    files = expand_paths(paths, key)
    fmt = file_format(files, key)
    if fmt == "text":
        raise ConfigError([ConfigIssue(key, f"{str(files[0])!r} is plain text; chat data is records",
                                       "give jsonl, json or parquet files of records with a messages list")])
    datasets.disable_progress_bars()
    return list(datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train"))


class ChatSource:
    """Rows of ``train.seq_len`` tokens from conversations: ``source[i] -> (inputs, targets[, positions])``.

    Args:
        cfg: the ``data`` section (``kind: chat``).
        seq_len: tokens per row (``train.seq_len``).
        tokenizer: the tokenizer directory (``data.tokenizer``, or ``model.path``).
        paths, key: the files to read instead of ``cfg.paths`` (the validation files) and their config path.
        tok: the tokenizer already loaded (the validation split reuses the training one's).
    """

    def __init__(self, cfg: ChatDataConfig, seq_len: int, *, tokenizer: str, paths: list[str] | None = None,
                 key: str = "data.paths", tok: Any = None) -> None:
        self.cfg, self.seq_len = cfg, seq_len
        self.tok = tok or load_chat_tokenizer(tokenizer, cfg.template)
        self.vocab_size = len(self.tok)
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.pad_id = int(pad or 0)
        records = read_records(cfg.paths if paths is None else paths, key)
        if records and cfg.messages_field not in records[0] and cfg.prompt_field not in records[0]:
            raise ConfigError([ConfigIssue("data.messages_field", f"the records of {key} have neither "
                                           f"{cfg.messages_field!r} nor {cfg.prompt_field!r}; they have "
                                           f"{sorted(records[0])}",
                                           "set data.messages_field (or data.prompt_field / data.completion_field)")])
        self.num_conversations, self.num_cut = len(records), 0
        documents = []
        for record in records:
            ids, is_target = render(self.tok, conversation(record, cfg), train_on=cfg.train_on,
                                    turn_separator=cfg.train_on_turn_separator)
            if len(ids) < 2:
                continue
            inputs = ids[:-1]
            targets = [t if keep else IGNORE for t, keep in zip(ids[1:], is_target[1:])]
            if len(inputs) > seq_len:
                self.num_cut += 1
                inputs, targets = inputs[:seq_len], targets[:seq_len]
            documents.append((inputs, targets))
        if not documents:
            raise ConfigError([ConfigIssue(key, "holds no conversation of two tokens or more",
                                           "give files of records with a messages list")])
        rows = pack(documents, seq_len) if cfg.packing else [[doc] for doc in documents]
        self.inputs, self.targets, positions = _stack_rows(rows, seq_len, self.pad_id)
        # without packing one conversation per row, padded at its end: the causal mask suffices
        self.positions: Tensor | None = positions if cfg.packing else None
        self.counts = (self.targets != IGNORE).sum(dim=1).tolist()

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[Tensor, ...]:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range [0, {len(self)})")
        if self.positions is None:
            return self.inputs[index], self.targets[index]
        return self.inputs[index], self.targets[index], self.positions[index]

    def target_count(self, index: int) -> int:
        """How many of row ``index``'s targets count in the loss."""
        return self.counts[index]

    def notes(self) -> list[str]:
        cut = f", {self.num_cut} cut to train.seq_len" if self.num_cut else ""
        return [f"data: {self.num_conversations} conversations{cut} -> {len(self)} rows of {self.seq_len} "
                f"({'packed' if self.cfg.packing else 'one per row'}), {sum(self.counts)} target tokens "
                f"({self.cfg.train_on}), vocab {self.vocab_size}"]


def pack(documents: list[tuple[list[int], list[int]]], seq_len: int) -> list[list[tuple[list[int], list[int]]]]:
    """Next-fit packing: documents in order, a new row when the next one does not fit."""
    rows: list[list] = [[]]
    used = 0
    for doc in documents:
        if used + len(doc[0]) > seq_len and rows[-1]:
            rows.append([])
            used = 0
        rows[-1].append(doc)
        used += len(doc[0])
    return rows


def _stack_rows(rows: list[list[tuple[list[int], list[int]]]], seq_len: int,
                pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """``[rows, seq_len]`` inputs, targets and positions; the padding is one more document of its own."""
    inputs = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
    targets = np.full((len(rows), seq_len), IGNORE, dtype=np.int64)
    positions = np.zeros((len(rows), seq_len), dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for doc_inputs, doc_targets in row:
            n = len(doc_inputs)
            inputs[r, at : at + n], targets[r, at : at + n] = doc_inputs, doc_targets
            positions[r, at : at + n] = np.arange(n)
            at += n
        positions[r, at:] = np.arange(seq_len - at)
    return torch.from_numpy(inputs), torch.from_numpy(targets), torch.from_numpy(positions)
