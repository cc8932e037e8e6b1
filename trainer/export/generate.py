"""``python -m trainer.generate CHECKPOINT --prompt "..."``: sample text from any checkpoint.

The checkpoint (saved on any mesh) is gathered into the plain model on one device, the prompt
is encoded with the run's tokenizer (``data.tokenizer`` of a files run, UTF-8 bytes for the
built-in text), and tokens are drawn one at a time: logits of the last position divided by
the temperature, cut to the ``top_k`` largest, sampled with a seeded generator (temperature 0
is greedy). Generation stops after ``--max-new-tokens`` or at the end-of-document token.

    python -m trainer.generate checkpoints/step_00000100 --prompt "def main(" --max-new-tokens 80 \\
        --temperature 0.8 --top-k 40

``--chat "message"`` speaks to a fine-tuned model instead: the message (after ``--system``, if
given) is rendered as a user turn with the run's chat template (``data.template``, else the
tokenizer's own; ``--template`` wins), followed by the template's generation prompt, and the
assistant's reply is printed alone, ending at the tokenizer's end-of-turn token.

    python -m trainer.generate checkpoints/step_00000200 --chat "What is a device mesh?"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

from parallel.errors import ConfigError
from trainer.checkpoint.dcp import CheckpointError
from trainer.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from trainer.export.weights import load_checkpoint_model
from trainer.models import decoder_config


def run_tokenizer(data_config: dict, override: str | None = None) -> ByteTokenizer | HFTokenizer:
    """The tokenizer the run trained with (``override``, a tokenizer.json or directory, wins)."""
    if override:
        return load_tokenizer(override)
    kind = data_config.get("kind", "text")
    if kind == "files":
        return load_tokenizer(data_config.get("tokenizer"), data_config.get("eos_token"))
    if kind == "text":
        return ByteTokenizer()
    if kind == "chat":
        raise ValueError("the run trained on conversations: speak to it with --chat \"message\" (or pass --tokenizer "
                         "to continue raw text with --prompt)")
    raise ValueError(f"the run trained on data.kind: {kind}, which has no text to prompt with "
                     "(generate from a run on data=text or data=files, or pass --tokenizer)")


@torch.no_grad()
def sample(model: nn.Module, prompt: torch.Tensor, *, max_new_tokens: int, temperature: float = 1.0,
           top_k: int | None = None, context: int | None = None, eos_id: int | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """``prompt`` (1-D ids) followed by up to ``max_new_tokens`` sampled ids.

    Each step runs the model on the last ``context`` ids (the whole sequence when None): the
    models here keep no key/value cache, which costs time, not correctness, at these lengths.
    """
    if temperature < 0 or (top_k is not None and top_k < 1):
        raise ValueError("temperature must be >= 0 and top_k >= 1")
    ids = prompt.reshape(1, -1).to(torch.int64)
    for _ in range(max_new_tokens):
        window = ids if context is None else ids[:, -context:]
        logits = model(window)[0, -1].float()
        if temperature == 0:
            next_id = logits.argmax().reshape(1)
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_id = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        ids = torch.cat([ids, next_id.reshape(1, 1)], dim=1)
        if eos_id is not None and int(next_id) == eos_id:
            break
    return ids[0]


def generate(checkpoint: str | Path, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.8,
             top_k: int | None = 40, seed: int = 0, tokenizer: str | None = None, builder: str | None = None) -> str:
    """The prompt and the text sampled after it, decoded with the run's tokenizer. ``builder``: a custom
    model's ``module:function``, which the user names (a checkpoint's own is never imported)."""
    model, model_cfg, extra = load_checkpoint_model(checkpoint, builder=builder)
    if getattr(model_cfg, "arch", None) == "mlp":
        raise ValueError("model mlp maps vectors to vectors; there is nothing to generate")
    tok = run_tokenizer(extra.get("data_config") or {}, tokenizer)
    ids = tok.encode_tensor(prompt)
    if ids.numel() == 0:
        raise ValueError("--prompt: encodes to no tokens; give some text")
    decoder = decoder_config(model_cfg)
    out = sample(model.eval(), ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                 context=decoder.max_seq_len if decoder else None, eos_id=tok.eos_id,
                 generator=torch.Generator().manual_seed(seed))
    return tok.decode(out)


def chat_tokenizer_of(extra: dict, tokenizer: str | None = None, template: str | None = None):
    """The run's tokenizer with its chat template: ``--tokenizer``, else the run's ``data.tokenizer``,
    else the model's directory; ``--template``, else the run's ``data.template``, else the tokenizer's own."""
    from trainer.data.chat import load_chat_tokenizer  # optional: transformers, the hf extra

    data, model = extra.get("data_config") or {}, extra.get("model_config") or {}
    path = tokenizer or data.get("tokenizer") or model.get("path")
    if not path:
        raise ValueError("--chat: the run names no tokenizer with a chat template; pass --tokenizer DIR "
                         "(a model directory holding tokenizer.json)")
    try:
        return load_chat_tokenizer(path, template if template is not None else data.get("template"), key="--tokenizer")
    except ConfigError as err:
        issue = err.issues[0]
        fix = issue.fix.replace("data.template=", "--template ").replace("data.tokenizer", "--tokenizer")
        raise ValueError(f"--chat: {issue.reason} ({fix})") from None


def chat(checkpoint: str | Path, message: str, *, system: str | None = None, template: str | None = None,
         max_new_tokens: int = 64, temperature: float = 0.8, top_k: int | None = 40, seed: int = 0,
         tokenizer: str | None = None, builder: str | None = None) -> str:
    """The assistant's reply to ``message`` (after ``system``), rendered with the run's chat template."""
    model, model_cfg, extra = load_checkpoint_model(checkpoint, builder=builder)
    tok = chat_tokenizer_of(extra, tokenizer, template)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": message}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)
    decoder = decoder_config(model_cfg)
    out = sample(model.eval(), ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                 context=decoder.max_seq_len if decoder else None, eos_id=tok.eos_token_id,
                 generator=torch.Generator().manual_seed(seed))
    return tok.decode(out[len(ids):].tolist(), skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.generate", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a step_<n> checkpoint directory (from any mesh)")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="the text to continue")
    what.add_argument("--chat", help="a user message: the reply of a chat model, rendered with the run's chat template")
    parser.add_argument("--system", default=None, help="with --chat: a system turn before the message")
    parser.add_argument("--template", default=None, help="with --chat: a template name (chatml) or .jinja file instead "
                        "of the run's")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to sample at most (default 64)")
    parser.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy (default 0.8)")
    parser.add_argument("--top-k", type=int, default=40,
                        help="sample among the k likeliest tokens; 0 = all (default 40)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer.json or directory instead of the run's own")
    parser.add_argument("--builder", default=None, metavar="MODULE:FUNCTION",
                        help="a custom model's builder function; a checkpoint that names its own is refused "
                        "unless you name it here (a checkpoint never chooses code to import)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens: must be >= 1")
    if args.temperature < 0:
        parser.error("--temperature: must be >= 0 (0 = greedy)")
    if args.top_k < 0:
        parser.error("--top-k: must be >= 0 (0 = all tokens)")

    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None,
                    seed=args.seed, tokenizer=args.tokenizer, builder=args.builder)
    try:
        if args.chat is not None:
            text = chat(args.checkpoint, args.chat, system=args.system, template=args.template, **sampling)
        else:
            text = generate(args.checkpoint, args.prompt, **sampling)
    except (CheckpointError, ConfigError, ValueError, KeyError) as err:
        print(f"generate failed: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
