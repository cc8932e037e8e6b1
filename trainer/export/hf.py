"""Weights out to a Hugging Face directory: ``config.json`` + ``model.safetensors`` (+ the
tokenizer files of the source directory, when there are any), loadable with
``transformers.AutoModelForCausalLM.from_pretrained``.

A model from ``model=hf`` already has Hugging Face's names and rotary convention: its tensors
go out unchanged, beside the source directory's own ``config.json`` (a mixture of experts' stacked
weights split back into the files' one tensor per expert: :mod:`trainer.models.hf_moe`). The built-in Llama
(``model=gpt_debug`` ...) is renamed piece by piece, and its ``wq`` / ``wk`` rows are permuted
per head from Meta's interleaved rotary pairs ``(2i, 2i+1)`` to Hugging Face's halves
``(i, i + D/2)``: attention scores are dot products, unchanged when q and k are permuted alike,
so the exported model gives the trainer's logits.

    python -m trainer.export checkpoints/step_00000100 --format hf --out exported/
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from trainer.config.schema import HFModelConfig, LlamaConfig
from trainer.export.sources import Source, copy_model_files
from trainer.models.hf import hf_named_state, model_dir
from trainer.models.llama import HF_NAMES, MESHFLOW_NAMES

_TOP = {"tok_embeddings": "model.embed_tokens", "layers": "model.layers", "norm": "model.norm", "output": "lm_head"}
_INNER = dict(zip(MESHFLOW_NAMES[:-1], HF_NAMES[:-1]))  # wq -> q_proj, attn -> self_attn, ...


def hf_name(fqn: str) -> str:
    """The Hugging Face name of a built-in Llama parameter: ``layers.0.attn.wq.weight`` ->
    ``model.layers.0.self_attn.q_proj.weight``."""
    top, _, rest = fqn.partition(".")
    parts = [_INNER.get(part, part) for part in rest.split(".")] if rest else []
    return ".".join([_TOP[top], *parts])


def halves_from_pairs(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder each head's output rows from interleaved pairs to halves (evens, then odds)."""
    out_features, in_features = weight.shape
    heads = out_features // head_dim
    return weight.view(heads, head_dim // 2, 2, in_features).transpose(1, 2).reshape(out_features, in_features)


def llama_hf_config(cfg: LlamaConfig) -> dict:
    """``config.json`` of a ``LlamaForCausalLM`` with the built-in decoder's shape (and its Llama 3
    rope scaling, under the ``rope_scaling`` key Llama 3.x checkpoints use)."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.num_kv_heads,
        "intermediate_size": cfg.ffn_hidden_dim, "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "tie_word_embeddings": False, "initializer_range": cfg.init_std, "torch_dtype": "float32",
    }
    if cfg.rope_scaling is not None:
        config["rope_scaling"] = {"rope_type": cfg.rope_scaling.type,
                                  **cfg.rope_scaling.model_dump(exclude={"type"})}
    return config


def hf_layout_refusal(model_cfg) -> str | None:
    """Why a model built from ``model_cfg`` has no Hugging Face directory (None: it has one)."""
    if isinstance(model_cfg, HFModelConfig):
        return None
    if not isinstance(model_cfg, LlamaConfig):
        return (f"model {model_cfg.arch} has no Hugging Face counterpart; export it as safetensors (--format "
                "safetensors)")
    if model_cfg.moe is not None:
        return ("the built-in mixture-of-experts model has no Hugging Face layout here yet; export it as safetensors "
                "(--format safetensors)")
    if model_cfg.qkv_bias or model_cfg.qk_norm or model_cfg.head_dim not in (None, model_cfg.dim // model_cfg.n_heads):
        return ("the built-in Llama exports to Llama's layout, which has no qkv_bias, qk_norm or free head_dim; export "
                "it as safetensors (--format safetensors)")
    return None


def export_hf(state: dict[str, torch.Tensor], model_cfg, out: str | Path, *,
              tokenizer: Source | None = None, template: str | None = None) -> dict[str, Any]:
    """Write ``state`` (the full model's weights) of a model built from ``model_cfg`` as a
    Hugging Face directory ``out``, with what a user of the model needs from the model directory
    and from ``tokenizer`` (the run's: a tokenizer.json or a directory holding one, which wins):
    tokenizer, chat template, generation config, special-token maps
    (:data:`trainer.export.sources.MODEL_DIR_FILES`); ``template``, the chat template the run
    trained with, as ``chat_template.jinja``. Returns ``{"tensors": n, "bytes": size, "files": [...]}``."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(model_cfg, HFModelConfig):
        tensors = hf_named_state(state, model_dir(model_cfg))  # a mixture of experts: one tensor per expert again
        source = Path(model_dir(model_cfg))
        shutil.copy(source / "config.json", out / "config.json")
    elif isinstance(model_cfg, LlamaConfig):
        if (refusal := hf_layout_refusal(model_cfg)) is not None:
            raise ValueError(refusal)
        head_dim = model_cfg.dim // model_cfg.n_heads
        tensors = {}
        for fqn, value in state.items():
            if fqn.rsplit(".", 2)[-2] in (MESHFLOW_NAMES.q, MESHFLOW_NAMES.k):
                value = halves_from_pairs(value, head_dim)
            tensors[hf_name(fqn)] = value
        (out / "config.json").write_text(json.dumps(llama_hf_config(model_cfg), indent=2))
    else:
        raise ValueError(hf_layout_refusal(model_cfg))
    model_files = Source(Path(model_dir(model_cfg))) if isinstance(model_cfg, HFModelConfig) else None
    files = copy_model_files([model_files, tokenizer], out, template=template)  # the run's tokenizer wins
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return {"tensors": len(tensors), "bytes": (out / "model.safetensors").stat().st_size, "files": files}
