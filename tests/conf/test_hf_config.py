"""`model=hf model.path=DIR`: the directory is read (config.json only, no transformers import) and
checked before any worker starts; what the Llama layout cannot run is refused with path, reason, fix."""

from __future__ import annotations

import json

import pytest

from parallel.errors import ConfigError
from trainer.config.compose import compose_dict
from trainer.config.schema import LlamaConfig
from trainer.export.hf import llama_hf_config
from trainer.validate.checks import validate_with_plan


def _hf_dir(tmp_path, **changes):
    config = {**llama_hf_config(LlamaConfig()), **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _issues(overrides):
    with pytest.raises(ConfigError) as err:
        validate_with_plan(compose_dict(overrides))
    return [(i.path, i.reason, i.fix) for i in err.value.issues]


def test_hf_model_takes_the_presets_and_the_model_names(tmp_path):
    path = _hf_dir(tmp_path)
    cfg, plan = validate_with_plan(compose_dict(["model=hf", f"model.path={path}", "+parallel=3d"]))
    assert cfg.model.arch == "hf" and plan.pipeline.boundaries == ["model.layers.2"]
    assert plan.units[0] == "model.embed_tokens" and plan.units[-1] == "lm_head"
    assert plan.blocks == tuple(f"model.layers.{i}" for i in range(4))
    assert {fqn.split(".")[-2]: str(p["tp"]) for fqn, p in plan.placements.items()} == {
        "q_proj": "Shard(0)", "k_proj": "Shard(0)", "v_proj": "Shard(0)", "o_proj": "Shard(1)",
        "gate_proj": "Shard(0)", "up_proj": "Shard(0)", "down_proj": "Shard(1)",
        "lm_head": "Shard(0)", "embed_tokens": "Shard(0)"}  # loss parallel: the vocabulary split over tp
    assert len(plan.placements) == 7 * 4 + 2
    # boundaries in the model's own names, and explicit globs over the family plan
    cfg, plan = validate_with_plan(compose_dict(["model=hf", f"model.path={path}", "+parallel=3d",
                                                 "parallel.pipeline.boundaries=[model.layers.3]"]))
    assert plan.pipeline.stage_units[1] == ("model.layers.3", "model.norm", "lm_head")
    _, plan = validate_with_plan(compose_dict(["model=hf", f"model.path={path}", "+parallel=tp_sp"]))
    assert sorted(plan.layouts)[:3] == ["lm_head",  # loss parallel: its logits stay vocabulary shards
                                        "model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm"]


@pytest.mark.parametrize("changes, reason", [
    ({"model_type": "gpt2"}, "model_type 'gpt2'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "rope type 'yarn'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
])
def test_unsupported_checkpoints_are_refused_at_model_path(tmp_path, changes, reason):
    (issue,) = _issues(["model=hf", f"model.path={_hf_dir(tmp_path, **changes)}"])
    assert issue[0] == "model.path" and reason in issue[1] and issue[2]


def test_missing_directory_and_missing_path(tmp_path):
    (issue,) = _issues(["model=hf"])
    assert issue == ("model.path", "model=hf needs a model directory",
                     "set model.path=DIR (a directory with config.json)")
    (issue,) = _issues(["model=hf", f"model.path={tmp_path / 'nowhere'}"])
    assert issue[0] == "model.path" and "config.json" in issue[1] and "does not exist" in issue[1]


def test_config_values_are_checked_like_the_builtin_model(tmp_path):
    path = _hf_dir(tmp_path, num_attention_heads=3, num_key_value_heads=3)  # 64 / 3 heads
    issues = _issues(["model=hf", f"model.path={path}"])
    assert ("model.path", "(config.json) model.n_heads: dim 64 does not split into 3 heads",
            "use an n_heads that divides model.dim, or set model.head_dim") in issues


def test_qwen_families_take_their_layout_and_qwen3_splits_its_heads_over_tp(tmp_path):
    (tmp_path / "q2").mkdir()
    (tmp_path / "q3").mkdir()
    qwen2 = _hf_dir(tmp_path / "q2", model_type="qwen2")
    _, plan = validate_with_plan(compose_dict(["model=hf", f"model.path={qwen2}", "+parallel=tp"]))
    biases = sorted(f for f in plan.placements if f.endswith("bias"))
    assert len(biases) == 3 * 4 and all(str(plan.placements[f]["tp"]) == "Shard(0)" for f in biases)
    qwen3 = _hf_dir(tmp_path / "q3", model_type="qwen3", head_dim=24)
    cfg, plan = validate_with_plan(compose_dict(["model=hf", f"model.path={qwen3}", "+parallel=3d", "mesh=[2,2,1]",
                                                 "parallel.tensor_parallel=null"]))  # fsdp x pp: fine
    assert plan.pipeline is not None
    # The per-head q/k norms stay whole on every rank (their gradients summed over tp by the engine).
    _, plan = validate_with_plan(compose_dict(["model=hf", f"model.path={qwen3}", "+parallel=tp"]))
    assert str(plan.placements["model.layers.0.self_attn.q_proj.weight"]["tp"]) == "Shard(0)"
    assert not any("q_norm" in f for f in plan.placements)


def test_tied_embeddings_validate_on_every_layout_pipelines_included(tmp_path):
    path = _hf_dir(tmp_path, tie_word_embeddings=True)
    for layout in (["+parallel=fsdp"], ["+parallel=pp"], ["+parallel=3d"], ["+parallel=pp_stages"]):
        validate_with_plan(compose_dict(["model=hf", f"model.path={path}", *layout]))  # each stage keeps a copy


def test_incomplete_or_malformed_config_json_is_an_issue_not_a_traceback(tmp_path):
    config = llama_hf_config(LlamaConfig())
    del config["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (issue,) = _issues(["model=hf", f"model.path={tmp_path}"])
    assert issue[0] == "model.path" and "lacks or has a bad value" in issue[1] and "hidden_size" in issue[1]
    (tmp_path / "config.json").write_text("[1, 2]")
    (issue,) = _issues(["model=hf", f"model.path={tmp_path}"])
    assert issue[0] == "model.path" and "not a JSON object" in issue[1]
