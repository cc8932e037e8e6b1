"""LoRA on fsdp [2], tp [2], tp_sp [2], pp [2] and 2d [2, 2] (the tiny Llama directory written in the test,
and the built-in gpt_debug on tp and 2d): one device's losses and gradient norms (fp32, rel 1e-5),
every base weight bit-identical after training, no gradient on a frozen weight, and an adapters-only
checkpoint that one process reads back with the trained adapters.

    pytest tests/dist/test_lora.py -q -m slow      # two launches: 2 and 4 processes
"""

from __future__ import annotations

import os

import pytest

from dist_checks import reference_run
from dist_harness import SuiteResults, max_rel
from lora_checks import DIR_ENV, OUT_ENV, SUITES

pytestmark = pytest.mark.slow

WORLD_SIZE = {"two_rank": 2, "four_rank": 4}
SUITE_OF = {name: suite for suite, checks in SUITES.items() for name, _ in checks}
FP32 = [name for name in SUITE_OF if "bf16" not in name]


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    from tests.hf_assets import write_tiny_llama

    path, out = tmp_path_factory.mktemp("llama"), tmp_path_factory.mktemp("lora-ckpts")
    write_tiny_llama(path)
    os.environ[DIR_ENV], os.environ[OUT_ENV] = str(path), str(out)
    yield path, out
    os.environ.pop(DIR_ENV, None)
    os.environ.pop(OUT_ENV, None)


@pytest.fixture(scope="module")
def references(lora_dir):
    """One device's run of each model, LoRA as the checks configure it (built the trainer's way)."""
    from lora_checks import run_config

    from trainer.models import decoder_config

    out = {}
    for model in ("hf", "gpt_debug"):
        cfg = run_config(model, []).model
        out[model] = reference_run(cfg, decoder=decoder_config(cfg), keep_model=True)
        out[model + "_bf16"] = reference_run(cfg, decoder=decoder_config(cfg), precision="bf16")
    return out


@pytest.fixture(scope="module")
def results(lora_dir, tmp_path_factory):
    return SuiteResults(SUITES, WORLD_SIZE, checks="lora_checks", tmp=tmp_path_factory)


def _model(check: str) -> str:
    return "gpt_debug" if "builtin" in check else "hf"


@pytest.mark.parametrize("check", FP32)
def test_lora_equals_one_device_and_keeps_the_base(check, results, references):
    reference = references[_model(check)]
    per_rank = results(check)
    for r in per_rank:
        assert max_rel(r["losses"], reference["losses"]) <= 1e-5, (r["losses"], reference["losses"])
        assert max_rel(r["grad_norms"], reference["grad_norms"]) <= 1e-5, (r["grad_norms"], reference["grad_norms"])
        assert r["num_base"] > 0 and r["base_changed"] == [], r["base_changed"]
        assert r["frozen_grads"] == []
        assert all("lora_A" in n or "lora_B" in n for n in r["trainable"]), r["trainable"]
    # The adapters trained (B starts at zeros) on every rank holding some.
    assert all(r["adapter_max"] > 1e-4 for r in per_rank), [r["adapter_max"] for r in per_rank]


def test_lora_in_bf16_keeps_the_base_and_follows_one_device(results, references):
    reference = references["hf_bf16"]
    for r in results("fsdp_bf16"):
        assert r["base_changed"] == [] and r["num_base"] > 0
        # FSDP2's bf16 policy casts where autocast does not: close, not equal.
        assert max_rel(r["losses"], reference["losses"]) <= 2e-2, (r["losses"], reference["losses"])


@pytest.mark.parametrize("check", ["fsdp", "2d"])
def test_adapters_only_checkpoint_resumes_and_exports(check, results, references, lora_dir):
    from trainer.export.weights import load_checkpoint_model

    for r in results(check):
        assert r["adapters_saved"] and len(r["saved_keys"]) == len(r["trainable"]) * (1 if check == "fsdp" else 1)
        assert r["resumed_differ"] == [] and len(r["resumed_equal"]) == r["num_base"] + len(r["trainable"])
    # One process reads it back: the base from model.path, the adapters from the checkpoint.
    model, _, _ = load_checkpoint_model(lora_dir[1] / check / "step_00000001")
    want = references["hf"]["model"].state_dict()
    diff = max(float((v - want[k]).abs().max()) for k, v in model.state_dict().items())
    assert diff <= 1e-5, diff
