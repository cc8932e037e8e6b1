"""2-D and 2.5-D tensor parallelism (``+parallel=tp2d``, ``tp2d_dp``, ``tp2p5d``) equal one device: the losses and
gradient norms of 5 steps (fp32, rel 1e-5) on the built-in decoder and on Hugging Face Llamas (a tied 4-head one,
and SmolLM2's 9 heads / 3 kv heads on the grids its refusals print: 3 x 3 for tp2d's 2 x 2, and 1 x 3 x 3, one
layer of depth on 9 ranks, for tp2p5d's 2 x 2 x 2), and a Qwen3-like one (per-head q/k norms, head_dim 24) on tp2d,
tp2d_dp and tp2p5d, each rank holding the grid's block of every weight (a q/k norm's weight whole on every rank).

    pytest tests/dist/test_grid.py -q -m slow      # three launches: 4, 8 and 9 processes
"""

from __future__ import annotations

import os

import pytest

import dist_checks
from dist_checks import llama_cfg, reference_run
from dist_harness import SuiteResults, max_rel
from grid_checks import HF_ENV, QWEN3_ENV, SMOL_BATCH, SMOL_ENV, SUITES

pytestmark = pytest.mark.slow

WORLD_SIZE = {"four_rank": 4, "eight_rank": 8, "nine_rank": 9}
MODEL_OF = {"tp2d": "builtin", "tp2d_dp": "builtin", "tp2d_fsdp": "builtin", "tp2p5d": "builtin",
            "tp2d_hf": "hf", "tp2p5d_hf": "hf", "tp2d_smol_3x3": "smol", "tp2p5d_smol_1x3x3": "smol",
            "tp2d_qwen3": "qwen3", "tp2d_dp_qwen3": "qwen3", "tp2p5d_qwen3": "qwen3"}
# (rows, cols) of each check's grid, and the batch rows each grid row holds (8 sequences over the batch ranks)
GRID = {"tp2d": (2, 2, 4), "tp2d_dp": (2, 2, 2), "tp2d_fsdp": (2, 2, 2), "tp2p5d": (2, 2, 2), "tp2d_hf": (2, 2, 4),
        "tp2p5d_hf": (2, 2, 2), "tp2d_smol_3x3": (3, 3, 5), "tp2p5d_smol_1x3x3": (3, 3, 5), "tp2d_qwen3": (2, 2, 4),
        "tp2d_dp_qwen3": (2, 2, 2), "tp2p5d_qwen3": (2, 2, 2)}
ENVS = {"hf": HF_ENV, "smol": SMOL_ENV, "qwen3": QWEN3_ENV}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from tests.hf_assets import write_tied_llama, write_tiny_llama

    dirs = {kind: tmp_path_factory.mktemp(f"grid-{kind}") for kind in ENVS}
    write_tiny_llama(dirs["hf"], tie_word_embeddings=True)
    write_tied_llama(dirs["smol"])
    write_tiny_llama(dirs["qwen3"], model_type="qwen3")
    for kind, env in ENVS.items():
        os.environ[env] = str(dirs[kind])
    yield dirs
    for env in ENVS.values():
        os.environ.pop(env, None)


@pytest.fixture(scope="module")
def references(model_dirs):
    from trainer.config.schema import HFModelConfig
    from trainer.models import decoder_config

    out = {"builtin": reference_run(llama_cfg())}
    for kind in ENVS:
        cfg = HFModelConfig(path=str(model_dirs[kind]))
        with pytest.MonkeyPatch.context() as patch:
            if kind == "smol":  # 15 sequences a step: the 3 x 3 grid's rows split them, as its refusal's fix says
                patch.setattr(dist_checks, "GLOBAL_BATCH", SMOL_BATCH)
            out[kind] = reference_run(cfg, decoder=decoder_config(cfg))
    return out


@pytest.fixture(scope="module")
def results(model_dirs, tmp_path_factory):
    return SuiteResults(SUITES, WORLD_SIZE, checks="grid_checks", tmp=tmp_path_factory)


@pytest.mark.parametrize("check", list(MODEL_OF))
def test_grid_equals_one_device(check, results, references):
    reference = references[MODEL_OF[check]]
    for r in results(check):
        assert max_rel(r["losses"], reference["losses"]) <= 1e-5, (r["losses"], reference["losses"])
        assert max_rel(r["grad_norms"], reference["grad_norms"]) <= 1e-5, (r["grad_norms"], reference["grad_norms"])
        assert abs(r["eval_loss"] - reference["eval_loss"]) <= 1e-5 * abs(reference["eval_loss"])


@pytest.mark.parametrize("check", [c for c, g in GRID.items() if g is not None])
def test_each_rank_holds_its_grid_block_of_weights_and_activations(check, results):
    """The query projection [out, in] is Shard(1) over rows and Shard(0) over cols (with FSDP, its strided
    shard over dp first): a quarter of it on each rank; the attention's input holds this rank's batch rows
    and its half of the hidden."""
    rows, cols, batch_rows = GRID[check]
    for r in results(check):
        out, inp = r["q_shape"]
        assert r["q_placements"][-2:] == ["S(1)", "S(0)"], r["q_placements"]
        if check != "tp2d_fsdp":
            assert r["q_local_shape"] == [out // cols, inp // rows], r
        assert r["attn_input_local_shape"] == [batch_rows, 32, inp // cols], r
        assert r["report"]["layers.0" if "layers.0" in r["report"] else "model.layers.0"] == "grid_stream"


@pytest.mark.parametrize("check", [c for c, model in MODEL_OF.items() if model == "qwen3"])
def test_per_head_norms_are_whole_on_every_rank(check, results):
    """Qwen3's q/k norm weight [head_dim] is replicated over the grid (its gradient summed over it), reported so."""
    for r in results(check):
        assert r["q_norm_placements"][-2:] == ["R", "R"], r["q_norm_placements"]
        assert r["report"]["model.layers.0.self_attn.q_norm"] == "grid_head_norm", r["report"]
