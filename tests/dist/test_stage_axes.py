"""Per-stage layouts with a cp or an ep axis in a stage's own layout equal one device (fp32, rel 1e-5): the first five
losses of the trainer's loop, and for the mixture of experts gpt_moe its balance losses and gradient norms, on
[tp] then [cp], [cp] then [tp], (gpt_moe) [tp] then [ep] and [cp] then [dp] (4 ranks); a Hugging Face Llama of 9
heads over 3 kv heads with tied embeddings on [tp 3] then [cp 3] (6 ranks); [fsdp x tp] then [cp], and
(gpt_moe) [fsdp x tp] then [ep] and [fsdp x tp] then [dp x cp] (8 ranks). Every launch is slow (4 ranks and more).

    pytest tests/dist/test_stage_axes.py -q -m slow      # three launches: 4, 6 and 8 processes
"""

from __future__ import annotations

import os

import pytest

from dist_harness import SuiteResults, max_rel, one_device_figures
from stage_axes_checks import DATA_ENV, LAYOUTS, SUITES, run_config

WORLD_SIZE = {"four_rank": 4, "six_rank": 6, "eight_rank": 8}
LOSS_REL_TOL = 1e-5


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from tests.hf_assets import write_tiny_llama

    root = tmp_path_factory.mktemp("stage-axes")
    write_tiny_llama(root / "llama9", hidden_size=72, intermediate_size=180, num_attention_heads=9,
                     num_key_value_heads=3, tie_word_embeddings=True)  # its ffn 180 splits over tp 3
    os.environ[DATA_ENV] = str(root)
    yield root
    os.environ.pop(DATA_ENV, None)


@pytest.fixture(scope="module")
def references(data_dir):
    """One device's figures per model (the same loop), each computed when first asked for."""
    return one_device_figures(lambda model: run_config(model, None))


@pytest.fixture(scope="module")
def results(data_dir, tmp_path_factory):
    return SuiteResults(SUITES, WORLD_SIZE, checks="stage_axes_checks", tmp=tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [name for named in SUITES.values() for name, _ in named])
def test_stage_layouts_with_cp_and_ep_equal_one_device(layout, results, references):
    """Every rank reports the global figures: the losses, and for gpt_moe the balance losses and the gradient
    norms (its balance loss's gradient reaches the router through each stage's own data, context and expert
    parallelism), each within rel 1e-5 of one device's."""
    model, _ = LAYOUTS[layout]
    expected = references(model)
    figures = ["losses", "aux_losses", "grad_norms"] if model == "moe" else ["losses", "grad_norms"]
    print(f"{layout}: max rel " + ", ".join(f"{f} {max(max_rel(r[f], expected[f]) for r in results(layout)):.1e}"
                                            for f in figures))
    for figure in figures:
        assert len(expected[figure]) == 5 and len(set(expected[figure])) == 5, (figure, expected[figure])
        for r in results(layout):
            assert max_rel(r[figure], expected[figure]) <= LOSS_REL_TOL, (figure, r[figure], expected[figure])
