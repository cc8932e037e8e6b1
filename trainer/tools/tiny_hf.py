"""``python -m trainer.tools.tiny_hf OUT_DIR``: tiny Hugging Face models, a tokenizer and data, made
offline, so that every documented ``model=hf`` command runs as written without a download.

    python -m trainer.tools.tiny_hf data/      # then: python -m trainer model=hf model.path=data/llama-tiny

``OUT_DIR`` gets, each model with random weights and the same byte-level BPE tokenizer (512 ids, trained
here with ``tokenizers`` on the documents below; ChatML's ``<|im_start|>`` / ``<|im_end|>`` markers):

- ``llama-tiny/``: a Llama (dim 64, 4 layers, 4 heads over 2 key/value heads, 4,096 positions);
- ``smol/``: a SmolLM2-shaped chat model (tied embeddings, 2 layers, 8 heads over 4) whose tokenizer
  carries a ChatML ``chat_template``;
- ``qwen3-moe-tiny/``: a Qwen3 mixture of experts (2 layers, 4 experts, 2 per token);
- ``corpus/docs.jsonl``: 2,000 short documents (``{"text": ...}``);
- ``chats/chats.jsonl``: 600 conversations (``{"messages": [...]}``).

Every file is what ``save_pretrained`` writes, so transformers and the trainer read them as they read a
downloaded model. Needs the ``hf`` extra (``pip install -e ".[hf]"``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

VOCAB_SIZE = 512
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
WORDS = ("the mesh shards every parameter over its axes while the pipeline passes activations between stages and "
         "the optimizer steps once per global batch of packed documents a device holds its shard of each weight "
         "tensor parallel splits matrices data parallel splits the batch").split()
QUESTIONS = ["What is a device mesh?", "How does the pipeline split the model?", "What does fsdp shard?",
             "Why pack documents?", "What is tensor parallelism?"]


def sentences(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def documents(count: int, *, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [sentences(rng, 8, 60).capitalize() + "." for _ in range(count)]


def conversations(count: int, *, seed: int = 1) -> list[list[dict[str, str]]]:
    """One to three exchanges each, a system turn in some."""
    rng = random.Random(seed)
    chats = []
    for _ in range(count):
        turns = [{"role": "system", "content": "You explain distributed training."}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 3)):
            turns += [{"role": "user", "content": rng.choice(QUESTIONS)},
                      {"role": "assistant", "content": sentences(rng, 4, 24).capitalize() + "."}]
        chats.append(turns)
    return chats


def write_tokenizer(path: Path, texts: list[str], *, chat: bool) -> None:
    """A byte-level BPE tokenizer of :data:`VOCAB_SIZE` ids at most, as ``tokenizer.json`` and
    ``tokenizer_config.json`` (end of text ``<|endoftext|>``; a chat model's turns end at ``<|im_end|>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>" if chat else "<|endoftext|>",
              "pad_token": "<|endoftext|>", "model_max_length": 4096}
    if chat:
        config["chat_template"] = CHATML
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_models(out: Path, *, seed: int = 0) -> dict[str, Path]:
    """The three model directories (weights, config, generation config), each with the tokenizer."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    texts = documents(2000) + [turn["content"] for chat in conversations(600) for turn in chat]
    common: dict[str, Any] = dict(vocab_size=VOCAB_SIZE, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    # the configs as config.json holds them (from_dict: the same keys transformers writes and reads back)
    configs: dict[str, tuple[Any, Any]] = {
        "llama-tiny": (transformers.LlamaForCausalLM, transformers.LlamaConfig.from_dict(dict(
            common, hidden_size=64, intermediate_size=172, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False))),
        "smol": (transformers.LlamaForCausalLM, transformers.LlamaConfig.from_dict(dict(
            common, eos_token_id=2, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048, rope_theta=100000.0,
            tie_word_embeddings=True))),
        "qwen3-moe-tiny": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig.from_dict(dict(
            common, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_experts=4, num_experts_per_tok=2, intermediate_size=96, moe_intermediate_size=48,
            max_position_embeddings=2048, tie_word_embeddings=False))),
    }
    paths = {}
    for offset, (name, (model_class, config)) in enumerate(configs.items()):
        torch.manual_seed(seed + offset)  # random but repeatable weights: the classes' own initialisation
        model_class(config).save_pretrained(out / name)
        write_tokenizer(out / name, texts, chat=name == "smol")
        paths[name] = out / name
    return paths


def write_data(out: Path) -> dict[str, Path]:
    """``corpus/docs.jsonl`` (``text`` records) and ``chats/chats.jsonl`` (``messages`` records)."""
    files = {"corpus": out / "corpus" / "docs.jsonl", "chats": out / "chats" / "chats.jsonl"}
    for path in files.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    files["corpus"].write_text("".join(json.dumps({"id": i, "text": text}) + "\n"
                                       for i, text in enumerate(documents(2000))))
    files["chats"].write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in conversations(600)))
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.tools.tiny_hf", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="where to write the models and the data (made if absent)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the models' random weights")
    args = parser.parse_args(argv)
    try:
        import tokenizers  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as err:
        print(f"{err.name} is not installed: the Hugging Face packages are the hf extra "
              "(pip install -e \".[hf]\")", file=sys.stderr)
        return 2
    written = {**write_models(args.out_dir, seed=args.seed), **write_data(args.out_dir)}
    for name, path in written.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
