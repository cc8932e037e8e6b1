"""Hugging Face mixture-of-experts config.json (qwen3_moe, mixtral) -> ``model.moe``: the mapping, the
refusals (reason and fix), and the names between the files' per-expert tensors and the trainer's
stacked experts. The config.json files are written here; transformers is not imported.

    python -m pytest tests/unit/test_hf_moe_config.py -q
"""

from __future__ import annotations

import json

import pytest
import torch

from trainer.models.hf import HFModelError, read_hf_config
from trainer.models.hf_moe import file_keys, hf_state

QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 48,
             "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16,
             "vocab_size": 512, "num_local_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False,
             "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": False,
             "router_aux_loss_coef": 0.001, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}
MIXTRAL = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": None, "vocab_size": 512,
           "num_local_experts": 8, "num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.02,
           "router_jitter_noise": 0.0, "sliding_window": None, "rope_theta": 1e6}


def _read(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return read_hf_config(str(tmp_path))[0]


@pytest.mark.parametrize("experts_key", ["num_local_experts", "num_experts"])  # transformers 5 writes the first
def test_qwen3_moe_maps_to_a_moe_of_its_experts_with_qwen3_attention(tmp_path, experts_key):
    config = {k: v for k, v in QWEN3_MOE.items() if k != "num_local_experts"} | {experts_key: 4}
    cfg = _read(tmp_path, config)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.hidden_dim) == (4, 2, 48)
    assert cfg.moe.score_func == "softmax" and cfg.moe.norm_topk_prob is False and cfg.moe.num_shared_experts == 0
    assert cfg.moe.aux_loss_weight == 0.0  # output_router_logits false: transformers adds no balance loss either
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.head_width == 16 and cfg.ffn_hidden_dim == 96


def test_mixtral_always_rescales_its_top_k_and_weighs_the_balance_loss_by_top_k(tmp_path):
    cfg = _read(tmp_path, MIXTRAL)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.hidden_dim, cfg.moe.norm_topk_prob) == (8, 2, 48, True)
    assert cfg.moe.aux_loss_weight == pytest.approx(0.04)  # router_aux_loss_coef x top_k (docs/experts.md)
    assert not cfg.qk_norm and cfg.rope_theta == 1e6 and cfg.head_width == 16


@pytest.mark.parametrize("change, reason, fix", [
    ({"decoder_sparse_step": 2}, "mixes dense and mixture-of-experts layers", "decoder_sparse_step 1"),
    ({"mlp_only_layers": [1]}, "mlp_only_layers [1]", "no mlp_only_layers"),
    ({"moe_intermediate_size": None}, "lacks the experts' count or width", "complete config.json"),
])
def test_a_qwen3_moe_the_block_cannot_compute_is_refused(tmp_path, change, reason, fix):
    with pytest.raises(HFModelError) as err:
        _read(tmp_path, QWEN3_MOE | change)
    assert reason in err.value.reason and fix in err.value.fix and "config.json" in err.value.reason


def test_mixtral_with_router_jitter_is_refused(tmp_path):
    with pytest.raises(HFModelError) as err:
        _read(tmp_path, MIXTRAL | {"router_jitter_noise": 0.1})
    assert "router_jitter_noise 0.1" in err.value.reason and "router_jitter_noise 0" in err.value.fix


def test_an_unknown_moe_family_names_the_ones_that_load(tmp_path):
    with pytest.raises(HFModelError) as err:
        _read(tmp_path, QWEN3_MOE | {"model_type": "qwen2_moe"})
    assert "qwen3_moe" in err.value.fix and "mixtral" in err.value.fix


@pytest.mark.parametrize("kind, router, expert1_up", [
    ("qwen3_moe", "model.layers.3.mlp.gate.weight", "model.layers.3.mlp.experts.1.up_proj.weight"),
    ("mixtral", "model.layers.3.block_sparse_moe.gate.weight", "model.layers.3.block_sparse_moe.experts.1.w3.weight"),
])
def test_the_files_name_each_expert_and_the_stack_splits_back_into_them(kind, router, expert1_up):
    assert file_keys("model.layers.3.mlp.router.gate.weight", kind, 4) == [router]
    assert file_keys("model.layers.3.mlp.experts.w3", kind, 4)[1] == expert1_up
    assert file_keys("model.layers.3.self_attn.q_proj.weight", kind, 4) == ["model.layers.3.self_attn.q_proj.weight"]
    stack = torch.arange(4 * 6, dtype=torch.float32).view(4, 3, 2)
    out = hf_state({"model.layers.3.mlp.experts.w3": stack, "model.norm.weight": torch.ones(2)}, kind, 4)
    assert torch.equal(out[expert1_up], stack[1]) and len(out) == 5 and "model.norm.weight" in out


@pytest.mark.parametrize("config", [QWEN3_MOE, MIXTRAL], ids=["qwen3_moe", "mixtral"])
def test_weights_written_in_the_files_names_load_stacked_and_fingerprint_as_the_stacks(tmp_path, config):
    """A model's state written under the files' names (as an export writes it) loads back stacked into
    another one; the files' fingerprints, under the model's names, are the model's own, and an
    expert's rows swapped in the file show."""
    from safetensors.torch import save_file

    from trainer.config.schema import HFModelConfig
    from trainer.models.fingerprint import mismatches, module_fingerprints
    from trainer.models.hf import build_hf_model, hf_fingerprints, hf_named_state

    (tmp_path / "config.json").write_text(json.dumps(config))
    source = build_hf_model(HFModelConfig(path=str(tmp_path)), seed=1)  # no weights yet: the seed's
    files = hf_named_state(source.state_dict(), str(tmp_path))
    assert len(files) == len(source.state_dict()) + 2 * 3 * (config["num_local_experts"] - 1)
    save_file({k: v.contiguous() for k, v in files.items()}, str(tmp_path / "model.safetensors"))
    loaded = build_hf_model(HFModelConfig(path=str(tmp_path)), seed=2)
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in loaded.state_dict().items())
    want = module_fingerprints(source)
    assert not mismatches(want, hf_fingerprints(str(tmp_path)), [])
    assert {k for k in want if "experts" in k or "router" in k} <= set(hf_fingerprints(str(tmp_path)))

    block = "mlp" if config["model_type"] == "qwen3_moe" else "block_sparse_moe"
    up = "up_proj" if config["model_type"] == "qwen3_moe" else "w3"
    first, second = (f"model.layers.1.{block}.experts.{e}.{up}.weight" for e in (0, 1))
    files[first], files[second] = files[second], files[first]
    save_file({k: v.contiguous() for k, v in files.items()}, str(tmp_path / "model.safetensors"))
    assert mismatches(want, hf_fingerprints(str(tmp_path)), []) == ["model.layers.1.mlp.experts.w3"]
