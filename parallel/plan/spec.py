"""The parallel plan's types: a mesh, data parallelism, a pipeline's stage split, placements and
layouts, as frozen values that hold names, shapes and placements only (no process group, no tensors).

:func:`parallel.plan.resolve.resolve_plan` builds a :class:`ParallelPlan`; validation, the dry run,
the planner and the engine all read it, and ask it (not recompute) what follows from it: the unit a
parameter belongs to, and through its :attr:`ParallelPlan.topology` every size and divisor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from parallel.config import ActivationCheckpointing, ContextParallelMethod, ScheduleName, flat_ranks
from parallel.errors import ConfigIssue
from parallel.placements import PlacementSpec, sharding_axes
from parallel.plan.cube import CubeSpec
from parallel.topology import MeshSpec, Topology, shard_axes_of

AxisSpecs = Mapping[str, PlacementSpec]
# A model-specific check of one placements glob: (its config path, placements, the FQNs it matched, the mesh
# whose axes the placements name) -> issues.
GlobCheck = Callable[[str, AxisSpecs, list[str], "MeshSpec"], list[ConfigIssue]]


def owning_unit(fqn: str, units: Sequence[str]) -> str | None:
    """The entry of ``units`` that is ``fqn`` or one of its ancestors (None if none is); the first in
    ``units``' order when several are."""
    if not isinstance(units, tuple):
        return next((u for u in units if fqn == u or fqn.startswith(u + ".")), None)
    return unit_owner(units)(fqn)


@functools.lru_cache(maxsize=256)
def unit_owner(units: tuple[str, ...]) -> Callable[[str], str | None]:
    """:func:`owning_unit` over a plan's ``units``, each answer kept: a planner asks it for every parameter
    of every candidate (gpt_175b on 512 ranks: 580 parameters x 100 units, 2,500 times; a scan of the
    units each time took 40 s of the search)."""
    order: dict[str, int] = {}
    for i, unit in enumerate(units):
        order.setdefault(unit, i)
    known: dict[str, str | None] = {}

    def owner(fqn: str) -> str | None:
        if fqn not in known:  # fqn's ancestors (itself included) that are units; the first in units' order
            parts = fqn.split(".")
            found = [order[a] for a in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if a in order]
            known[fqn] = units[min(found)] if found else None
        return known[fqn]

    return owner


_DERIVED: dict[tuple[object, ...], tuple[object, Any]] = {}
T = TypeVar("T")


def _derived(name: str, source: object, extra: tuple[object, ...], compute: Callable[[], T]) -> T:
    """``compute()``, kept per ``name``, ``source`` object and ``extra``: what follows from a plan's placements
    or layouts alone. A planner's candidates of one resolution share those objects (read-only mappings) and
    ask this for every pp rank of thousands of candidates. ``source`` is kept with the answer, so its id
    stays its own while the answer is kept."""
    key = (name, id(source), extra)
    hit = _DERIVED.get(key)  # one lookup: another thread (the control plane's pool) may clear it meanwhile
    if hit is None:
        if len(_DERIVED) >= 4096:
            _DERIVED.clear()
        hit = _DERIVED[key] = (source, compute())
    return cast(T, hit[1])


@dataclass(frozen=True)
class DataParallelSpec:
    """``mode`` (ddp | fsdp | zero2 | hsdp) over the mesh axes ``dim_names``."""

    mode: str
    dim_names: tuple[str, ...]

    @property
    def shard_dim_names(self) -> tuple[str, ...]:
        """The axes parameters are sharded over: all dp axes (fsdp, zero2), hsdp's after its replicate axis
        (its shard axis, and a cp axis folded in), none for ddp."""
        return shard_axes_of(self.mode, self.dim_names)


@dataclass(frozen=True)
class ContextParallelSpec:
    """Every sequence split over the mesh axis ``dim``; attention by ``method`` (ring | allgather)."""

    dim: str
    method: ContextParallelMethod


@dataclass(frozen=True)
class ExpertParallelSpec:
    """Experts split over the mesh axis ``dim``: ``modules`` are the model's modules of stacked experts
    (every parameter ``[num_experts, ...]``), each split ``Shard(0)`` with the all-to-all dispatch
    around its forward (:mod:`parallel.sharding.expert_parallel`)."""

    dim: str
    modules: tuple[str, ...]


@dataclass(frozen=True)
class GridSpec:
    """2-D / 2.5-D tensor parallelism: the blocks partitioned over the grid of mesh axes ``rows`` x ``cols``;
    ``depth`` (2.5-D) splits the batch further (:mod:`parallel.sharding.tp_grid`)."""

    rows: str
    cols: str
    depth: str | None = None


@dataclass(frozen=True)
class PipelineSpec:
    """The schedule and the resolved stage split: the units of each stage and its pp rank."""

    dim: str
    schedule: ScheduleName
    num_microbatches: int
    stages_per_rank: int
    stage_units: tuple[tuple[str, ...], ...]
    stage_ranks: tuple[int, ...]
    # ``parallel.pipeline.stages``: each stage its own ranks and layout (empty: the plan's layout everywhere).
    stages: tuple[StagePlan, ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.stage_units)

    @property
    def boundaries(self) -> list[str]:
        """The first unit of every stage but the first (what ``boundaries: auto`` chose)."""
        return [units[0] for units in self.stage_units[1:]]

    def stages_of(self, pp_rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_ranks) if r == pp_rank]


@dataclass(frozen=True)
class LayoutSpec:
    """A module's input and output placements per mesh axis (unnamed axes: Replicate)."""

    input: AxisSpecs = field(default_factory=dict)
    output: AxisSpecs = field(default_factory=dict)


@dataclass(frozen=True)
class ParallelPlan:
    """Everything the engine needs to spread one model over one mesh, globs already matched.

    Attributes:
        mesh: the mesh; ``(1,)`` means one device.
        units: the model's pieces a pipeline may be cut between, in forward order.
        blocks: the units that are repeated blocks (``layers.0`` ..): FSDP and activation
            checkpointing treat each one as a unit.
        placements: parameter FQN -> ``{axis: placement}`` for every parameter a glob named.
        layouts: module FQN -> its input/output placements.
    """

    mesh: MeshSpec = field(default_factory=MeshSpec)
    units: tuple[str, ...] = ()
    blocks: tuple[str, ...] = ()
    data_parallel: DataParallelSpec | None = None
    pipeline: PipelineSpec | None = None
    context_parallel: ContextParallelSpec | None = None
    placements: Mapping[str, AxisSpecs] = field(default_factory=dict)
    layouts: Mapping[str, LayoutSpec] = field(default_factory=dict)
    activation_checkpointing: ActivationCheckpointing = "none"
    activation_checkpointing_every: int = 1
    # Loss parallel: the output head's logits leave it as vocabulary shards (a DTensor Shard(2)) and the loss
    # runs under torch's loss_parallel (parallel.model.ParallelModel).
    loss_parallel: bool = False
    expert_parallel: ExpertParallelSpec | None = None
    grid: GridSpec | None = None
    # ``parallel.tensor_parallel_3d``: the blocks on a q x q x q cube (parallel.plan.cube, parallel.sharding.tp_cube).
    cube: CubeSpec | None = None

    @property
    def sharded_axes(self) -> frozenset[str]:
        """The mesh axes some placement shards a parameter over (tensor parallelism's), whatever their sizes."""
        return _derived("sharded", self.placements, (), lambda: frozenset(
            a for axes in sharding_axes(self.placements).values() for a in axes))

    @property
    def placement_axes(self) -> tuple[str, ...]:
        """The mesh axes the placements name, sorted (their sizes' product: the tp degree)."""
        return _derived("named", self.placements, (), lambda: tuple(sorted({a for axes in self.placements.values()
                                                                              for a in axes})))

    def units_placed_over(self, axis: str) -> frozenset[str]:
        """The units holding a parameter that some placement puts on mesh axis ``axis``."""
        return _derived("placed units", self.placements, (axis, self.units), lambda: frozenset(
            unit for fqn, axes in self.placements.items()
            if axis in axes and (unit := owning_unit(fqn, self.units)) is not None))

    @property
    def sequence_parallel_axes(self) -> frozenset[str]:
        """The mesh axes of more than one rank over which the blocks' norms run on sequence shards: a layout
        whose input is ``Shard`` there (the engine's ``SequenceParallel``)."""
        return _derived("sequence", self.layouts, (self.mesh.shape, self.mesh.dim_names), lambda: frozenset(
            a for layout in self.layouts.values() for a, pl in layout.input.items()
            if pl.is_shard and self.mesh.size(a) > 1))

    @functools.cached_property
    def topology(self) -> Topology:
        """The mesh and what each of its axes splits: every size this plan implies is asked of it."""
        dp, pp, cp, ep = self.data_parallel, self.pipeline, self.context_parallel, self.expert_parallel
        stages = pp.stages if pp is not None else ()
        return Topology(
            self.mesh, dp_axes=dp.dim_names if dp else (), dp_mode=dp.mode if dp else None,
            pp_axis=pp.dim if pp else None, cp_axis=cp.dim if cp else None, ep_axis=ep.dim if ep else None,
            expert_modules=ep.modules if ep else (),
            tp_axes=tuple(sorted({*self.sharded_axes, *((self.grid.rows, self.grid.cols) if self.grid else ()),
                                  *(self.cube.dims if self.cube else ())})),
            depth_axis=self.grid.depth if self.grid is not None else None,
            stage_lanes=len(stages[0].ranks) if stages else 0,
            num_layout_stages=pp.num_stages if pp is not None and stages else 0,
        )

    @property
    def batch_dim_names(self) -> tuple[str, ...]:
        """The axes the batch is split over: the data-parallel ones, then the expert-parallel one."""
        return self.topology.batch_axes

    @property
    def dp_size(self) -> int:
        """Ranks the batch is split over (the data-parallel axes and the expert-parallel one)."""
        return self.topology.dp_size

    @property
    def cp_size(self) -> int:
        return self.topology.cp_size

    @property
    def param_data_parallel(self) -> DataParallelSpec | None:
        """Data parallelism as it wraps the parameters (:attr:`Topology.param_dp_axes`): the dp axes, then
        the cp axis (FSDP over cp alone when there is no dp). Without cp: ``data_parallel``."""
        if self.context_parallel is None and (self.grid is None or self.grid.depth is None):
            return self.data_parallel
        assert self.topology.param_dp_mode is not None, "with cp or a depth the parameters are wrapped over it"
        return DataParallelSpec(self.topology.param_dp_mode, self.topology.param_dp_axes)

    @property
    def pp_size(self) -> int:
        return self.topology.pp_size

    def unit_of(self, fqn: str) -> str:
        """The unit holding parameter (or module) ``fqn``: the unit itself or its ancestor."""
        unit = owning_unit(fqn, self.units)
        if unit is None:
            raise KeyError(f"{fqn} is in none of the model's units {list(self.units)}")
        return unit

    def units_of(self, fqns: Sequence[str]) -> dict[str, str]:
        """:meth:`unit_of` of every name in ``fqns``, as one table (a model's parameters, read by the planner)."""
        return {fqn: self.unit_of(fqn) for fqn in fqns}

    def stage_of(self, fqn: str) -> int:
        """The index of the pipeline stage holding ``fqn`` (0 without a pipeline)."""
        if self.pipeline is None:
            return 0
        unit = self.unit_of(fqn)
        return next(s for s, units in enumerate(self.pipeline.stage_units) if unit in units)


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage's own ranks and layout (``parallel.pipeline.stages[i]``).

    ``rank_ids``: the stage's global ranks (a list, or a nested list for a 2-D sub-mesh); its ``i``-th
    rank, row-major, is on lane ``i``
    (every stage has the same number of ranks, so lane ``i`` is one rank of every stage, and
    torch's pipeline schedule runs along it). ``layout``: the stage's plan on its own sub-mesh
    (``layout.mesh``: the shape and axis names of its ``ranks``), with its data parallelism,
    placements and layouts; its parameters are the stage's only."""

    rank_ids: Any  # the stage's global ranks as written: a list, or a nested list (its sub-mesh)
    layout: ParallelPlan

    @property
    def ranks(self) -> tuple[int, ...]:
        """The stage's ranks, row-major: its ``i``-th is on lane ``i``."""
        return tuple(flat_ranks(self.rank_ids))
