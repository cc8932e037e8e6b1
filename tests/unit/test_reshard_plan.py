"""The mesh-to-mesh reshard's transfer plan (no process group): what each rank holds, that the
pieces tile every destination region, and that the bytes moved are the analytic minimum.

    PYTHONPATH=. python -m pytest -q tests/unit/test_reshard_plan.py
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from parallel.reshard.transfer_plan import Box, MeshLayout, layout_boxes, minimum_bytes, plan_reshard

F32 = 4


def plan_and_minimum(shape, src, dst, itemsize=F32):
    plan = plan_reshard(global_shape=shape, src=src, dst=dst, itemsize=itemsize)
    return plan, minimum_bytes(global_shape=shape, src=src, dst=dst, itemsize=itemsize)


def test_shard_to_replicate_across_disjoint_meshes():
    """Every one of 4 new ranks needs the whole (8, 4) tensor, held nowhere on it: 4 x 128 bytes;
    each source rank sends its own 2 rows to each of them."""
    src = MeshLayout([0, 1, 2, 3], (Shard(0),))
    dst = MeshLayout([4, 5, 6, 7], (Replicate(),))
    plan, minimum = plan_and_minimum((8, 4), src, dst)
    assert plan.bytes_moved == minimum == 4 * 8 * 4 * F32
    assert [plan.bytes_sent_by(r) for r in range(4)] == [4 * 2 * 4 * F32] * 4
    assert not any(t.is_local for t in plan.transfers)


def test_same_mesh_shard0_to_shard1_keeps_the_local_block():
    """(8, 8) on 4 ranks: a rank needs an 8 x 2 column block and already holds its 2 x 2 corner."""
    src = MeshLayout([0, 1, 2, 3], (Shard(0),))
    dst = MeshLayout([0, 1, 2, 3], (Shard(1),))
    plan, minimum = plan_and_minimum((8, 8), src, dst)
    assert plan.bytes_moved == minimum == 4 * (16 - 4) * F32
    local = [t for t in plan.transfers if t.is_local]
    assert [(t.dst_rank, t.box) for t in local] == [(r, Box((2 * r, 2 * r), (2, 2))) for r in range(4)]


def test_2d_mesh_to_1d_mesh():
    """(4, 4) as 2 x 2 blocks on [[0, 1], [2, 3]] to rows on [0, 1, 2, 3]: each rank holds half
    of its new row (rank 1 holds row 1's right half, rank 2 row 2's left half, ...)."""
    src = MeshLayout([[0, 1], [2, 3]], (Shard(0), Shard(1)))
    dst = MeshLayout([0, 1, 2, 3], (Shard(0),))
    plan, minimum = plan_and_minimum((4, 4), src, dst)
    assert plan.bytes_moved == minimum == 4 * 2 * F32
    assert {t.dst_rank: t.box for t in plan.transfers if t.is_local} == {
        0: Box((0, 0), (1, 2)), 1: Box((1, 2), (1, 2)), 2: Box((2, 0), (1, 2)), 3: Box((3, 2), (1, 2))}


def test_uneven_dim_5_over_4_ranks_follows_torch_chunk():
    """torch.chunk(5 rows, 4) gives 2, 2, 1 and DTensor adds an empty fourth shard."""
    src = MeshLayout([0, 1, 2, 3], (Shard(0),))
    boxes = layout_boxes((5, 3), src)
    assert [boxes[r].shape for r in range(4)] == [(2, 3), (2, 3), (1, 3), (0, 3)]
    assert [boxes[r].offset[0] for r in range(3)] == [0, 2, 4]
    dst = MeshLayout([0, 1, 2, 3], (Replicate(),))
    plan, minimum = plan_and_minimum((5, 3), src, dst)
    assert plan.bytes_moved == minimum == ((5 - 2) + (5 - 2) + (5 - 1) + 5) * 3 * F32


def test_two_axes_on_one_dim_nest_like_dtensor():
    """[Shard(0), Shard(0)] on a 2 x 4 mesh: the outer axis chunks 5 rows into 3 + 2, the inner
    one chunks each of those again (1, 1, 1, 0 and 1, 1, 0, 0)."""
    layout = MeshLayout([[0, 1, 2, 3], [4, 5, 6, 7]], (Shard(0), Shard(0)))
    boxes = layout_boxes((5,), layout)
    assert [boxes[r].shape[0] for r in range(8)] == [1, 1, 1, 0, 1, 1, 0, 0]
    assert [boxes[r].offset[0] for r in (0, 1, 2, 4, 5)] == [0, 1, 2, 3, 4]


def test_partial_to_replicate_receives_every_contribution():
    """Two contributions of a (3,) tensor on [0, 1] to [0, 1, 2]: ranks 0 and 1 need the other's
    contribution, rank 2 needs both."""
    src = MeshLayout([0, 1], (Partial(),))
    dst = MeshLayout([0, 1, 2], (Replicate(),))
    plan, minimum = plan_and_minimum((3,), src, dst)
    assert plan.sum_contributions
    assert plan.bytes_moved == minimum == (3 + 3 + 6) * F32
    assert sorted((t.src_rank, t.dst_rank) for t in plan.transfers) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


def test_replicate_to_shard_spreads_the_sending():
    src = MeshLayout([0, 1, 2, 3], (Replicate(),))
    dst = MeshLayout([4, 5, 6, 7], (Shard(0),))
    plan, minimum = plan_and_minimum((8, 2), src, dst)
    assert plan.bytes_moved == minimum == 8 * 2 * F32
    assert [plan.bytes_sent_by(r) for r in range(4)] == [2 * 2 * F32] * 4


def test_partial_destination_value_on_coordinate_zero():
    """Replicate on [0, 1] -> Partial on [1, 0]: rank 1 (coordinate 0) keeps the value it holds,
    rank 0 gets zeros: nothing moves."""
    plan, minimum = plan_and_minimum((4,), MeshLayout([0, 1], (Replicate(),)), MeshLayout([1, 0], (Partial(),)))
    assert plan.value_holders == {1}
    assert plan.bytes_moved == minimum == 0
    assert [(t.src_rank, t.dst_rank) for t in plan.transfers] == [(1, 1)]


def test_same_layout_moves_nothing():
    layout = MeshLayout([[3, 1], [0, 2]], (Shard(1), Shard(0)))
    plan, minimum = plan_and_minimum((3, 5), layout, layout)
    assert plan.bytes_moved == minimum == 0
    assert all(t.is_local for t in plan.transfers) and len(plan.transfers) == 4


@pytest.mark.parametrize(("ranks", "placements", "message"), [
    ([0, 1, 1], (Replicate(),), "repeat"),
    ([[0, 1], [2, 3]], (Replicate(),), "placements for a 2-D mesh"),
    ([0, 1], (Partial("max"),), "Partial('sum')"),
])
def test_bad_layouts_are_refused(ranks, placements, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        MeshLayout(ranks, placements)


def test_shard_dim_outside_the_tensor_is_refused():
    with pytest.raises(ValueError, match="does not fit a 2-D tensor"):
        plan_reshard(global_shape=(4, 4), src=MeshLayout([0], (Shard(2),)), dst=MeshLayout([0], (Replicate(),)),
                     itemsize=4)


def _random_layout(rng: random.Random, ndim: int) -> MeshLayout:
    mesh_shape = rng.choice([(1,), (2,), (3,), (5,), (8,), (2, 2), (2, 3), (4, 2), (2, 2, 2), (1, 2, 3)])
    ranks = torch.tensor(rng.sample(range(12), k=int(torch.tensor(mesh_shape).prod()))).reshape(mesh_shape)
    kinds = [Replicate(), Partial()] + [Shard(d) for d in range(ndim)] * 2
    return MeshLayout(ranks, tuple(rng.choice(kinds) for _ in mesh_shape))


def test_random_plans_tile_every_region_and_reach_the_minimum():
    """300 seeded random cases: every element of a value holder's region is covered once per
    contribution, senders hold what they send, and the bytes equal the analytic minimum."""
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(0, 6) for _ in range(rng.randint(1, 3)))
        src, dst = _random_layout(rng, len(shape)), _random_layout(rng, len(shape))
        plan, minimum = plan_and_minimum(shape, src, dst)
        num_contributions = 1
        for axis in src.axes_of(Partial):
            num_contributions *= src.mesh_shape[axis]
        coverage = {rank: torch.zeros(plan.dst_boxes[rank].shape, dtype=torch.long) for rank in plan.value_holders}
        for t in plan.transfers:
            assert t.box.intersect(plan.src_boxes[t.src_rank]) == t.box, (shape, src, dst, t)
            coverage[t.dst_rank][t.box.slices_within(plan.dst_boxes[t.dst_rank])] += 1
        for rank, count in coverage.items():
            assert bool((count == num_contributions).all()), (shape, src, dst, rank)
        assert plan.bytes_moved == minimum, (shape, src, dst)
