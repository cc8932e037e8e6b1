"""``data_parallel.mode: zero1`` (AdamW's state sharded over dp, parameters and gradients whole): one
device's losses and gradient norms (fp32, rel 1e-5) on zero1 [2], zero1 x tp [2, 2] and zero1 x pp x tp
[2, 2, 2] (built-in model), on a tied-embedding Hugging Face Llama with 9 heads over 3 kv heads (zero1 [2],
zero1 x pp [2, 2]: tp 2 cannot split 9 heads, and the validator refuses it with a fix), the bytes each
rank holds, and checkpoints resumed under another mode and mesh.

    pytest tests/dist/test_zero1.py -q              # two launches, 2 and 4 processes
    pytest tests/dist/test_zero1.py -q -m slow      # the 8-process zero1 x pp x tp
"""

from __future__ import annotations

import math
import os

import pytest

from dist_checks import llama_cfg, reference_run
from dist_harness import SuiteResults, max_rel
from zero1_checks import DIR_ENV, OUT_ENV, SUITES

WORLD_SIZE = {"two_rank": 2, "four_rank": 4, "eight_rank": 8}
TOL = 1e-5
STEP_BYTES = 4  # AdamW's step count: one fp32 scalar per parameter, on every rank
BUILT_IN = ["zero1", "zero1_grad_accum", "zero1_tp", "stages_zero1_then_tp", "resume_zero1_as_fsdp", "resume_fsdp_as_zero1", "resume_zero1_tp_as_zero1_4"]
HF = ["hf_zero1", "hf_zero1_pp"]
# check -> (dp size, mesh shape): the bytes each rank holds
HELD = {"zero1": (2, [2]), "zero1_tp": (2, [2, 2]), "hf_zero1": (2, [2]), "hf_zero1_pp": (2, [2, 2, 1]),
        "zero1_pp_tp": (2, [2, 2, 2])}


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    from tests.hf_assets import write_tied_llama

    path, out = tmp_path_factory.mktemp("smol"), tmp_path_factory.mktemp("zero1-ckpts")
    write_tied_llama(path)
    os.environ[DIR_ENV], os.environ[OUT_ENV] = str(path), str(out)
    yield path
    os.environ.pop(DIR_ENV, None)
    os.environ.pop(OUT_ENV, None)


@pytest.fixture(scope="module")
def results(tied_dir, tmp_path_factory):
    return SuiteResults(SUITES, WORLD_SIZE, checks="zero1_checks", tmp=tmp_path_factory)


@pytest.fixture(scope="module")
def reference(tied_dir):
    from trainer.config.schema import HFModelConfig
    from trainer.models import decoder_config

    hf = HFModelConfig(path=str(tied_dir))
    return {"built_in": reference_run(llama_cfg()), "hf": reference_run(hf, decoder=decoder_config(hf))}


def assert_parity(per_rank: list[dict], want: dict) -> None:
    for r in per_rank:
        assert max_rel(r["losses"], want["losses"]) <= TOL, (r["losses"], want["losses"])
        assert max_rel(r["grad_norms"], want["grad_norms"]) <= TOL, (r["grad_norms"], want["grad_norms"])


def assert_held(per_rank: list[dict], dp: int, mesh: list[int]) -> None:
    """Each rank: gradients as many bytes as its parameters (whole), and the same parameter bytes as the
    other dp ranks of its tp / pp coordinate (replicated over dp); AdamW's two fp32 moments over those dp
    ranks sum to exactly 2 x their parameter bytes, each rank holding 1 / dp of them (torch.chunk's rows)."""
    inner = len(per_rank) // dp  # dp is the outermost axis: rank r's dp group is r % inner
    assert len(per_rank) == dp * inner == math.prod(mesh)
    for coordinate in range(inner):
        group = per_rank[coordinate::inner]
        params = {r["param_bytes"] for r in group}
        assert len(params) == 1, params
        (param_bytes,) = params
        moments = [r["state_bytes"] - STEP_BYTES * r["tensors"] for r in group]
        assert sum(moments) == 2 * param_bytes, (moments, param_bytes)
        for r, held in zip(group, moments):
            assert r["grad_bytes"] == param_bytes
            assert abs(held - 2 * param_bytes / dp) <= 0.05 * 2 * param_bytes / dp, (held, param_bytes)
            assert any("Shard" in p for p in r["moment_placements"]), r["moment_placements"]


@pytest.mark.parametrize("check", BUILT_IN)
def test_built_in_model_equals_one_device(check, results, reference):
    assert_parity(results(check), reference["built_in"])


@pytest.mark.parametrize("check", HF)
def test_tied_hf_llama_equals_one_device(check, results, reference):
    assert_parity(results(check), reference["hf"])


@pytest.mark.parametrize("check", ["zero1", "zero1_tp", "hf_zero1", "hf_zero1_pp"])
def test_each_rank_holds_half_the_moments_and_whole_parameters_and_gradients(check, results):
    per_rank = results(check)
    assert_held(per_rank, *HELD[check])
    if check == "zero1":  # no tp, no pp: every rank holds the whole model, 4 bytes a parameter
        from trainer.models import build_model

        count = sum(p.numel() for p in build_model(llama_cfg()).parameters())
        assert {r["param_bytes"] for r in per_rank} == {4 * count}
        assert [r["state_bytes"] - STEP_BYTES * r["tensors"] for r in per_rank] == [4 * count, 4 * count]


def test_a_stage_of_its_own_on_zero1_shards_its_adamw_over_its_ranks(results):
    """Per-stage layouts: stage 0's ranks (zero1 over 2) hold half their stage's moments each, stage 1's
    (tensor parallel, no data parallelism) their whole tp shards' moments."""
    per_rank = results("stages_zero1_then_tp")
    assert [r["stages"] for r in per_rank] == [[0], [0], [1], [1]]
    first = per_rank[:2]
    assert first[0]["param_bytes"] == first[1]["param_bytes"] == first[0]["grad_bytes"]
    moments = [r["state_bytes"] - STEP_BYTES * r["tensors"] for r in per_rank]
    assert sum(moments[:2]) == 2 * first[0]["param_bytes"]
    assert moments[2:] == [2 * r["param_bytes"] for r in per_rank[2:]]


def test_zero1_reduces_gradients_once_a_step_under_accumulation(results):
    """The first of two accumulation passes reduces nothing into the parameters' gradients, the second
    reduces every one; the steps are one device's (the parity test)."""
    from trainer.models import build_model

    count = len(list(build_model(llama_cfg()).parameters()))
    for r in results("zero1_grad_accum"):
        assert r["reduced_after_pass"] == [0, count] * 5, r["reduced_after_pass"]


@pytest.mark.slow
def test_zero1_pp_tp_equals_one_device_and_holds_its_share(results, reference):
    per_rank = results("zero1_pp_tp")
    assert_parity(per_rank, reference["built_in"])
    assert_held(per_rank, *HELD["zero1_pp_tp"])
    assert sorted({tuple(r["stages"]) for r in per_rank}) == [(0,), (1,)]
