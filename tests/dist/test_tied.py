"""A tied-embedding model (SmolLM2's shape, written in the test) on tensor parallelism, every
pipeline schedule kind, 3d with tp 3 and per-stage layouts: one device's losses and gradient
norms (fp32, rel 1e-5), both stages' copies of the tie equal, and a checkpoint holding the tie
once that one process reads back with the trained values.

    pytest tests/dist/test_tied.py -q -m slow      # four launches: 2, 3, 4 and 6 processes
"""

from __future__ import annotations

import os

import pytest

from dist_checks import reference_run
from dist_harness import SuiteResults, max_rel
from tied_checks import DIR_ENV, OUT_ENV, SUITES

pytestmark = pytest.mark.slow

WORLD_SIZE = {"two_rank": 2, "three_rank": 3, "four_rank": 4, "six_rank": 6}
SUITE_OF = {name: suite for suite, checks in SUITES.items() for name, _ in checks}
PARITY = [name for name in SUITE_OF if name != "corrupt_load"]
# 258 = 2 x 3 x 43: the vocabulary divides over tp 3 (SmolLM2's 9 heads allow no other tp here), so the
# tp layouts split the tied embedding and head for loss parallel.
VOCAB = 258


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    from tests.hf_assets import write_tied_llama

    path, out = tmp_path_factory.mktemp("smol"), tmp_path_factory.mktemp("tied-ckpts")
    write_tied_llama(path, vocab_size=VOCAB)
    os.environ[DIR_ENV], os.environ[OUT_ENV] = str(path), str(out)
    yield path, out
    os.environ.pop(DIR_ENV, None)
    os.environ.pop(OUT_ENV, None)


@pytest.fixture(scope="module")
def reference(tied_dir):
    from trainer.config.schema import HFModelConfig
    from trainer.models import decoder_config

    cfg = HFModelConfig(path=str(tied_dir[0]))
    return reference_run(cfg, decoder=decoder_config(cfg), keep_model=True)


@pytest.fixture(scope="module")
def results(tied_dir, tmp_path_factory):
    return SuiteResults(SUITES, WORLD_SIZE, checks="tied_checks", tmp=tmp_path_factory)


@pytest.mark.parametrize("check", PARITY)
def test_tied_model_equals_one_device(check, results, reference, tied_dir):
    from trainer.checkpoint.safe_read import stored_keys
    from trainer.export.weights import load_checkpoint_model

    per_rank = results(check)
    for r in per_rank:
        assert max_rel(r["losses"], reference["losses"]) <= 1e-5, (r["losses"], reference["losses"])
        assert max_rel(r["grad_norms"], reference["grad_norms"]) <= 1e-5, (r["grad_norms"], reference["grad_norms"])
    # Every copy of the tie (the first stage's embedding, the last stage's head) holds the same values.
    sums = [v for r in per_rank for v in r["tie_sums"].values()]
    assert sums and max(sums) - min(sums) <= 1e-9 * max(1.0, abs(sums[0])), [r["tie_sums"] for r in per_rank]

    ckpt = tied_dir[1] / check / "step_00000001"
    keys = stored_keys(ckpt)
    assert "model.model.embed_tokens.weight" in keys and "model.lm_head.weight" not in keys, sorted(keys)[:8]
    model, _, _ = load_checkpoint_model(ckpt)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    want = reference["model"].state_dict()
    diff = max(float((v - want[k]).abs().max()) for k, v in model.state_dict().items())
    assert diff <= 1e-5, diff


def test_a_wrong_slice_loaded_on_one_rank_is_refused_naming_the_parameter(results):
    for r in results("corrupt_load"):
        assert r["refused"] == ["model.layers.0.mlp.up_proj.weight"], r
        assert "model.path" in r["message"] and "refusing to train" in r["message"]


def test_loss_parallel_splits_the_tied_embedding_with_the_head(results):
    """tp [3] (258 tokens divide): loss parallel is on and the tie stays one parameter, Shard(0) over tp, on
    every rank; 3d [1, 2, 3]: each stage's copy (the embedding on the first, the head on the last) is split
    over tp alike."""
    for r in results("tp"):
        assert r["loss_parallel"] is True and r["tie_is_one"] == [True]
        assert set(map(tuple, r["tie_ends"].values())) == {("S(0)",)}, r["tie_ends"]
    per_rank = results("3d_tp3")  # [dp, pp, tp] = [1, 2, 3]: pp rank 0 holds the embedding, pp rank 1 the head
    assert [list(r["tie_ends"]) for r in per_rank] == [["model.embed_tokens.weight"]] * 3 + [["lm_head.weight"]] * 3
    for r in per_rank:  # FSDP's shard over dp (its strided form, beside tp's), then tp's vocabulary rows
        assert r["loss_parallel"] is True and [v[-1] for v in r["tie_ends"].values()] == ["S(0)"], r["tie_ends"]
