"""``val_loss`` is the validation split's mean over its targets, each row counted once
(:func:`trainer.run.step.evaluate`, :class:`trainer.data.loader.ValidationRows`): a split smaller than
``train.eval_batches`` batches is not wrapped around, its last batch is padded with rows that count for
nothing, and rows of many targets weigh more than rows of few (token-weighted, as a training step).

    python -m pytest tests/unit/test_eval_rows.py -q

The 2-rank layouts (fsdp, tp, pp) are checked against the same hand-computed mean in
``tests/dist/test_chat.py`` (slow pass).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from trainer.config.chat_data import ChatDataConfig
from trainer.config.data_schema import TextDataConfig
from trainer.config.schema import HFModelConfig, LlamaConfig, RunConfig, TrainConfig
from trainer.data import build_splits
from trainer.data.loader import IGNORE, ValidationRows
from trainer.models import decoder_config
from trainer.run.build import build_parallel_model
from trainer.run.step import evaluate

CPU = torch.device("cpu")


def hand_mean(model, source, indices) -> float:
    """One device, row by row: the summed cross-entropy of the rows' targets over their count."""
    total, count = 0.0, 0
    with torch.no_grad():
        for i in indices:
            inputs, targets, *positions = source[i]
            extra = {"positions": positions[0][None]} if positions else {}
            logits = model(inputs[None], **extra)[0].float()
            total += float(F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum"))
            count += int((targets != IGNORE).sum())
    return total / count


def val_loss_and_split(cfg: RunConfig):
    splits = build_splits(cfg.data, seq_len=cfg.train.seq_len, model_cfg=decoder_config(cfg.model) or cfg.model,
                          model_path=getattr(cfg.model, "path", None))
    pm = build_parallel_model(cfg, CPU)
    return evaluate(pm, splits.val, cfg, CPU), splits.val, pm.model_parts[0]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.hf_assets import conversations, write_chat_tokenizer, write_chats, write_tiny_llama

    root = tmp_path_factory.mktemp("chat")
    write_chat_tokenizer(root / "model", vocab_size=400)
    write_tiny_llama(root / "model", vocab_size=416)
    write_chats(root / "train.jsonl", conversations(12, seed=5, words=(1, 4)))
    write_chats(root / "val.jsonl", conversations(7, seed=9, words=(1, 6)))  # 7 rows of their own counts
    return root


def chat_config(root, **train) -> RunConfig:
    data = ChatDataConfig(paths=[str(root / "train.jsonl")], val_paths=[str(root / "val.jsonl")], packing=False)
    return RunConfig(model=HFModelConfig(path=str(root / "model")), data=data, device="cpu",
                     train=TrainConfig(seq_len=64, global_batch_size=4, **train))


def test_a_small_chat_split_counts_every_row_once(chat_dir):
    """7 rows in batches of 4 with eval_batches=4: two batches, the second with one padding row; today's
    loop ran 4 batches of a wrapping loader (rows counted 2-3 times)."""
    val_loss, val, model = val_loss_and_split(chat_config(chat_dir, eval_batches=4))
    assert len(val) == 7 and len(set(val.counts)) > 1  # uneven target counts: the weighting matters
    expected = hand_mean(model, val, range(7))
    assert abs(val_loss - expected) / expected <= 1e-6, (val_loss, expected)
    # Token-weighted, not a mean of row (or batch) means.
    per_row = [hand_mean(model, val, [i]) for i in range(7)]
    assert abs(sum(per_row) / 7 - expected) / expected > 1e-4


def test_eval_batches_caps_the_rows_to_the_same_first_ones(chat_dir):
    cfg = chat_config(chat_dir, eval_batches=1)
    val_loss, val, model = val_loss_and_split(cfg)
    rows = ValidationRows(val, global_batch_size=4, max_batches=1, dp_rank=0, dp_size=1, seed=0)
    assert len(rows) == 1 and len(set(rows.indices)) == 4
    expected = hand_mean(model, val, rows.indices)
    assert abs(val_loss - expected) / expected <= 1e-6


def test_a_small_text_split_with_microbatches_of_padding():
    """Unmasked tokens (every target counts), 6 held-out windows in batches of 4 accumulated twice
    (loader batches of 2: three of them, none padded) and in batches of 4 (one padded half)."""
    data = TextDataConfig(max_bytes=1024 * 10, val_fraction=0.04)
    model = LlamaConfig(n_layers=1, dim=32, n_heads=2, n_kv_heads=2, vocab_size=256, max_seq_len=64, ffn_hidden_dim=64)
    for accumulation in (1, 2):
        cfg = RunConfig(model=model, data=data, device="cpu",
                        train=TrainConfig(seq_len=64, global_batch_size=4, grad_accum=accumulation, eval_batches=4))
        val_loss, val, built = val_loss_and_split(cfg)
        assert len(val) == 6, len(val)
        expected = hand_mean(built, val, range(6))
        assert abs(val_loss - expected) / expected <= 1e-6, (accumulation, val_loss, expected)


def test_padding_rows_count_for_nothing():
    source = [(torch.arange(4), torch.arange(4) + 1), (torch.arange(4) * 2, torch.full((4,), 7))]
    rows = ValidationRows(source, global_batch_size=4, max_batches=3, dp_rank=1, dp_size=2, seed=0)
    assert len(rows) == 1 and rows.target_count(0) == 8
    inputs, targets = rows.batch(0)  # rank 1's half: two padding rows
    assert inputs.shape == (2, 4) and torch.all(targets == IGNORE)
    floats = [(torch.zeros(3), torch.ones(2))] * 3  # regression-like rows: a padding row's targets are NaN
    _, padded = ValidationRows(floats, global_batch_size=4, max_batches=1, dp_rank=1, dp_size=2, seed=0).batch(0)
    assert not math.isnan(float(padded[0, 0])) and torch.all(torch.isnan(padded[1]))
