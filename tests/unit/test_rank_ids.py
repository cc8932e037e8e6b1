"""Explicit mesh rank ids (PaddlePaddle's ``ProcessMesh([[2,4,5],[0,1,3]])``) in any order.

A rank id is a label: it names the device (or CPU core) a worker runs on. Torch's rank is the
position in the row-major flattened mesh, so the engine's mesh is always ordered. These tests
hold the mapping, its validation, the dry run's display and the worker's binding (the
multi-process checks are in tests/dist: test_examples.py and test_parallel.py).

    python -m pytest tests/unit/test_rank_ids.py -q
"""

from __future__ import annotations

import os

import pytest

from parallel.mesh import device_slot, flat_rank_ids, rank_id_of
from parallel.plan.spec import MeshSpec
from trainer.config.compose import compose_dict
from trainer.launch.worker import bind_worker
from trainer.planner.report import describe_plan
from trainer.validate.checks import validate_config, validate_with_plan

PADDLE = [[2, 4, 5], [0, 1, 3]]


def test_torch_rank_is_the_row_major_position():
    assert flat_rank_ids(PADDLE) == [2, 4, 5, 0, 1, 3]
    assert [rank_id_of(PADDLE, r) for r in range(6)] == [2, 4, 5, 0, 1, 3]
    assert flat_rank_ids([[[3, 0], [1, 2]], [[7, 4], [5, 6]]]) == [3, 0, 1, 2, 7, 4, 5, 6]
    assert [rank_id_of(None, r) for r in range(3)] == [0, 1, 2]  # a plain shape: the id is the rank
    assert MeshSpec((2, 3), ("x", "y"), PADDLE).rank_id(3) == 0
    with pytest.raises(ValueError, match="torch rank 6 is outside the mesh of 6 rank ids"):
        rank_id_of(PADDLE, 6)


def test_an_id_names_its_slot_round_robin():
    assert [device_slot(i, 2) for i in range(6)] == [0, 1, 0, 1, 0, 1]
    assert [device_slot(i, 8) for i in (2, 4, 5, 0, 1, 3)] == [2, 4, 5, 0, 1, 3]


@pytest.mark.parametrize("preset, mesh, shape", [
    ("2d", "[[3,1],[2,0]]", (2, 2)), ("hsdp", "[[1,3,5,7],[0,2,4,6]]", (2, 4)), ("2d", "[[0,2],[1,3]]", (2, 2))])
def test_any_permutation_validates(preset, mesh, shape):
    """Ids decreasing along an axis were refused while the mesh was built over them; now they
    only label devices, so every permutation of 0..n-1 is a valid mesh (the 2x3 Paddle mesh:
    conf/examples/unordered_rank_ids.yaml, validated by tests/conf/test_presets.py)."""
    cfg = validate_config(compose_dict([f"+parallel={preset}", f"mesh={mesh}", "tracking=none"]))
    assert cfg.mesh_shape == shape and cfg.mesh == [list(map(int, row.split(","))) for row in mesh[2:-2].split("],[")]


def test_dry_run_shows_the_ids_as_written_and_the_torch_ranks():
    cfg, plan = validate_with_plan(compose_dict(["+examples=unordered_rank_ids", "tracking=none"]))
    assert plan.mesh.rank_ids == PADDLE and plan.mesh.shape == (2, 3)
    line = describe_plan(cfg, plan).splitlines()[1]
    assert line.startswith("rank ids [[2, 4, 5], [0, 1, 3]]: ")
    assert line.endswith("torch rank -> id by row-major position: 0->2, 1->4, 2->5, 3->0, 4->1, 5->3")
    plain_cfg, plain_plan = validate_with_plan(compose_dict(["+parallel=2d", "tracking=none"]))
    assert "rank ids" not in describe_plan(plain_cfg, plain_plan)


def test_worker_binds_to_the_cpu_its_id_names(monkeypatch):
    """With ids every thread of the worker is pinned to the id-th allowed CPU (modulo); the GPU
    index (unused on CPU) is the id modulo the host's workers. A plain mesh pins nothing."""
    pinned: list[tuple[int, set]] = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: pinned.append((pid, set(cpus))))
    allowed = sorted(os.sched_getaffinity(0))
    cfg = validate_config(compose_dict(["+examples=unordered_rank_ids", "tracking=none", "device=cpu"]))
    assert bind_worker(cfg, 3, 3, 6) == (0, 0)
    assert pinned and {pid for pid, _ in pinned} >= {0} and all(c == {allowed[0]} for _, c in pinned)
    pinned.clear()
    assert bind_worker(cfg, 5, 5, 6) == (3, 3)
    assert all(c == {allowed[3 % len(allowed)]} for _, c in pinned)
    pinned.clear()
    plain = validate_config(compose_dict(["+parallel=2d", "tracking=none", "device=cpu"]))
    assert bind_worker(plain, 3, 1, 2) == (3, 1) and pinned == []


def test_a_sub_mesh_of_torch_ranks_must_increase_along_every_axis():
    """``build_mesh(rank_ids=...)`` takes torch ranks (a pipeline stage's sub-mesh), not labels:
    a decreasing axis would make DTensor's coordinate and the sorted group rank disagree, so it is
    refused before any process group is touched."""
    from parallel.mesh import build_mesh

    with pytest.raises(ValueError, match="along axis 'x' the ranks are not in increasing order"):
        build_mesh((2, 3), ("x", "y"), rank_ids=PADDLE)
    with pytest.raises(ValueError, match="repeat a rank"):
        build_mesh((2,), ("x",), rank_ids=[1, 1])
