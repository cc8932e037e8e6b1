"""Chat fine-tuning on fsdp [2], tp [2], pp [2] (with accumulation), cp [2] (validation) and 3d [2,2,2]: the
first five losses equal one device's (fp32, rel 1e-5) although ranks, micro-batches and accumulation batches
hold uneven numbers of target tokens; their val_loss over a 7-row validation split in batches of 4 equals the
split's one-device mean over its targets, each row once (rel 1e-6); and under tp, tp with sequence parallelism
and pp each packed document's logits equal the document's alone on one device (max abs diff <= 1e-5).

    pytest tests/dist/test_chat.py -q -m slow      # two launches: 2 and 8 processes
"""

from __future__ import annotations

import os

import pytest

from chat_checks import DIR_ENV, SUITES, hand_val_loss, overrides
from dist_harness import SuiteResults, max_rel

pytestmark = pytest.mark.slow

WORLD_SIZE = {"two_rank": 2, "eight_rank": 8}


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    from tests.hf_assets import conversations, write_chat_tokenizer, write_chats, write_tiny_llama

    root = tmp_path_factory.mktemp("chat")
    write_chat_tokenizer(root / "model", vocab_size=400)
    write_tiny_llama(root / "model", vocab_size=416)
    write_chats(root / "chats.jsonl", conversations(80, seed=5, words=(1, 4)))
    write_chats(root / "val.jsonl", conversations(7, seed=9, words=(1, 6)))  # chat_checks.VALIDATION's split
    os.environ[DIR_ENV] = str(root)
    yield root
    os.environ.pop(DIR_ENV, None)


@pytest.fixture(scope="module")
def reference(chat_dir):
    from trainer.config.compose import compose_dict
    from trainer.run.loop import train
    from trainer.run.metrics import NullProgress
    from trainer.tracking.tracker import NullTracker
    from trainer.validate.checks import validate_config

    cfg = validate_config(compose_dict(overrides([])))
    return train(cfg, tracker=NullTracker(), progress=NullProgress()).losses


@pytest.fixture(scope="module")
def results(chat_dir, tmp_path_factory):
    return SuiteResults(SUITES, WORLD_SIZE, checks="chat_checks", tmp=tmp_path_factory)


@pytest.mark.parametrize("check", ["fsdp", "tp", "pp_grad_accum", "3d"])
def test_chat_losses_equal_one_device(check, results, reference):
    assert len(reference) == 5 and len(set(reference)) == 5
    for r in results(check):
        assert max_rel(r["losses"], reference) <= 1e-5, (r["losses"], reference)


@pytest.mark.parametrize("check", ["tp_logits", "tp_sp_logits", "pp_logits"])
def test_packed_documents_see_only_themselves(check, results):
    held = [r for r in results(check) if r["worst"] is not None]
    assert held and all(r["documents"] >= 6 for r in held)  # 4 rows, most holding two conversations (or padding)
    assert max(r["worst"] for r in held) <= 1e-5, held


@pytest.mark.parametrize("check", ["fsdp_val", "tp_val", "pp_val", "cp_val"])
def test_val_loss_is_the_split_mean_on_every_layout(check, results, chat_dir):
    expected = hand_val_loss()
    for r in results(check):
        assert r["rows"] == 7
        assert abs(r["val_loss"] - expected) / expected <= 1e-6, (r["val_loss"], expected)
