"""Hugging Face causal LMs from a local directory, as the built-in decoder in Hugging Face's names.

    model = build_hf_model(HFModelConfig(path="/data/llama-tiny"), seed=0)   # weights from *.safetensors
    model.state_dict().keys()   # model.embed_tokens.weight, model.layers.0.self_attn.q_proj.weight, ...

A Llama-family ``config.json`` (``model_type`` llama, mistral, qwen2 or qwen3: one layout, give
or take Qwen2's q/k/v biases and Qwen3's per-head q/k norms; qwen3_moe and mixtral put a mixture of
experts in place of every MLP, :mod:`trainer.models.hf_moe`) becomes a
:class:`~trainer.config.schema.LlamaConfig` and a :class:`~trainer.models.llama.Transformer` with
``layout="hf"``, whose parameter names and rotary convention are ``LlamaForCausalLM``'s: the
checkpoint loads key for key, the logits equal transformers' own, and every layout the engine
supports (tensor, sequence, pipeline, data parallel) works unchanged. The directory is read with
``json`` and ``safetensors`` only; ``transformers`` is never imported here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from pydantic import ValidationError

from trainer.config.schema import HFModelConfig, LlamaConfig, MoEConfig
from trainer.models.fingerprint import Fingerprint, file_fingerprints
from trainer.models.hf_moe import MOE_MODEL_TYPES, HFModelError, file_keys, hf_state, is_stacked, key_files, \
    moe_fields, read_stacked, stacked_fingerprint
from trainer.models.llama import Transformer
from trainer.models.lora import is_adapter

# The Llama layout and its kin: Qwen2 adds q/k/v biases, Qwen3 per-head q/k norms and a free head_dim;
# Qwen3-MoE (Qwen3's attention) and Mixtral (Mistral's) a mixture of experts in every block.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *MOE_MODEL_TYPES)
# Plain RoPE, and Llama 3.x's frequency adjustment; linear, dynamic, yarn and longrope are refused.
SUPPORTED_ROPE_TYPES = ("default", "llama3")


def model_dir(cfg: HFModelConfig) -> str:
    """``model.path``, the directory model=hf needs (validation refuses a config without one)."""
    if not cfg.path:
        raise HFModelError("model=hf needs a model directory", "set model.path=DIR (a directory with config.json)")
    return cfg.path


def read_hf_config(path: str | None) -> tuple[LlamaConfig, bool]:
    """``(the decoder's config, tie_word_embeddings)`` of the model directory ``path``."""
    if not path:
        raise HFModelError("model=hf needs a model directory", "set model.path=DIR (a directory with config.json)")
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise HFModelError(f"{str(config_file)!r} does not exist",
                           "give a Hugging Face model directory with config.json")
    try:
        hf = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise HFModelError(f"{str(config_file)!r} is not readable JSON: {err}", "give a valid config.json") from None
    if not isinstance(hf, dict):
        raise HFModelError(f"{str(config_file)!r} is not a JSON object", "give a Hugging Face config.json")
    kind = hf.get("model_type")
    if kind not in SUPPORTED_MODEL_TYPES:
        raise HFModelError(f"model_type {kind!r} in {str(config_file)!r} is not supported",
                           f"use a model of type {', '.join(SUPPORTED_MODEL_TYPES)} (the Llama layout, dense or "
                           "with a mixture of experts)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise HFModelError(f"rope settings {rope!r} in {str(config_file)!r} are not an object",
                           "give a valid config.json")
    # transformers writes `rope_type` (older versions: `type`); Llama 3.1/3.2 use llama3.
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    unsupported = [
        (f"rope type {rope_type!r}", rope_type not in SUPPORTED_ROPE_TYPES),
        (f"hidden_act {hf.get('hidden_act')!r}", hf.get("hidden_act", "silu") != "silu"),
        ("attention_bias", bool(hf.get("attention_bias"))),
        ("mlp_bias", bool(hf.get("mlp_bias"))),
        ("use_sliding_window", bool(hf.get("use_sliding_window"))),
    ]
    moe = moe_fields(hf, kind, str(config_file)) if kind in MOE_MODEL_TYPES else None  # refusals: HFModelError
    try:
        cfg = LlamaConfig(
            dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"], vocab_size=hf["vocab_size"],
            ffn_hidden_dim=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
            norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            init_std=hf.get("initializer_range", 0.02), head_dim=hf.get("head_dim"),
            qkv_bias=kind == "qwen2", qk_norm=kind in ("qwen3", "qwen3_moe"),
            rope_scaling=_llama3_scaling(rope, hf) if rope_type == "llama3" else None,
            moe=MoEConfig(**moe) if moe is not None else None,
        )
    except ValidationError as err:  # each bad value named by its LlamaConfig field, on one line
        bad = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}"
                        for e in err.errors())
        raise HFModelError(f"{str(config_file)!r} has a bad value: {bad}", "give a valid Llama config.json") from None
    except (KeyError, ValueError) as err:
        raise HFModelError(f"{str(config_file)!r} lacks or has a bad value: {err}",
                           "give a complete Llama config.json") from None
    for what, bad in unsupported:
        if bad:
            raise HFModelError(f"{what} in {str(config_file)!r} is not supported by the Llama layout here",
                               "use a checkpoint with default or Llama 3 (llama3) RoPE, silu, full attention and no "
                               "biases (Qwen2's q/k/v biases excepted)")
    return cfg, bool(hf.get("tie_word_embeddings", False))


def _llama3_scaling(rope: dict, hf: dict) -> dict:
    """config.json's llama3 rope settings as :class:`~trainer.config.schema.RopeScaling`'s fields (a
    missing ``original_max_position_embeddings`` falls back to ``max_position_embeddings``, as in
    transformers); LlamaConfig checks the values."""
    return {"type": "llama3", "factor": rope["factor"], "low_freq_factor": rope["low_freq_factor"],
            "high_freq_factor": rope["high_freq_factor"],
            "original_max_position_embeddings": rope.get("original_max_position_embeddings")
            or hf.get("max_position_embeddings", 2048)}


def sliding_window(path: str) -> int | None:
    """The window of a Mistral or Mixtral checkpoint's sliding-window attention (``sliding_window`` in
    config.json; null on Mistral 0.2 and later), or None. Qwen's ``use_sliding_window`` is refused
    by :func:`read_hf_config`."""
    hf = json.loads((Path(path) / "config.json").read_text())
    window = hf.get("sliding_window") if hf.get("model_type") in ("mistral", "mixtral") else None
    return int(window) if isinstance(window, int) and window > 0 else None


def weight_files(path: str) -> list[Path]:
    """The directory's ``*.safetensors`` files (one file or a sharded set), sorted."""
    return sorted(Path(path).glob("*.safetensors"))


def build_hf_model(cfg: HFModelConfig, *, device: str | torch.device = "cpu", seed: int = 0,
                   load_weights: bool = True) -> Transformer:
    """The model of ``cfg.path``: initialised from ``(seed, FQN)``, then overwritten by the
    directory's safetensors weights when there are any and ``load_weights`` (``device="meta"``:
    shapes only). A sharded run loads them after parallelizing instead: :func:`load_hf_sharded`."""
    path = model_dir(cfg)
    llama, tied = read_hf_config(path)
    with torch.device(device):
        model = Transformer(llama, layout="hf", tie_embeddings=tied, lora=cfg.lora)
    if torch.device(device).type == "meta":
        return model
    model.init_weights(seed)
    if load_weights and (files := weight_files(path)):
        load_hf_weights(model, files, tied=tied)
    return model


def load_hf_sharded(parts: list[torch.nn.Module], path: str) -> None:
    """Fill this rank's (sharded, split) model parts from the directory's safetensors through DCP's
    Hugging Face reader: every rank asks for the pieces its DTensor shards and pipeline stages
    hold and the reader slices them out of the files, so no rank materialises the whole
    checkpoint. A mixture of experts' stacked weights are read expert by expert, each rank only
    its experts' slices (:func:`trainer.models.hf_moe.read_stacked`). Collective: every rank of the
    job calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    kind, num_experts, tied = _layout(path)
    reader = HuggingFaceStorageReader(path)
    in_files = set(reader.read_metadata().state_dict_metadata)
    state: dict[str, torch.Tensor] = {}
    for part in parts:
        state.update(part.state_dict())
    state = {k: v for k, v in state.items() if not is_adapter(k)}  # LoRA adapters start from the seed
    keys = {k: file_keys(k, kind, num_experts) for k in state}
    missing = sorted(key for k, ks in keys.items() for key in ks if key not in in_files
                     and not (tied and k == "lm_head.weight"))
    if missing:
        raise HFModelError(f"the safetensors weights do not fit config.json: missing {missing[:4]}",
                           "give the weights saved with this config.json")
    # The router's gate under its name in the files: DCP loads into the tensor the dict holds.
    dcp.load({keys[k][0]: v for k, v in state.items() if not is_stacked(k) and keys[k][0] in in_files},
             storage_reader=reader)
    stacked = {k: (keys[k], v) for k, v in state.items() if is_stacked(k)}
    if stacked:
        read_stacked(stacked, key_files(weight_files(path)))


def load_hf_weights(model: Transformer, files: list[Path], *, tied: bool) -> None:
    """Load the safetensors ``files`` of a model directory into the whole ``model`` (one process); a
    mixture of experts' per-expert tensors stacked into its ``experts.w*``."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    state = {k: v for k, v in state.items() if "rotary_emb" not in k}  # derived tables, rebuilt by the model
    kind, num_experts, _ = _layout(str(Path(files[0]).parent)) if files else ("", 0, False)
    if kind in MOE_MODEL_TYPES:  # the files' names to the model's: the router renamed, the experts stacked
        for name in model.state_dict():
            keys = file_keys(name, kind, num_experts)
            if keys != [name] and all(k in state for k in keys):
                tensors = [state.pop(k) for k in keys]
                state[name] = torch.stack(tensors) if is_stacked(name) else tensors[0]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (tied and k == "lm_head.weight") and not is_adapter(k)]
    if missing or unexpected:
        raise HFModelError(f"the safetensors weights do not fit config.json: missing {missing[:4]}, unexpected "
                           f"{unexpected[:4]}", "give the weights saved with this config.json")


def hf_fingerprints(path: str) -> dict[str, Fingerprint]:
    """The fingerprints (:mod:`trainer.models.fingerprint`) of the directory's weights under the model's
    parameter names: a stacked expert weight's computed from its experts' tensors (each read once)."""
    files = weight_files(path)
    kind, num_experts, _ = _layout(path)
    if kind not in MOE_MODEL_TYPES:
        return file_fingerprints(files)
    layers = read_hf_config(path)[0].n_layers
    keys = {name: file_keys(name, kind, num_experts) for name in (
        f"model.layers.{i}.mlp.{w}" for i in range(layers) for w in ("router.gate.weight", "experts.w1", "experts.w2",
                                                                    "experts.w3"))}
    per_expert = {key for name, ks in keys.items() if is_stacked(name) for key in ks}
    out = file_fingerprints(files, skip=per_expert.__contains__)  # those count in their stack's
    where = key_files(files)
    for name, ks in keys.items():
        if is_stacked(name) and all(k in where for k in ks):
            out[name] = stacked_fingerprint(ks, where)
        elif not is_stacked(name) and ks[0] in out:
            out[name] = out.pop(ks[0])
    return out


def hf_named_state(state: dict[str, torch.Tensor], path: str) -> dict[str, torch.Tensor]:
    """The whole model's ``state`` under the names of the directory's files (a mixture of experts' stacked
    weights split into one tensor per expert, the router's gate renamed): what transformers loads."""
    kind, num_experts, _ = _layout(path)
    return hf_state(state, kind, num_experts)


def _layout(path: str) -> tuple[str, int, bool]:
    """``(model_type, routed experts per block or 0, tie_word_embeddings)`` of the directory ``path``."""
    cfg, tied = read_hf_config(path)
    kind = json.loads((Path(path) / "config.json").read_text())["model_type"]
    return kind, cfg.moe.num_experts if cfg.moe is not None else 0, tied
