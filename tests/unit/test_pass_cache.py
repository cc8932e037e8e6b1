"""The meta pass is counted once per key (trainer.planner.memory.pass_cache): configs that differ only
in what the pass does not read share it, and any change it reads counts again, with the same answer
as a pass of its own."""

from __future__ import annotations

import json

import pytest

from trainer.config.compose import compose_dict
from trainer.planner.memory import pass_cache, predict
from trainer.validate.checks import validate_with_plan


@pytest.fixture
def passes(monkeypatch) -> list[int]:
    """A fresh shared cache, and the count of meta passes actually run."""
    counted: list[int] = []
    real = predict.saved_activations
    monkeypatch.setattr(predict, "PASSES", pass_cache.PassCache(size=4))
    monkeypatch.setattr(predict, "saved_activations", lambda *a, **k: counted.append(1) or real(*a, **k))
    return counted


def _predict(*overrides: str):
    cfg, plan = validate_with_plan(compose_dict([*overrides, "tracking=none"]))  # (its budget check predicts once)
    return predict.predict_memory(cfg, plan), cfg, plan


def test_layouts_that_run_the_same_pass_share_it(passes):
    fsdp, _, _ = _predict("+parallel=fsdp", "mesh=[2]")
    assert len(passes) == 1  # the validation's budget check and this prediction: one pass
    ddp, cfg, plan = _predict("+parallel=dp", "mesh=[2]")  # another mode, the same micro-batch and shapes
    assert len(passes) == 1
    assert ddp[0].activations == fsdp[0].activations and ddp[0].params == 2 * fsdp[0].params  # ddp: unsharded
    own = predict.predict_memory(cfg, plan, cache={})  # a cache of its own: a pass of its own
    assert len(passes) == 2 and own == ddp


def test_what_the_pass_reads_counts_again(passes):
    _predict("+parallel=fsdp", "mesh=[2]")
    changes = ["train.seq_len=64", "train.global_batch_size=8", "train.precision=bf16", "model.n_layers=2"]
    for count, change in enumerate(changes, start=2):
        _predict("+parallel=fsdp", "mesh=[2]", change)
        assert len(passes) == count, change
    _predict("+parallel=tp", "mesh=[2]")  # tp-local shapes
    assert len(passes) == len(changes) + 2


def test_a_hugging_face_config_json_is_part_of_the_key(passes, tmp_path):
    from trainer.config.schema import LlamaConfig
    from trainer.export.hf import llama_hf_config

    written = llama_hf_config(LlamaConfig())
    (tmp_path / "config.json").write_text(json.dumps(written))
    before, _, _ = _predict("model=hf", f"model.path={tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({**written,
                                                      "intermediate_size": 2 * written["intermediate_size"]}))
    after, _, _ = _predict("model=hf", f"model.path={tmp_path}")
    assert len(passes) == 2 and after[0].activations > before[0].activations


def test_the_oldest_answer_goes_first():
    cache = pass_cache.PassCache(size=2)
    for key in ("a", "b", "c"):
        cache[(key,)] = {"key": key}
    assert ("a",) not in cache and cache[("c",)] == {"key": "c"}
