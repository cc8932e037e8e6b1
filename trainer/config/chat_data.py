"""The ``data=chat`` section: conversations for fine-tuning, rendered with a chat template.

Kept beside :mod:`trainer.config.schema` (which lists it among the data sections) so that file
stays one screenful per topic; the rules are the same: every default here, every field described.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from parallel.config import Section
from trainer.config.path_text import PathText


# ChatML: the layout many instruction-tuned models use; named so a tokenizer without a template can train.
TEMPLATES = {
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
        "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
}


class ChatDataConfig(Section):
    kind: Literal["chat"] = Field(
        "chat", description="Conversations (`messages` lists, or prompt / completion pairs) from jsonl / json / "
        "parquet files, rendered with a chat template; the loss is on the assistant's tokens.")
    paths: list[PathText] = Field(
        default_factory=list, description="Files or globs (`**` recurses) of jsonl / json / parquet records; each "
        "must match at least one file.")
    messages_field: str = Field(
        "messages", min_length=1, description="The record field holding the conversation: a list of {role, "
        "content}. Records without it are read as prompt / completion pairs (see prompt_field).")
    prompt_field: str = Field("prompt", min_length=1, description="A prompt / completion record's user turn.")
    completion_field: str = Field(
        "completion", min_length=1, description="A prompt / completion record's assistant turn.")
    tokenizer: PathText | None = Field(
        None, description="A model directory holding tokenizer.json (and tokenizer_config.json with its "
        "chat_template); null = model.path (model=hf).")
    template: PathText | None = Field(
        None, description="The chat template: null = the tokenizer's own (tokenizer_config.json's chat_template, "
        "or chat_template.jinja); a built-in name (chatml); or a path to a .jinja file.")
    train_on: Literal["assistant", "all"] = Field(
        "assistant", description="Which tokens are targets: the assistant's turns (their end-of-turn tokens "
        "included), or every token of the conversation.")
    # TRL's training templates put ChatML's '<|im_end|>\n' inside {% generation %} (the newline a target);
    # Axolotl's chat_template strategy trains the content and the end-of-turn token only (docs/fine-tuning.md).
    train_on_turn_separator: bool = Field(
        True, description="With train_on=assistant: the whitespace a template writes after an assistant turn's "
        "last visible text, such as ChatML's newline after <|im_end|>, is a target too (as TRL's assistant-only "
        "masks); false = the turn's content and its end-of-turn token only (as Axolotl's train_on_eos: turn).")
    packing: bool = Field(
        True, description="Pack conversations into train.seq_len rows, each attending only to itself (positions "
        "restart per conversation); false = one conversation per row, padded.")
    val_paths: list[PathText] = Field(default_factory=list,
                                      description="Separate validation files or globs (see paths).")
    val_fraction: float = Field(
        0.0, ge=0, lt=1, description="Hold out this fraction of the rows, from the end, for validation (when "
        "val_paths is empty); a row holds whole conversations, so none is split.")
