"""Llama 3.x rope scaling (``rope_type: llama3``): a Llama-3.2-shaped checkpoint gives
transformers' logits, both spellings of its config.json load, the setting survives an export, and
bad values are config issues with path, reason and fix.

Run: ``python -m pytest tests/unit/test_rope_scaling.py -q``
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from parallel.errors import ConfigError
from tests.hf_assets import write_llama32_like
from trainer.config.compose import compose_dict
from trainer.config.schema import HFModelConfig, LlamaConfig, RopeScaling
from trainer.export.hf import export_hf, llama_hf_config
from trainer.models.hf import HFModelError, build_hf_model, read_hf_config
from trainer.models.layers import llama3_frequencies, rope_tables
from trainer.models.llama import Transformer
from trainer.validate.checks import validate_config

transformers = pytest.importorskip("transformers")  # optional: the hf extra
LLAMA31 = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


@pytest.fixture(scope="module")
def llama32_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama32")
    write_llama32_like(path)
    return path


def _theirs(directory, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()(tokens).logits


def test_frequencies_follow_the_three_bands():
    """Long wavelengths divided by factor, short ones kept, the band between blended linearly in 1 / wavelength."""
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    got = llama3_frequencies(inv_freq, LLAMA31)
    for f, g in zip(inv_freq.tolist(), got.tolist()):
        wavelength = 2 * math.pi / f
        if wavelength < 8192 / 4:
            assert g == f
        elif wavelength > 8192 / 1:
            assert g == pytest.approx(f / 8)
        else:
            w = (8192 / wavelength - 1) / (4 - 1)
            assert g == pytest.approx((1 - w) * f / 8 + w * f)
    assert (got < inv_freq).any() and (got == inv_freq).any()  # this head width reaches both ends
    cos, _ = rope_tables(32, 64, 500000.0, LLAMA31)
    assert cos.dtype == torch.float32 and not torch.equal(cos, rope_tables(32, 64, 500000.0)[0])


def test_llama32_like_logits_equal_transformers_and_need_the_scaling(llama32_dir):
    cfg, tied = read_hf_config(str(llama32_dir))
    assert tied and cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=16)
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    theirs = _theirs(llama32_dir, tokens)
    ours = build_hf_model(HFModelConfig(path=str(llama32_dir)), seed=3)
    unscaled = Transformer(cfg.model_copy(update={"rope_scaling": None}), layout="hf", tie_embeddings=True)
    unscaled.load_state_dict(ours.state_dict())
    with torch.no_grad():
        diff = (ours(tokens) - theirs).abs().max().item()
        without = (unscaled(tokens) - theirs).abs().max().item()
    print(f"max |logits - transformers'|: {diff:.3g} with the scaling, {without:.3g} without")
    assert diff <= 1e-5
    assert without > 1e-3  # the scaling matters at these lengths, so the check above can fail


def test_rotary_tables_survive_a_meta_build(llama32_dir):
    cfg, _ = read_hf_config(str(llama32_dir))
    direct = Transformer(cfg, layout="hf", tie_embeddings=True)
    with torch.device("meta"):
        model = Transformer(cfg, layout="hf", tie_embeddings=True)
    model.to_empty(device="cpu")
    model.init_weights(0)
    attn, want = model.model.layers["1"].self_attn, direct.model.layers["1"].self_attn
    assert torch.equal(attn.rope_cos, want.rope_cos) and torch.equal(attn.rope_sin, want.rope_sin)


@pytest.mark.parametrize("key, type_key", [("rope_scaling", "rope_type"), ("rope_scaling", "type"),
                                           ("rope_parameters", "rope_type")])
def test_both_config_json_spellings_load(tmp_path, key, type_key):
    config = llama_hf_config(LlamaConfig(max_seq_len=256, rope_theta=500000.0))
    settings = {type_key: "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}
    if key == "rope_parameters":  # transformers 5 keeps rope_theta inside; Llama 3.x's own files beside
        settings["rope_theta"] = config.pop("rope_theta")
    (tmp_path / "config.json").write_text(json.dumps({**config, key: settings}))
    cfg, _ = read_hf_config(str(tmp_path))
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling.factor == 32.0
    assert cfg.rope_scaling.original_max_position_embeddings == 16


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn", "longrope"])
def test_other_rope_types_are_refused_naming_what_is_supported(tmp_path, rope_type):
    config = {**llama_hf_config(LlamaConfig()), "rope_scaling": {"rope_type": rope_type, "factor": 4.0}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFModelError) as err:
        read_hf_config(str(tmp_path))
    assert f"rope type {rope_type!r}" in err.value.reason and "llama3" in err.value.fix


def test_bad_llama3_values_in_config_json_are_named(tmp_path):
    config = {**llama_hf_config(LlamaConfig()), "rope_scaling": {
        "rope_type": "llama3", "factor": 0.5, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFModelError) as err:
        read_hf_config(str(tmp_path))
    assert "rope_scaling.factor" in err.value.reason and "greater than or equal to 1" in err.value.reason


def test_builtin_export_writes_the_scaling_and_transformers_gives_our_logits(tmp_path):
    cfg = LlamaConfig(n_layers=2, rope_theta=500000.0, rope_scaling=RopeScaling(
        factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16))
    model = Transformer(cfg)
    model.init_weights(5)
    export_hf(model.state_dict(), cfg, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())["rope_scaling"]
    assert written == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 16}
    assert read_hf_config(str(tmp_path))[0].model_copy(update={"init_std": cfg.init_std}) == cfg
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(tokens) - _theirs(tmp_path, tokens)).abs().max() <= 1e-5


def test_hf_export_keeps_the_source_config(llama32_dir, tmp_path):
    model = build_hf_model(HFModelConfig(path=str(llama32_dir)))
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # a tie is stored once
    export_hf(state, HFModelConfig(path=str(llama32_dir)), tmp_path)
    assert read_hf_config(str(tmp_path)) == read_hf_config(str(llama32_dir))


def _issues(override: str) -> list[tuple[str, str, str]]:
    with pytest.raises(ConfigError) as err:
        validate_config(compose_dict([override]))
    return [(i.path, i.reason, i.fix) for i in err.value.issues]


@pytest.mark.parametrize("override, path, words", [
    ("model.rope_scaling={factor:0.5}", "model.rope_scaling.factor", "greater than or equal to 1"),
    ("model.rope_scaling={low_freq_factor:4,high_freq_factor:2}", "model.rope_scaling.high_freq_factor",
     "greater than low_freq_factor 4"),
    ("model.rope_scaling={original_max_position_embeddings:0}", "model.rope_scaling.original_max_position_embeddings",
     "greater than or equal to 1"),
    ("model.rope_scaling={type:yarn}", "model.rope_scaling.type", "'llama3'"),
    ("model.rope_scaling={factr:8}", "model.rope_scaling.factr", "unknown key"),
])
def test_bad_values_are_config_issues(override, path, words):
    ((got_path, reason, fix),) = _issues(override)
    assert got_path == path and words in reason and fix


def test_good_values_validate():
    cfg = validate_config(compose_dict(["model.rope_scaling={factor:16,original_max_position_embeddings:64}"]))
    assert cfg.model.rope_scaling == RopeScaling(factor=16, original_max_position_embeddings=64)
