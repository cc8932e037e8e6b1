"""Small Hugging Face assets the tests write themselves (nothing is downloaded)."""

from __future__ import annotations

import torch


def write_tiny_llama(path, *, seed: int = 0, vocab_size: int = 256, model_type: str = "llama", **config) -> None:
    """A 4-layer Llama-family model (dim 64, GQA 4/2 heads, ffn 172) with random weights, saved as
    transformers saves models. ``model_type`` qwen2 adds q/k/v biases (made non-zero here, so a
    lost bias shows), qwen3 per-head q/k norms and a head_dim (24) that is not dim / heads.
    ``config``: other config.json values (e.g. ``num_attention_heads=9, hidden_size=72, tie_word_embeddings=True``)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    common.update(config)
    if model_type == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif model_type == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=24))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "q_norm" in name or "k_norm" in name:
                param.normal_(0.0, 0.5 if name.endswith("bias") else 1.0).add_(0 if name.endswith("bias") else 0.5)
    model.save_pretrained(path)


def write_tiny_moe(path, *, model_type: str = "qwen3_moe", seed: int = 0, vocab_size: int = 512) -> None:
    """A 2-layer mixture-of-experts model as transformers writes it (one tensor per expert): dim 64, 6
    attention heads over 2 kv heads of width 16, 4 experts of width 48, each token to 2 of them.
    ``model_type`` qwen3_moe (per-head q/k norms, made non-trivial here; norm_topk_prob false, the
    config's default) or mixtral (top-k weights always rescaled). ``output_router_logits`` with a
    ``router_aux_loss_coef`` of 0.02: the trainer adds its balance loss (weight 0.04). The routers' weights are drawn
    wide (std 0.5) so that each token's choices are clear-cut, not decided by rounding."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=16, num_experts_per_tok=2, max_position_embeddings=256,
                  tie_word_embeddings=False, output_router_logits=True, router_aux_loss_coef=0.02)
    if model_type == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, num_experts=4, intermediate_size=96, moe_intermediate_size=48)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**common, num_local_experts=4,
                                                                           intermediate_size=48))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):
                param.normal_(0.0, 0.5)
            elif "q_norm" in name or "k_norm" in name:
                param.normal_(1.0, 0.5)
    model.save_pretrained(path)


def write_tied_llama(path, *, seed: int = 0, vocab_size: int = 256) -> None:
    """A SmolLM2-shaped tiny Llama: input and output embeddings tied (``tie_word_embeddings``), 9
    attention heads over 3 key/value heads (head_dim 8), rope_theta 100000, 2 layers."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=72, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=256,
                                      rope_theta=100000.0, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).save_pretrained(path)



def write_llama32_like(path, *, seed: int = 0, vocab_size: int = 256, scaled: bool = True) -> None:
    """A Llama-3.2-shaped tiny Llama: tied embeddings, rope_theta 500000 and Llama 3's rope scaling
    (factor 32, low/high_freq_factor 1/4) over an ``original_max_position_embeddings`` of 16, so the
    scaling changes frequencies at a test's few dozen positions (max_position_embeddings 256); dim 64,
    4 attention heads over 2 key/value heads, 2 layers. ``scaled=False``: the same without the scaling."""
    import transformers

    torch.manual_seed(seed)
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      rope_theta=500000.0, tie_word_embeddings=True,
                                      rope_scaling=scaling if scaled else None)
    transformers.LlamaForCausalLM(config).save_pretrained(path)

WORDS = ("the mesh shards every parameter over its axes while the pipeline passes activations between stages "
         "and the optimizer steps once per global batch of packed documents").split()


def documents(count: int, *, seed: int = 0) -> list[str]:
    """``count`` short documents of varying length from a small vocabulary (deterministic)."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) for _ in range(count)]


def write_tokenizer(path, *, vocab_size: int = 200) -> None:
    """A byte-level BPE tokenizer trained with ``tokenizers`` on :func:`documents`, saved as
    ``tokenizer.json`` plus a ``tokenizer_config.json`` naming ``</s>`` as EOS."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents(500, seed=99), trainer=trainer)
    Path(path).mkdir(parents=True, exist_ok=True)
    tok.save(str(Path(path) / "tokenizer.json"))
    (Path(path) / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))


def write_jsonl(path, texts: list[str], field: str = "text") -> None:
    import json

    with open(path, "w") as out:
        for i, text in enumerate(texts):
            out.write(json.dumps({"id": i, field: text}) + "\n")


def write_parquet(path, texts: list[str], field: str = "text") -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(texts))), field: texts}), path)


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def write_chat_tokenizer(path, *, vocab_size: int = 200) -> None:
    """:func:`write_tokenizer` with ChatML's turn markers as special tokens and a ChatML
    ``chat_template`` in its tokenizer_config.json (as an instruction-tuned model ships it)."""
    import json
    from pathlib import Path

    from tokenizers import AddedToken, Tokenizer

    write_tokenizer(path, vocab_size=vocab_size)
    tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    tok.save(str(Path(path) / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "bos_token": "<s>", "pad_token": "</s>", "chat_template": CHATML}
    (Path(path) / "tokenizer_config.json").write_text(json.dumps(config))


def conversations(count: int, *, seed: int = 0, words: tuple[int, int] = (2, 14)) -> list[list[dict]]:
    """``count`` conversations of one to three exchanges (a system turn in some), each turn of
    ``words`` (lowest, highest) words."""
    import random

    rng = random.Random(seed)
    say = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words)))  # noqa: E731
    out = []
    for _ in range(count):
        turns = [{"role": "system", "content": say()}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 3)):
            turns += [{"role": "user", "content": say()}, {"role": "assistant", "content": say()}]
        out.append(turns)
    return out


def write_chats(path, chats: list[list[dict]]) -> None:
    """One ``{"messages": [...]}`` record per line."""
    import json

    with open(path, "w") as out:
        for chat in chats:
            out.write(json.dumps({"messages": chat}) + "\n")
