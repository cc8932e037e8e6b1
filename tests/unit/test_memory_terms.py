"""The predicted peak by named term, in plan.json (``memory_terms_gib``) and the dry run's text, on the
published Llama 3.1 8B FSDP row (torchtitan, 8 H100s, 2 x 8192 tokens per rank, bf16): the terms add
up to the peak, and those that follow from the model's shape alone equal their hand-computed values.

    PYTHONPATH=$PWD python -m pytest -q -p no:cacheprovider -n 0 tests/unit/test_memory_terms.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_profiles  # noqa: E402
import published  # noqa: E402

from parallel.plan.resolve import resolve_plan  # noqa: E402
from trainer.models import build_model  # noqa: E402
from trainer.planner.forecast.plan_file import dry_run_report  # noqa: E402
from trainer.planner.memory.predict import MEMORY_TERMS  # noqa: E402

GIB = 2**30
DIM, LAYERS, KV_DIM, FFN, VOCAB = 4096, 32, 1024, 14336, 128256
BLOCK = 2 * DIM * DIM + 2 * DIM * KV_DIM + 3 * DIM * FFN + 2 * DIM  # q, o; k, v; w1, w2, w3; two norms
ROOT = 2 * VOCAB * DIM + DIM  # embedding, untied output head, final norm
PARAMS = LAYERS * BLOCK + ROOT  # 8,030,261,248: Llama 3.1 8B


@pytest.fixture(scope="module")
def plan_json(tmp_path_factory):
    row = next(r for r in published.rows() if r.name == "torchtitan-8b-fsdp8")
    cfg = bench_profiles.row_config(row)
    plan = resolve_plan(cfg.parallel, cfg.mesh, build_model(cfg.model, device="meta"))
    out = tmp_path_factory.mktemp("plan")
    text, _ = dry_run_report(cfg, plan, pictures_dir=out)
    return json.loads((out / "plan.json").read_text()), text


def test_the_terms_add_up_to_the_peak(plan_json):
    plan, text = plan_json
    terms = plan["memory_terms_gib"]
    assert set(terms) == {"pp_rank", "peak_phase", *MEMORY_TERMS}
    assert sum(terms[k] for k in MEMORY_TERMS) == pytest.approx(plan["peak_memory_gib_per_device"], rel=1e-9)
    assert terms["peak_phase"] == "backward" and terms["pp_rank"] == 0
    assert f"weights {terms['weights']:.2f}, optimizer state {terms['optimizer_state']:.2f}" in text


def test_the_state_and_gathered_terms_are_the_hand_computed_ones(plan_json):
    terms = plan_json[0]["memory_terms_gib"]
    assert PARAMS == 8_030_261_248
    assert terms["weights"] == pytest.approx(PARAMS * 4 / 8 / GIB, rel=1e-6)  # fp32, sharded over 8
    assert terms["optimizer_state"] == pytest.approx(2 * PARAMS * 4 / 8 / GIB, rel=1e-6)  # AdamW's two moments
    # FSDP2 keeps the root's parameters gathered (bf16) through forward and backward, and early in
    # backward one block, the next one prefetched and the all-gather buffer it is copied from.
    assert terms["gathered_parameters"] == pytest.approx((ROOT + 3 * BLOCK) * 2 / GIB, rel=1e-6)
    # On a GPU the sharded fp32 gradients stay reserved for FSDP2's reduce-scatter stream, which made
    # them, from one step to the next: they are there at backward's worst moment.
    assert terms["gradients"] == pytest.approx(PARAMS * 4 / 8 / GIB, rel=1e-6)
    assert terms["optimizer_step_temporaries"] == 0


def test_the_logits_and_the_gpu_runtime_are_named(plan_json):
    terms = plan_json[0]["memory_terms_gib"]
    tokens = 2 * 8192
    # The head keeps the chunked cross-entropy's gradient of the logits, made in forward in the logits'
    # dtype (bf16: no fp32 log-softmax of the whole vocabulary is kept; nor the targets, used up in
    # forward) and its bf16 input; the final norm its bf16 input and the fp32 reciprocal RMS of each token
    # (trainer.models.layers.RMSNorm: the normalized row is rebuilt in backward).
    head, norm = VOCAB * 2 + DIM * 2, DIM * 2 + 4
    assert terms["logits_and_loss"] == pytest.approx(tokens * (head + norm) / GIB, rel=1e-6)
    assert terms["runtime"] == pytest.approx(0.7 + 1.0)  # h100_hbm2e's CUDA context and NCCL buffers
    live = sum(terms[k] for k in MEMORY_TERMS if k not in ("runtime", "allocator_slack"))
    assert terms["allocator_slack"] == pytest.approx(0.1 * live)  # the profile's allocator_slack
