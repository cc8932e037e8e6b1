"""The topology object (:mod:`parallel.topology`): every axis size, world size, divisor and the expert rule,
asked of one object; a config's and its resolved plan's topologies agree.

    python -m pytest tests/unit/test_topology.py -q -n 0
"""

from __future__ import annotations

import pytest

from parallel.config import ParallelConfig
from parallel.placements import PlacementSpec
from parallel.topology import MeshSpec, Topology, mesh_shape_of, mesh_world_size, shard_axes_of
from trainer.cli.main import _starts_workers
from trainer.config.compose import compose_dict
from trainer.validate.checks import validate_with_plan

SHARD0, SHARD1, REPLICATE = PlacementSpec("shard", 0), PlacementSpec("shard", 1), PlacementSpec("replicate")
EXPERT, DENSE = "layers.0.mlp.experts.w1", "layers.0.attn.wq.weight"


@pytest.mark.parametrize("mesh, shape, world", [
    ([2, 2, 2], (2, 2, 2), 8), ([8], (8,), 8), (None, (1,), 1),
    ([[2, 4, 5], [0, 1, 3]], (2, 3), 6), ([[[0, 1]]], (1, 1, 2), 2),
    ([[[3, 0], [1, 2]], [[7, 4], [5, 6]]], (2, 2, 2), 8)])
def test_world_size_of_a_mesh_value_counts_every_rank_id(mesh, shape, world):
    assert mesh_shape_of(mesh) == shape
    assert mesh_world_size(mesh) == world


def test_a_nested_mesh_of_two_ids_starts_workers():
    # [[[0, 1]]] was counted as one rank (one row at the top level) and so as no launch
    assert _starts_workers({"mesh": [[[0, 1]]]}) is True
    assert _starts_workers({"mesh": [[[0]]]}) is False
    assert _starts_workers({"mesh": [1, 1]}) is False
    assert _starts_workers({"mesh": [2, 2], "dry_run": True}) is False


def test_mesh_sizes_count_an_absent_axis_as_one():
    mesh = MeshSpec((2, 3, 4), ("dp", "pp", "tp"))
    sizes = (mesh.world_size, mesh.size("pp"), mesh.size(["dp", "tp"]), mesh.size(["ep"]), mesh.size([]))
    assert sizes == (24, 3, 8, 1, 1)


@pytest.mark.parametrize("mode, axes, shard", [
    ("ddp", ("dp",), ()), ("zero1", ("dp", "cp"), ()), ("fsdp", ("dp", "cp"), ("dp", "cp")),
    ("zero2", ("dp",), ("dp",)),
    ("hsdp", ("dp_replicate", "dp_shard", "cp"), ("dp_shard", "cp"))])
def test_what_each_data_parallel_mode_shards_over(mode, axes, shard):
    assert shard_axes_of(mode, axes) == shard


def _config_topology(mesh: list, parallel: dict) -> Topology:
    return Topology.of_config(mesh, ParallelConfig.model_validate(parallel))


def test_3d_sizes():
    topo = _config_topology([2, 3, 4], {"dims": ["dp", "pp", "tp"], "data_parallel": {"dim": "dp", "mode": "fsdp"},
                                         "pipeline": {"dim": "pp"}, "tensor_parallel": {"dim": "tp"}})
    assert (topo.world_size, topo.dp_size, topo.pp_size, topo.cp_size, topo.ep_size) == (24, 2, 3, 1, 1)
    assert (topo.replicas, topo.repeats) == (8, 4)  # 8 ranks hold a stage; the 4 tp ranks of a replica see its rows
    assert topo.shard_axes == ("dp",) and topo.batch_axes == ("dp",)


def test_per_stage_layouts_split_the_batch_over_the_lanes():
    topo = _config_topology([4], {"dims": ["pp"], "pipeline": {"dim": "pp", "stages": [
        {"ranks": [0, 1], "dims": ["dp"], "data_parallel": {"dim": "dp", "mode": "fsdp"}},
        {"ranks": [2, 3], "dims": ["tp"]}]}})
    assert (topo.world_size, topo.dp_size, topo.pp_size, topo.replicas, topo.repeats) == (4, 2, 2, 2, 1)


def test_context_parallel_ranks_shard_parameters_like_data_parallel_ones():
    alone = _config_topology([4], {"dims": ["cp"], "context_parallel": {"dim": "cp"}})
    assert (alone.param_dp_mode, alone.param_dp_axes, alone.shard_axes, alone.dp_size, alone.cp_size) == \
        ("fsdp", ("cp",), ("cp",), 1, 4)
    assert alone.repeats == 1
    hsdp = _config_topology([2, 2, 2], {"dims": ["dp_replicate", "dp_shard", "cp"], "context_parallel": {"dim": "cp"},
                                        "data_parallel": {"dim": ["dp_replicate", "dp_shard"], "mode": "hsdp"}})
    assert hsdp.shard_axes == ("dp_shard", "cp") and hsdp.dp_size == 4 and hsdp.fsdp_divisor(DENSE) == 4


def _expert_topology(mode: str | None, dims=("dp", "ep", "tp"), shape=(2, 4, 2)) -> Topology:
    dp_axes = tuple(a for a in dims if a.startswith("dp"))
    return Topology(MeshSpec(shape, dims), dp_axes=dp_axes if mode else (), dp_mode=mode, ep_axis="ep",
                    expert_modules=("layers.0.mlp.experts",), tp_axes=("tp",))


def test_an_expert_is_split_over_ep_and_sharded_over_dp_alone():
    topo = _expert_topology("fsdp")
    assert topo.expert_prefixes == ("layers.0.mlp.experts.",)
    assert topo.is_expert(EXPERT) and not topo.is_expert(DENSE) and not topo.is_expert("layers.0.mlp.expertsX.w1")
    assert topo.placed(EXPERT, {}) == {"ep": SHARD0}
    assert topo.local_divisor(EXPERT, {}) == 4 and topo.fsdp_axes(EXPERT) == ("dp",) and topo.fsdp_divisor(EXPERT) == 2
    # the rest: tp's shards, then FSDP over dp x ep (the ep ranks hold other rows of the batch)
    assert topo.placed(DENSE, {"tp": SHARD0}) == {"tp": SHARD0}
    assert topo.local_divisor(DENSE, {"tp": SHARD0}) == 2 and topo.local_divisor(DENSE, {"tp": REPLICATE}) == 1
    assert topo.fsdp_axes(DENSE) == ("dp", "ep") and topo.fsdp_divisor(DENSE) == 8
    assert (topo.dp_size, topo.batch_axes, topo.repeats) == (8, ("dp", "ep"), 2)


def test_the_expert_rule_under_hsdp_zero2_and_without_data_parallelism():
    hsdp = _expert_topology("hsdp", dims=("dp_replicate", "dp_shard", "ep"), shape=(2, 2, 4))
    assert hsdp.fsdp_axes(DENSE) == ("dp_shard", "ep") and hsdp.fsdp_axes(EXPERT) == ("dp_shard",)
    assert _expert_topology("zero2").fsdp_axes(DENSE) == ("dp", "ep")
    alone = _expert_topology(None)  # ep alone: the rest replicated over it, nothing sharded by FSDP
    assert alone.fsdp_axes(DENSE) == () and alone.fsdp_divisor(DENSE) == 1 and alone.local_divisor(EXPERT, {}) == 4
    no_ep = Topology(MeshSpec((2, 2), ("dp", "tp")), dp_axes=("dp",), dp_mode="fsdp",
                     expert_modules=("layers.0.mlp.experts",))
    assert not no_ep.is_expert(EXPERT) and no_ep.local_divisor(EXPERT, {"tp": SHARD1}) == 2


@pytest.mark.parametrize("overrides, sizes", [
    (["+parallel=3d", "mesh=[2,2,2]"], (8, 2, 2, 1, 1, 2)),
    (["+parallel=3d_ep", "mesh=[2,2,2]", "model=gpt_moe"], (8, 4, 1, 1, 2, 2)),
    (["+parallel=fsdp_cp", "mesh=[2,2]"], (4, 2, 1, 2, 1, 1))])
def test_a_config_and_its_plan_have_one_topology(overrides, sizes):
    """(world, dp, pp, cp, ep, tp) of the config before resolution and of its plan after; the plan's knows its
    experts and tensor-parallel axes too."""
    cfg, plan = validate_with_plan(compose_dict([*overrides, "tracking=none"]))
    before, after = cfg.topology, plan.topology
    assert (after.world_size, after.dp_size, after.pp_size, after.cp_size, after.ep_size, after.tp_size) == sizes
    assert (before.world_size, before.dp_size, before.pp_size, before.cp_size, before.ep_size) == sizes[:5]
    assert (cfg.world_size, cfg.dp_size, cfg.pp_size) == (plan.topology.world_size, plan.dp_size, plan.pp_size)
    assert bool(after.expert_modules) == (after.ep_size > 1)
