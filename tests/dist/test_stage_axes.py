"""Per-stage layouts with a cp or an ep axis in a stage's own layout equal one device (fp32, rel 1e-5): the first five
losses of the trainer's loop, and for the mixture of experts gpt_moe its balance losses and gradient norms, on
[tp] then [cp], [cp] then [tp], (gpt_moe) [tp] then [ep] and [cp] then [dp] (4 ranks); a Hugging Face Llama of 9
heads over 3 kv heads with tied embeddings on [tp 3] then [cp 3] (6 ranks); [fsdp x tp] then [cp], and
(gpt_moe) [fsdp x tp] then [ep] and [fsdp x tp] then [dp x cp] (8 ranks). A ``+parallel=pp_stages_ep`` checkpoint
(gpt_moe) resumes on its own layout, on fsdp x ep [2, 4] and on one device on one device's figures (8 ranks). Every
launch is slow (4 ranks and more).

    pytest tests/dist/test_stage_axes.py -q -m slow      # four launches: 4, 6, 8 and 8 processes
"""

from __future__ import annotations

import os

import pytest

from dist_harness import SuiteResults, max_rel, one_device_figures
from stage_axes_checks import DATA_ENV, LAYOUTS, RESUMES, SAVED_AFTER, SUITES, resume_config, run_config

WORLD_SIZE = {"four_rank": 4, "six_rank": 6, "eight_rank": 8, "eight_rank_resume": 8}
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
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if any(name == n for named in SUITES.values() for n, _ in named)])
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


@pytest.mark.slow
def test_a_pp_stages_ep_checkpoint_resumes_on_its_layout_another_and_one_device(results, references, data_dir):
    """gpt_moe on ``+parallel=pp_stages_ep`` (fsdp x tp then ep) saves a DCP checkpoint after step 2 (of 5); read
    back on the same layout and on fsdp x ep [2, 4] (in the launch that saved it) and on one device, each trains
    steps 3 to 5 on the losses, balance losses and gradient norms of one device that never stopped (rel 1e-5)."""
    expected = references("moe")  # the same config on one device, uninterrupted
    for r in results("pp_stages_ep_saves"):  # the run that saved it never stopped: one device's five steps
        assert max_rel(r["losses"], expected["losses"]) <= LOSS_REL_TOL, (r["losses"], expected["losses"])
    assert (data_dir / "pp_stages_ep" / f"step_{SAVED_AFTER:08d}" / "COMPLETE").is_file()
    alone = one_device_figures(lambda _: resume_config([]))("resumed")
    resumed = {name: results(name) for name in RESUMES} | {"one device": [{**alone, "first_step": SAVED_AFTER}]}
    for name, ranks in resumed.items():
        for r in ranks:
            assert r["first_step"] == SAVED_AFTER, (name, r)
            for figure in ("losses", "aux_losses", "grad_norms"):
                assert len(r[figure]) == 5 - SAVED_AFTER, (name, figure, r[figure])  # steps 3 to 5 only
                rel = max_rel(r[figure], expected[figure][SAVED_AFTER:])
                assert rel <= LOSS_REL_TOL, (name, figure, r[figure], expected[figure])
        print(f"{name} resumed: max rel losses "
              f"{max(max_rel(r['losses'], expected['losses'][SAVED_AFTER:]) for r in ranks):.1e}")
