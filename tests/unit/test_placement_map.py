"""The placement map: which rank holds which slice of every parameter, computed from the plan
alone (no process group). Its agreement with the engine's real shards, for every seed example
and for FSDP's uneven and strided shards, is held by tests/dist/test_examples.py.

    python -m pytest tests/unit/test_placement_map.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from parallel.config import ParallelConfig
from parallel.plan.placement_map import group_name, param_slices, placement_groups, stage_grids
from parallel.plan.resolve import resolve_plan


class Raw(nn.Module):
    """Raw parameters of the given shapes, each its own pipeline unit (as the seeds' MLP)."""

    def __init__(self, **shapes: tuple[int, ...]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(shape, device="meta")))


class Blocks(nn.Module):
    """``layers.0 .. layers.3``, each with a weight ``w`` [8, 4] and a bias ``b`` [8]."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Raw(w=(8, 4), b=(8,)) for _ in range(4))


def slices(parallel: dict, mesh, model: nn.Module) -> dict:
    plan = resolve_plan(ParallelConfig.model_validate(parallel), mesh, model)
    return param_slices(plan, {n: tuple(p.shape) for n, p in model.named_parameters()})


def assert_tiles(shape: tuple[int, ...], held: dict) -> None:
    """Every element is covered equally often (once per replica group), and ranges are in bounds."""
    count = np.zeros(shape, dtype=int)
    for sl in held.values():
        assert all(0 <= a <= b <= n for (a, b), n in zip(sl, shape)), sl
        count[tuple(slice(a, b) for a, b in sl)] += 1
    assert count.min() == count.max() > 0, count


def test_tp_shard_0_and_1_over_four_ranks():
    held = slices({"dims": ["tp"], "placements": {"a": {"tp": "Shard(0)"}, "b": {"tp": "Shard(1)"}}}, [4],
                  Raw(a=(8, 6), b=(6, 12)))
    assert dict(held["a"].slices) == {r: ((2 * r, 2 * r + 2), (0, 6)) for r in range(4)}
    assert dict(held["b"].slices) == {r: ((0, 6), (3 * r, 3 * r + 3)) for r in range(4)}
    assert dict(held["a"].placements) == {"tp": "Shard(0)"}
    for p in held.values():
        assert_tiles(p.shape, p.slices)


@pytest.mark.parametrize("mode", ["fsdp", "zero2"])
def test_fsdp_chunks_dim_0_like_torch_chunk(mode):
    """5 rows over 4 ranks: torch.chunk gives 2, 2, 1 and the last rank an empty shard; a 1-D
    parameter is sharded too, the [3, 2] one leaves rank 3 empty as well (chunks of 1)."""
    held = slices({"dims": ["dp"], "data_parallel": {"dim": "dp", "mode": mode}}, [4],
                  Raw(w=(5, 3), v=(10,), u=(3, 2)))
    assert [held["w"].slices[r] for r in range(4)] == [((0, 2), (0, 3)), ((2, 4), (0, 3)), ((4, 5), (0, 3)),
                                                       ((5, 5), (0, 3))]
    assert [held["v"].slices[r] for r in range(4)] == [((0, 3),), ((3, 6),), ((6, 9),), ((9, 10),)]
    assert [held["u"].slices[r][0] for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 3)]
    assert dict(held["w"].placements) == {"dp": "Shard(0)"}
    for p in held.values():
        assert_tiles(p.shape, {r: s for r, s in p.slices.items() if all(b > a for a, b in s)})


def test_ddp_replicates():
    held = slices({"dims": ["dp"], "data_parallel": {"dim": "dp", "mode": "ddp"}}, [2], Raw(w=(5, 3)))
    assert dict(held["w"].slices) == {0: ((0, 5), (0, 3)), 1: ((0, 5), (0, 3))}
    assert dict(held["w"].placements) == {"dp": "Replicate()"}


def test_fsdp_with_tp_on_the_same_dim_cuts_each_tp_shard():
    """dp x tp = 2 x 2, tp Shard(0) on [8, 4]: tp half t is rows 4t..4t+4, FSDP takes dp's chunk
    of it (torch's _StridedShard), so ranks 0, 2 hold rows 0:2, 2:4 and ranks 1, 3 rows 4:6, 6:8.
    Another dim's tp shard combines with FSDP's rows as blocks."""
    held = slices({"dims": ["dp", "tp"], "data_parallel": {"dim": "dp", "mode": "fsdp"},
                   "placements": {"a": {"tp": "Shard(0)"}, "b": {"tp": "Shard(1)"}}}, [2, 2], Raw(a=(8, 4), b=(8, 4)))
    assert [held["a"].slices[r][0] for r in range(4)] == [(0, 2), (4, 6), (2, 4), (6, 8)]
    assert [held["b"].slices[r] for r in range(4)] == [((0, 4), (0, 2)), ((0, 4), (2, 4)), ((4, 8), (0, 2)),
                                                       ((4, 8), (2, 4))]
    assert dict(held["a"].placements) == {"dp": "Shard(0)", "tp": "Shard(0)"}
    for p in held.values():
        assert_tiles(p.shape, p.slices)


def test_ddp_with_tp_replicates_each_shard_over_dp():
    held = slices({"dims": ["dp", "tp"], "data_parallel": {"dim": "dp", "mode": "ddp"},
                   "placements": {"a": {"tp": "Shard(1)"}}}, [2, 2], Raw(a=(4, 6)))
    assert [held["a"].slices[r] for r in range(4)] == [((0, 4), (0, 3)), ((0, 4), (3, 6))] * 2
    assert_tiles((4, 6), held["a"].slices)  # each element twice: two replica groups


def test_hsdp_shards_over_the_inner_axis_only():
    held = slices({"dims": ["rep", "shard"], "data_parallel": {"dim": ["rep", "shard"], "mode": "hsdp"}}, [2, 2],
                  Raw(w=(6, 2)))
    assert [held["w"].slices[r][0] for r in range(4)] == [(0, 3), (3, 6), (0, 3), (3, 6)]
    assert dict(held["w"].placements) == {"rep": "Replicate()", "shard": "Shard(0)"}


def test_uniform_pipeline_stage_ranks_hold_their_stage_only():
    """pp x tp = 2 x 2, cut before layers.2: stage 0 on ranks 0, 1 (pp coordinate 0), stage 1 on 2, 3."""
    parallel = {"dims": ["pp", "tp"], "placements": {"layers.*.w": {"tp": "Shard(0)"}},
                "pipeline": {"dim": "pp", "boundaries": ["layers.2"], "microbatches": 2}}
    held = slices(parallel, [2, 2], Blocks())
    assert dict(held["layers.1.w"].slices) == {0: ((0, 4), (0, 4)), 1: ((4, 8), (0, 4))}
    assert dict(held["layers.3.w"].slices) == {2: ((0, 4), (0, 4)), 3: ((4, 8), (0, 4))}
    assert dict(held["layers.3.b"].slices) == {2: ((0, 8),), 3: ((0, 8),)}
    assert (held["layers.1.w"].stage, held["layers.3.w"].stage) == (0, 1)


def test_interleaved_stages_share_their_pp_rank_grid():
    parallel = {"dims": ["pp"], "pipeline": {"dim": "pp", "schedule": "Interleaved1F1B", "stages_per_rank": 2,
                                             "boundaries": ["layers.1", "layers.2", "layers.3"], "microbatches": 2}}
    model = Blocks()
    grids = stage_grids(resolve_plan(ParallelConfig.model_validate(parallel), [2], model))
    assert [g.ranks for g in grids] == [(0,), (1,), (0,), (1,)]
    held = slices(parallel, [2], model)
    assert [set(held[f"layers.{i}.w"].slices) for i in range(4)] == [{0}, {1}, {0}, {1}]


def test_per_stage_layouts_place_each_stage_on_its_own_ranks():
    """Paddle's 3-D example in small: stage 0 on [[0,1],[2,3]] (dp x mp, w0 Shard(1) on mp), stage 1
    on [[4,5],[6,7]] (w1 Shard(0) on mp); dp replicates; ranks of the other stage hold nothing."""
    stage = lambda ranks, placements: {"ranks": ranks, "dims": ["dp", "mp"], "placements": placements,  # noqa: E731
                                       "data_parallel": {"dim": "dp", "mode": "ddp"}}
    parallel = {"dims": ["pp"], "pipeline": {"dim": "pp", "boundaries": ["w1"], "microbatches": 2, "stages": [
        stage([[0, 1], [2, 3]], {"w0": {"mp": "Shard(1)"}}), stage([[4, 5], [6, 7]], {"w1": {"mp": "Shard(0)"}})]}}
    held = slices(parallel, [8], Raw(w0=(4, 8), w1=(8, 4)))
    assert dict(held["w0"].slices) == {0: ((0, 4), (0, 4)), 1: ((0, 4), (4, 8)), 2: ((0, 4), (0, 4)),
                                       3: ((0, 4), (4, 8))}
    assert dict(held["w1"].slices) == {4: ((0, 4), (0, 4)), 5: ((4, 8), (0, 4)), 6: ((0, 4), (0, 4)),
                                       7: ((4, 8), (0, 4))}
    assert dict(held["w1"].placements) == {"dp": "Replicate()", "mp": "Shard(0)"}
    for p in held.values():
        assert_tiles(p.shape, p.slices)


def test_explicit_rank_ids_label_the_grid():
    plan = resolve_plan(ParallelConfig.model_validate({"dims": ["x", "y"], "placements": {"w": {"x": "Shard(0)"}}}),
                        [[2, 4, 5], [0, 1, 3]], Raw(w=(4, 3)))
    (grid,) = stage_grids(plan)
    assert (grid.ranks, grid.labels, grid.shape) == ((0, 1, 2, 3, 4, 5), ("2", "4", "5", "0", "1", "3"), (2, 3))


def test_groups_merge_the_blocks_of_one_role_per_stage():
    assert group_name("layers.12.attn.wq.weight") == "layers.*.attn.wq.weight"
    parallel = {"dims": ["pp", "tp"], "placements": {"layers.*.w": {"tp": "Shard(1)"}},
                "pipeline": {"dim": "pp", "boundaries": ["layers.2"], "microbatches": 2}}
    model = Blocks()
    plan = resolve_plan(ParallelConfig.model_validate(parallel), [2, 2], model)
    groups = placement_groups(plan, {n: tuple(p.shape) for n, p in model.named_parameters()})
    assert [(g.name, g.stage, g.params) for g in groups] == [
        ("layers.*.w", 0, ("layers.0.w", "layers.1.w")), ("layers.*.b", 0, ("layers.0.b", "layers.1.b")),
        ("layers.*.w", 1, ("layers.2.w", "layers.3.w")), ("layers.*.b", 1, ("layers.2.b", "layers.3.b"))]
    assert dict(groups[2].slices) == {2: ((0, 8), (0, 2)), 3: ((0, 8), (2, 4))}


def test_one_device_holds_everything():
    plan = resolve_plan(None, None, Raw(w=(3, 2)))
    held = param_slices(plan, {"w": (3, 2)})
    assert dict(held["w"].slices) == {0: ((0, 3), (0, 2))} and dict(held["w"].placements) == {}
