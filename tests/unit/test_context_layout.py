"""The cp split and the ring's arithmetic on one process (no process group): which tokens a cp rank
holds, that the split balances causal work, that it round-trips, and that the online-softmax merge
of blocks gives softmax attention over all of them.

Run: ``python -m pytest tests/unit/test_context_layout.py -q``
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel.context import ring_alone, shard_sequence, token_index, unshard_sequence, visible


def test_each_rank_holds_a_head_and_a_tail_chunk():
    assert token_index(8, cp_rank=0, cp_size=2).tolist() == [0, 1, 6, 7]
    assert token_index(8, cp_rank=1, cp_size=2).tolist() == [2, 3, 4, 5]
    assert token_index(16, cp_rank=1, cp_size=4).tolist() == [2, 3, 12, 13]


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_every_token_once_and_the_causal_work_balanced(cp):
    seq_len = 2 * cp * 5
    held = [token_index(seq_len, cp_rank=r, cp_size=cp) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq_len))
    # (query, key) pairs a causal mask keeps, per rank: a query at position p sees p + 1 keys.
    work = {int((index + 1).sum()) for index in held}
    assert len(work) == 1, work


def test_shard_and_unshard_round_trip():
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    shards = [shard_sequence(x, dim=1, cp_rank=r, cp_size=3) for r in range(3)]
    assert shards[1][:, :4].equal(x[:, 4:8]) and shards[1][:, 4:].equal(x[:, 16:20])
    assert unshard_sequence(shards, dim=1).equal(x)
    assert shard_sequence(x, dim=1, cp_rank=0, cp_size=1) is x


def test_a_length_that_does_not_cut_into_2cp_chunks_is_refused():
    with pytest.raises(ValueError, match="does not split into 2 x 4 equal chunks"):
        token_index(20, cp_rank=0, cp_size=4)


def test_visible_is_causal_by_true_position_and_keeps_documents_apart():
    q_index, k_index = token_index(8, cp_rank=0, cp_size=2), token_index(8, cp_rank=1, cp_size=2)
    mask = visible(q_index, k_index, causal=True)[0]  # queries 0 1 6 7 over keys 2 3 4 5
    assert mask.tolist() == [[False] * 4, [False] * 4, [True] * 4, [True] * 4]
    starts = torch.tensor([[0, 0, 5, 5]])  # the document each query / key starts at
    mask = visible(q_index, k_index, causal=True, q_doc=starts, k_doc=torch.tensor([[0, 0, 0, 5]]))[0]
    assert mask.tolist() == [[False] * 4, [False] * 4, [False, False, False, True], [False, False, False, True]]


@pytest.mark.parametrize("blocks", [1, 3])
def test_merging_blocks_by_log_sum_exp_is_softmax_over_all_of_them(blocks):
    # Each block holds the same keys: softmax over `blocks` copies of them is softmax over them once.
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 6, 8, generator=g, dtype=torch.float64) for _ in range(2))
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    assert torch.allclose(ring_alone(q, k, v, blocks=blocks), expected, rtol=0, atol=1e-12)


def test_under_a_causal_mask_every_other_ranks_block_is_a_rectangle():
    from parallel.context.attention import _causal_block

    queries = token_index(16, cp_rank=1, cp_size=4)  # 2 3 12 13
    assert _causal_block(queries, token_index(16, cp_rank=0, cp_size=4)) == (slice(0, 4), slice(0, 2))  # keys 0 1 14 15
    assert _causal_block(queries, token_index(16, cp_rank=2, cp_size=4)) == (slice(2, 4), slice(0, 4))  # keys 4 5 10 11
    staircase = _causal_block(torch.arange(4), torch.arange(4))  # not the balanced split's: the mask itself
    assert staircase.tolist() == [torch.ones(4, 4, dtype=torch.bool).tril().tolist()]
    assert _causal_block(torch.arange(2), torch.arange(2, 4)) == "skip"
