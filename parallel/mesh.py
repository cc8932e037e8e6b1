"""Device meshes: the named axes every other part of the engine refers to.

A mesh is given by its shape, outermost axis first, and one name per axis (``dims``). Its
positions are torch's ranks 0..n-1 in row-major order, always:

    mesh = build_mesh((2, 2, 2), ("dp", "pp", "tp"))          # ranks 0..7 row-major
    tp_mesh = submesh(mesh, ["tp"])                             # 1-D, for parallelize_module
    dp_mesh = submesh(mesh, ["dp_replicate", "dp_shard"])       # several axes -> one flattened axis

Explicit rank ids, as in PaddlePaddle's ``ProcessMesh([[2, 4, 5], [0, 1, 3]])``, are labels:
a rank id names the process slot (the device, or the CPU) a worker runs on, not its torch rank.
The launcher numbers workers by position, so the worker at row-major position ``r`` has torch
rank ``r`` and rank id ``flat_ids[r]`` (:func:`rank_id_of`), and it binds to the device its id
names (:func:`device_slot`). Built over ranks in any other order, a mesh would break DTensor:
``new_group`` sorts its members, so along an axis whose ids decrease the group rank and the mesh
coordinate (which cuts the shards) would disagree.

    rank_id_of([[2, 4, 5], [0, 1, 3]], 3)                       # 0: torch rank 3 is the worker with id 0

A sub-mesh over some of the world's torch ranks (a pipeline stage's) is ``build_mesh(..., rank_ids=...)``
with ranks increasing along every axis. Every rank of the default process group must call
:func:`build_mesh` (DeviceMesh creates its subgroups collectively), also for a sub-mesh it is
not in.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# Re-exported: the worker binds by them.
from parallel.topology import flat_rank_ids as flat_rank_ids, rank_id_of as rank_id_of

# Sub-meshes made once per (mesh, axes): the engine asks for the same axis for every module.
_SUBMESHES: weakref.WeakKeyDictionary[DeviceMesh, dict[tuple[str, ...], DeviceMesh]] = weakref.WeakKeyDictionary()


def build_mesh(
    mesh_shape: Sequence[int],
    dim_names: Sequence[str],
    *,
    rank_ids: Sequence[Any] | None = None,
    device_type: str = "cpu",
) -> DeviceMesh:
    """The ``DeviceMesh`` of ``mesh_shape`` with axes named ``dim_names``.

    Args:
        mesh_shape: axis sizes, outermost first; their product is the number of ranks.
        dim_names: one unique name per axis.
        rank_ids: the torch ranks of a sub-mesh (a pipeline stage's), nested like ``mesh_shape``
            and increasing along every axis (see :func:`unordered_axes`); default: the whole
            world, ``0 .. n-1`` row-major. Not a config's explicit ``mesh`` ids: those are
            device labels, and their mesh is the whole world in order.
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (nccl).
    """
    mesh_shape, dim_names = tuple(int(s) for s in mesh_shape), tuple(dim_names)
    if len(mesh_shape) != len(dim_names):
        raise ValueError(f"mesh shape {list(mesh_shape)} has {len(mesh_shape)} axes but {len(dim_names)} names "
                         f"{list(dim_names)}")
    if len(set(dim_names)) != len(dim_names):
        raise ValueError(f"mesh axis names must be unique, got {list(dim_names)}")
    if rank_ids is None:
        return init_device_mesh(device_type, mesh_shape, mesh_dim_names=dim_names)
    ids = torch.tensor(rank_ids, dtype=torch.int)
    if tuple(ids.shape) != mesh_shape:
        raise ValueError(f"rank ids of shape {list(ids.shape)} do not match the mesh shape {list(mesh_shape)}")
    if sorted(ids.flatten().tolist()) != sorted(set(ids.flatten().tolist())):
        raise ValueError(f"rank ids {rank_ids} repeat a rank")
    if bad := unordered_axes(ids, dim_names):
        raise ValueError(
            f"mesh ranks {rank_ids}: along axis {bad[0]!r} the ranks are not in increasing order. torch "
            "orders the members of each axis's process group by global rank, while DTensor cuts shards by mesh "
            "position, so collectives would assemble shards in the wrong order. List every axis's ranks in "
            "increasing order (e.g. swap rows/columns of the nested list)"
        )
    return DeviceMesh(device_type, ids, mesh_dim_names=dim_names)


def unordered_axes(rank_ids: torch.Tensor, dim_names: Sequence[str]) -> list[str]:
    """Axes along which some line of ``rank_ids`` (torch ranks) is not increasing.

    ``torch.distributed.new_group`` sorts its ranks, so the group rank of a process along an axis
    is its position in *sorted* order, while ``DeviceMesh.get_coordinate`` (which DTensor uses to
    cut a tensor) is its position in the nested list. They agree only if every line is increasing:
    ``[[2, 4, 5], [0, 1, 3]]`` as torch ranks has columns ``[2, 0]``, ``[4, 1]``, ``[5, 3]``.
    """
    bad = []
    for axis, name in enumerate(dim_names):
        lines = rank_ids.movedim(axis, -1).reshape(-1, rank_ids.shape[axis])
        if bool((lines[:, 1:] <= lines[:, :-1]).any()):
            bad.append(name)
    return bad


def device_slot(rank_id: int, num_slots: int) -> int:
    """The slot a rank id names among a host's ``num_slots`` (its GPUs, its workers, or the CPUs
    it may use): ``rank_id % num_slots``, so ids past the slots share them round-robin."""
    return rank_id % num_slots


def submesh(mesh: DeviceMesh, names: str | Sequence[str], *, flatten: bool = True) -> DeviceMesh:
    """The sub-mesh over the axes ``names``: ``mesh[name]`` for one axis; for several, those
    axes flattened into one (e.g. HSDP's ``("dp_replicate", "dp_shard")`` as one dp group), or
    kept as a 2-D sub-mesh with ``flatten=False``. Made once per mesh and axes, then reused."""
    key = (*([names] if isinstance(names, str) else names), "" if flatten else "2d")
    cache = _SUBMESHES.setdefault(mesh, {})
    if key not in cache:
        cache[key] = _submesh(mesh, list(key[:-1]), flatten=flatten)
    return cache[key]


def hsdp_mesh(mesh: DeviceMesh, names: Sequence[str]) -> DeviceMesh:
    """HSDP's 2-D mesh of ``names`` = ``[replicate_axis, shard_axis, *more]``: the replicate axis, then
    the shard axes flattened into one (a cp axis folded into the shard axis: ``dp_shard_cp``)."""
    replicate, *shard = names
    if len(shard) == 1:
        return submesh(mesh, names, flatten=False)
    key = (*names, "hsdp")
    cache = _SUBMESHES.setdefault(mesh, {})
    if key not in cache:
        # Slicing a flattened axis from the root mesh is deprecated in torch: the two 1-D meshes are
        # joined instead (their layouts index the same root mesh).
        cache[key] = DeviceMesh._concatenate([submesh(mesh, replicate), submesh(mesh, shard)])
    return cache[key]


def _submesh(mesh: DeviceMesh, names: list[str], *, flatten: bool) -> DeviceMesh:
    unknown = [n for n in names if n not in (mesh.mesh_dim_names or ())]
    if unknown:
        raise ValueError(f"mesh has no axis {unknown}; its axes are {list(mesh.mesh_dim_names or ())}")
    if list(mesh.mesh_dim_names or ()) == names and (mesh.ndim == 1 or not flatten):
        return mesh
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[tuple(names)]._flatten("_".join(names)) if flatten else mesh[tuple(names)]


def axis_rank(mesh: DeviceMesh | None, names: str | Sequence[str]) -> int:
    """This rank's row-major coordinate over the axes ``names`` (0 when absent)."""
    if mesh is None:
        return 0
    names = [names] if isinstance(names, str) else list(names)
    dims = list(mesh.mesh_dim_names or ())
    rank = 0
    for n in names:
        if n in dims:
            rank = rank * mesh.size(dims.index(n)) + mesh.get_local_rank(n)
    return rank
