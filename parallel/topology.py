"""The topology of a run: the one object that answers every question about mesh axes and their sizes.

A mesh value (a shape, or nested explicit rank ids) gives a :class:`MeshSpec`; the axes' roles (which
axes the batch, the parameters, the pipeline, the sequence and the experts are split over) make it a
:class:`Topology`. Everything else asks these two, as torchtitan's ``ParallelDims`` is asked; nothing
else multiplies axis sizes:

    mesh_world_size([[2, 4, 5], [0, 1, 3]])                      # 6: explicit rank ids, one per worker
    topo = plan.topology                                          # or cfg.topology, before resolution
    topo.world_size, topo.dp_size, topo.pp_size, topo.cp_size, topo.ep_size, topo.tp_size
    topo.local_divisor("layers.0.mlp.experts.w1", {"tp": Shard(0)})   # tp x ep: this rank holds 1/that
    topo.fsdp_axes("tok_embeddings.weight")                       # ("dp", "ep"): FSDP shards it over dp x ep

No torch here: the command line and the control plane ask sizes of configs they have not resolved.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from parallel.placements import PlacementSpec, sharding_axes

# ------------------------------------------------------------------------------ raw mesh values


def mesh_shape_of(mesh: Any) -> tuple[int, ...]:
    """Shape of a mesh value: a flat list is the shape; a nested list is rank ids, shaped as nested."""
    if mesh is None:
        return (1,)
    if mesh and all(isinstance(x, int) for x in mesh):
        return tuple(mesh)
    shape: list[int] = []
    node = mesh
    while isinstance(node, list):
        shape.append(len(node))
        node = node[0] if node else None
    return tuple(shape)


def mesh_rank_ids(mesh: Any) -> list[Any] | None:
    """The explicit nested rank ids of a mesh value, or None when it is a plain shape."""
    if mesh is None or all(isinstance(x, int) for x in mesh):
        return None
    return list(mesh)


def mesh_world_size(mesh: Any) -> int:
    """Workers a mesh value starts: the product of its shape (``[2, 4]``: 8; ``[[[0, 1]]]``: 2; None: 1)."""
    return math.prod(mesh_shape_of(mesh))


def flat_rank_ids(rank_ids: Sequence[Any]) -> list[int]:
    """Nested rank ids flattened row-major: element ``r`` is the id of the worker whose torch
    rank is ``r`` (``[[2, 4, 5], [0, 1, 3]]`` -> ``[2, 4, 5, 0, 1, 3]``)."""
    return [i for node in rank_ids for i in (flat_rank_ids(node) if isinstance(node, Sequence) else [int(node)])]


def rank_id_of(rank_ids: Sequence[Any] | None, rank: int) -> int:
    """The rank id of the worker whose torch rank is ``rank`` (see :func:`flat_rank_ids`), or
    ``rank`` itself when there are no explicit ids (a plain mesh shape)."""
    if rank_ids is None:
        return rank
    ids = flat_rank_ids(rank_ids)
    if not 0 <= rank < len(ids):
        raise ValueError(f"torch rank {rank} is outside the mesh of {len(ids)} rank ids {rank_ids}")
    return ids[rank]


def shard_axes_of(mode: str, dim_names: Sequence[str]) -> tuple[str, ...]:
    """The axes data parallelism in ``mode`` shards parameters over: all its axes (fsdp, zero2), hsdp's
    after its replicate axis (its shard axis, and a cp axis folded in), none for ddp and zero1 (which shards
    only the optimizer's state)."""
    return {"ddp": (), "zero1": (), "hsdp": tuple(dim_names[1:])}.get(mode, tuple(dim_names))


# ------------------------------------------------------------------------------ the mesh


@dataclass(frozen=True)
class MeshSpec:
    """Axis sizes (outermost first), their names, and optional nested explicit rank ids.

    The mesh's positions are torch ranks ``0 .. n-1`` row-major whatever ``rank_ids`` says; a
    rank id (PaddlePaddle's process id) only names the device the worker at that position runs
    on (:func:`rank_id_of`)."""

    shape: tuple[int, ...] = (1,)
    dim_names: tuple[str, ...] = ()
    rank_ids: Any = None

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def rank_id(self, rank: int) -> int:
        """The rank id of the worker whose torch rank is ``rank`` (``rank`` itself without explicit ids)."""
        return rank_id_of(self.rank_ids, rank)

    @property
    def axis_sizes(self) -> dict[str, int]:
        """``{axis name: its size}`` of every named axis, for a caller that reads many of them."""
        return dict(zip(self.dim_names, self.shape))

    def size(self, names: str | Sequence[str]) -> int:
        """Product of the sizes of the axes ``names`` (an axis the mesh lacks counts 1)."""
        names = [names] if isinstance(names, str) else list(names)
        return math.prod(self.shape[self.dim_names.index(n)] for n in names if n in self.dim_names)


# ------------------------------------------------------------------------------ the topology


@dataclass(frozen=True)
class Topology:
    """A mesh and what each of its axes splits.

    Attributes:
        mesh: shape, axis names, explicit rank ids.
        dp_axes, dp_mode: the data-parallel axes as written and their mode (ddp | fsdp | zero2 | hsdp).
        pp_axis: the axis a pipeline's stages lie along.
        cp_axis: the axis every sequence is split over (its ranks also shard parameters, as dp ranks).
        ep_axis, expert_modules: the axis the stacked experts are split ``Shard(0)`` over, and the modules
            holding them (the batch is split over the axis too).
        tp_axes: the axes some placement shards a parameter over (tensor parallelism).
        depth_axis: 2.5-D tensor parallelism's depth (:mod:`parallel.sharding.tp_grid`): it splits the batch and
            wraps the parameters as a data-parallel axis does (each layer of grids holds the same weight blocks).
        stage_lanes, num_layout_stages: per-stage layouts (``parallel.pipeline.stages``): the ranks of a
            stage (its lanes), and how many stages; 0 without.
    """

    mesh: MeshSpec = MeshSpec()
    dp_axes: tuple[str, ...] = ()
    dp_mode: str | None = None
    pp_axis: str | None = None
    cp_axis: str | None = None
    ep_axis: str | None = None
    expert_modules: tuple[str, ...] = ()
    tp_axes: tuple[str, ...] = ()
    depth_axis: str | None = None
    stage_lanes: int = 0
    num_layout_stages: int = 0

    @classmethod
    def of_config(cls, mesh: Any, parallel: Any) -> Topology:
        """The topology a config's ``mesh`` value and ``parallel`` section (a
        :class:`~parallel.config.ParallelConfig`, or None) describe, before it is resolved against a
        model: no expert modules and no tensor-parallel axes yet (the plan's topology has them)."""
        if parallel is None:
            return cls(MeshSpec(mesh_shape_of(mesh), (), mesh_rank_ids(mesh)))
        dp, pp, cp, ep = parallel.data_parallel, parallel.pipeline, parallel.context_parallel, parallel.expert_parallel
        stages = (pp.stages if pp is not None else None) or []
        return cls(
            MeshSpec(mesh_shape_of(mesh), tuple(parallel.dims), mesh_rank_ids(mesh)),
            dp_axes=_axes(dp.dim) if dp is not None else (), dp_mode=dp.mode if dp is not None else None,
            pp_axis=pp.dim if pp is not None else None, cp_axis=cp.dim if cp is not None else None,
            ep_axis=ep.dim if ep is not None else None,
            depth_axis=grid.depth if (grid := getattr(parallel, "grid_parallel", None)) is not None else None,
            stage_lanes=len(stages[0].rank_list) if stages else 0, num_layout_stages=len(stages),
        )

    # -- sizes -----------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    def size(self, names: str | Sequence[str]) -> int:
        """Product of the sizes of the axes ``names`` (an axis the mesh lacks counts 1)."""
        return self.mesh.size(names)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The axes the batch is split over: the data-parallel ones, a grid's depth, then the expert-parallel one."""
        return (*self.dp_axes, *((self.depth_axis,) if self.depth_axis else ()),
                *((self.ep_axis,) if self.ep_axis else ()))

    @property
    def dp_size(self) -> int:
        """Ranks the batch is split over (the data-parallel and expert-parallel axes; per-stage layouts: the lanes)."""
        return self.stage_lanes if self.stage_lanes else self.size(self.batch_axes)

    @property
    def pp_size(self) -> int:
        """Pipeline ranks: the pp axis's size (per-stage layouts: the stages)."""
        if self.num_layout_stages:
            return self.num_layout_stages
        return self.size(self.pp_axis) if self.pp_axis else 1

    @property
    def cp_size(self) -> int:
        return self.size(self.cp_axis) if self.cp_axis else 1

    @property
    def ep_size(self) -> int:
        return self.size(self.ep_axis) if self.ep_axis else 1

    @property
    def tp_size(self) -> int:
        """The product of the axes placements shard parameters over (each axis once)."""
        return self.size(self.tp_axes)

    @property
    def replicas(self) -> int:
        """Ranks holding each pipeline stage (the world without a pipeline)."""
        return self.world_size // self.pp_size

    @property
    def repeats(self) -> int:
        """Ranks of one stage that see the same rows (tensor parallelism's): they count a row once."""
        return self.replicas // (self.dp_size * self.cp_size)

    # -- what shards the parameters ------------------------------------------------------

    @property
    def param_dp_axes(self) -> tuple[str, ...]:
        """Data parallelism as it wraps the parameters: the dp axes, then the cp axis, whose ranks hold other
        tokens of the same rows and so average gradients and shard parameters like dp ranks."""
        return (*self.dp_axes, *((self.cp_axis,) if self.cp_axis else ()),
                *((self.depth_axis,) if self.depth_axis else ()))

    @property
    def param_dp_mode(self) -> str | None:
        """The mode of :attr:`param_dp_axes`: the dp mode; fsdp over cp alone when there is no dp."""
        if self.dp_mode is not None:
            return self.dp_mode
        if self.cp_axis:
            return "fsdp"
        return "ddp" if self.depth_axis else None  # Tesseract: every layer of grids holds the weights whole

    @property
    def shard_axes(self) -> tuple[str, ...]:
        """The axes FSDP shards every parameter over (the experts' beside: :meth:`fsdp_axes`)."""
        mode = self.param_dp_mode
        return shard_axes_of(mode, self.param_dp_axes) if mode is not None else ()

    @property
    def optimizer_divisor(self) -> int:
        """Into how many shards the optimizer's state is cut beyond the parameters' own: zero1 shards it over
        :attr:`param_dp_axes` while the parameters stay whole there; 1 for every other mode (the state follows
        the parameters, sharded or not)."""
        return self.size(self.param_dp_axes) if self.param_dp_mode == "zero1" else 1

    @property
    def expert_prefixes(self) -> tuple[str, ...]:
        """``"<module>."`` for every module of stacked experts (none without expert parallelism)."""
        return tuple(f"{m}." for m in self.expert_modules) if self.ep_axis else ()

    def is_expert(self, fqn: str) -> bool:
        """Whether parameter ``fqn`` is one of the experts split over the ep axis."""
        prefixes = self.expert_prefixes
        return bool(prefixes) and fqn.startswith(prefixes)

    def fsdp_axes(self, fqn: str) -> tuple[str, ...]:
        """The axes FSDP shards parameter ``fqn`` over, as the engine wraps it: an expert over the data-parallel
        sharding axes alone; every other parameter over those and the ep axis where data parallelism shards
        (fsdp, zero2, hsdp), since the ep ranks hold other rows of the batch."""
        return self._fsdp_axes_of(self.is_expert(fqn))

    def _fsdp_axes_of(self, expert: bool) -> tuple[str, ...]:
        """:meth:`fsdp_axes` of an expert (``expert``) or of any other parameter."""
        if self.ep_axis is None or expert or self.param_dp_mode in (None, "ddp", "zero1"):
            return self.shard_axes
        return (*self.shard_axes, self.ep_axis)

    def fsdp_divisor(self, fqn: str) -> int:
        """Into how many shards FSDP cuts ``fqn``'s tensor-parallel local block."""
        return self.size(self.fsdp_axes(fqn))

    def placed(self, fqn: str, axes: Mapping[str, PlacementSpec]) -> Mapping[str, PlacementSpec]:
        """``fqn``'s placements per axis as the engine places it: the config's, and an expert's ``Shard(0)`` on ep."""
        return {**axes, self.ep_axis: PlacementSpec("shard", 0)} if self.ep_axis and self.is_expert(fqn) else axes

    def local_divisor(self, fqn: str, axes: Mapping[str, PlacementSpec]) -> int:
        """Into how many blocks tensor and expert parallelism cut parameter ``fqn`` placed ``axes``: each
        rank holds one (before FSDP's shards, :meth:`fsdp_divisor`)."""
        return self.size(self._local_axes(sharding_axes({fqn: axes})[fqn], self.is_expert(fqn)))

    def _local_axes(self, sharded: tuple[str, ...], expert: bool) -> tuple[str, ...]:
        """The axes a parameter whose placements shard ``sharded`` is cut over, as :meth:`placed` places it:
        an expert (``expert``) over the ep axis too."""
        if expert and self.ep_axis is not None and self.ep_axis not in sharded:
            return (*sharded, self.ep_axis)
        return sharded

    def holding(self, fqn: str, axes: Mapping[str, PlacementSpec]) -> tuple[int, int, bool]:
        """``(local_divisor, fsdp_divisor, is_expert)`` of parameter ``fqn`` placed ``axes``: how one rank holds
        it, in one question (the memory and parameter counts ask it of every parameter of the model)."""
        return self.local_divisor(fqn, axes), self.fsdp_divisor(fqn), self.is_expert(fqn)

    def holdings(self, fqns: Sequence[str], placements: Mapping[str, Mapping[str, PlacementSpec]]
                 ) -> dict[str, tuple[int, int, bool]]:
        """:meth:`holding` of every parameter in ``fqns`` (placed as ``placements`` says; one it lacks: whole), as
        one table computed here: the memory and parameter counts read it for the whole model rather than ask
        the topology (and it the placements) once per parameter."""
        sharded = sharding_axes({fqn: placements.get(fqn, {}) for fqn in fqns})
        fsdp = {expert: self.size(self._fsdp_axes_of(expert)) for expert in (False, True)}
        experts = {fqn: self.is_expert(fqn) for fqn in fqns}
        return {fqn: (self.size(self._local_axes(sharded[fqn], expert)), fsdp[expert], expert)
                for fqn, expert in experts.items()}


def _axes(dim: str | Sequence[str]) -> tuple[str, ...]:
    """A ``dim`` value's axis names (one name, or hsdp's two). Read here rather than asked of the config's
    ``dim_names``: the config room lies above this one, and each question to it was a climb back up."""
    return (dim,) if isinstance(dim, str) else tuple(dim)


__all__ = ["MeshSpec", "Topology", "flat_rank_ids", "mesh_rank_ids", "mesh_shape_of", "mesh_world_size",
           "rank_id_of", "shard_axes_of"]
