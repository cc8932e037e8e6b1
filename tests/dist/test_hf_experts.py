"""Hugging Face mixture-of-experts checkpoints: a tiny Qwen3-MoE and a tiny Mixtral written with
transformers here (2 layers, 4 experts, top 2, 6 heads over 2 kv heads). Their step-0 logits equal
transformers' on one device and on ep [2] (experts ``Shard(0)``, each rank reading only its experts);
ep [2]'s and cp [2]'s first 5 losses, balance losses and gradient norms equal one device's (fp32, rel 1e-5); and the
ep [2] checkpoint, exported with ``--format hf``, loads in transformers with the trainer's logits.

    pytest tests/dist/test_hf_experts.py -q -m slow      # one launch of 2 processes
"""

from __future__ import annotations

import os

import pytest
import torch

from dist_harness import SuiteResults, max_rel
from expert_checks import OUT_ENV, train_moe
from hf_moe_checks import DIR_ENV, KINDS, SUITES, run_config, tokens

pytestmark = pytest.mark.slow
REL, LOGITS = 1e-5, 1e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from tests.hf_assets import write_tiny_moe

    models, out = tmp_path_factory.mktemp("hf-moe"), tmp_path_factory.mktemp("hf-moe-out")
    for kind in KINDS:
        write_tiny_moe(models / kind, model_type=kind)
    os.environ[DIR_ENV], os.environ[OUT_ENV] = str(models), str(out)
    yield models, out
    os.environ.pop(DIR_ENV, None)
    os.environ.pop(OUT_ENV, None)


@pytest.fixture(scope="module")
def results(folders, tmp_path_factory):
    return SuiteResults(SUITES, {"two_rank": 2}, checks="hf_moe_checks", tmp=tmp_path_factory)


def _transformers_logits(directory) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()(tokens()).logits


@pytest.mark.parametrize("kind", KINDS)
def test_step0_logits_equal_transformers_on_one_device_and_on_ep(kind, folders, results):
    from trainer.config.schema import HFModelConfig
    from trainer.models import build_model

    theirs = _transformers_logits(folders[0] / kind)
    with torch.no_grad():
        one_device = build_model(HFModelConfig(path=str(folders[0] / kind)), seed=7)(tokens())  # the seed must not matter
    diffs = [float((one_device - theirs).abs().max())]
    diffs += [float((torch.load(r["logits_file"]) - theirs).abs().max()) for r in results(kind)]
    print(f"{kind}: step-0 logits, max abs difference to transformers (one device, ep rank 0, rank 1): {diffs}")
    assert max(diffs) <= LOGITS, diffs
    assert float(theirs.abs().max()) > 0.1  # not a model whose logits are all near 0


def _assert_equal_one_device(label: str, r: dict, reference: dict) -> None:
    """A rank's first 5 losses, balance losses and gradient norms against one device's (rel :data:`REL`)."""
    print(f"{label}: max rel " + ", ".join(f"{k} {max_rel(r[k], reference[k]):.1e}" for k in ("losses", "aux", "grad_norms")))
    for key in ("losses", "aux", "grad_norms"):
        assert max_rel(r[key], reference[key]) <= REL, (key, r[key], reference[key])


@pytest.mark.parametrize("kind", KINDS)
def test_ep_losses_equal_one_device(kind, folders, results):
    reference = train_moe(run_config(kind, []))
    assert 0.5 < min(reference["aux"]) < 2.0  # the balance loss is computed (about 1 when balanced)
    for r in results(kind):
        _assert_equal_one_device(f"{kind} ep [2]", r, reference)
        assert r["w1"]["placements"] == ["Shard(dim=0)"] and r["w1"]["local_shape"][0] == 2, r["w1"]


@pytest.mark.parametrize("kind", KINDS)
def test_cp_losses_equal_one_device(kind, folders, results):
    """The checkpoint on cp [2]: each row split over the two ranks, the balance loss's per-row statistics
    summed over them."""
    reference = train_moe(run_config(kind, []))
    for r in results(f"{kind}_cp"):
        _assert_equal_one_device(f"{kind} cp [2]", r, reference)


@pytest.mark.parametrize("kind", KINDS)
def test_export_of_the_ep_checkpoint_loads_in_transformers_with_the_trainers_logits(kind, folders, results, tmp_path):
    from trainer.export.weights import export_checkpoint, load_checkpoint_model

    results(kind)  # the launch that saved it
    checkpoint = folders[1] / kind / "step_00000005"
    export_checkpoint(checkpoint, tmp_path / "hf", format="hf")
    model, _, _ = load_checkpoint_model(checkpoint)
    with torch.no_grad():
        ours = model.eval()(tokens())
    theirs = _transformers_logits(tmp_path / "hf")
    print(f"{kind}: exported ep checkpoint, max abs logits difference {float((ours - theirs).abs().max()):.1e}")
    assert float((ours - theirs).abs().max()) <= LOGITS
    # Trained: not the files it started from.
    assert float((theirs - _transformers_logits(folders[0] / kind)).abs().max()) > 1e-3
