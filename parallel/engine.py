"""The orchestrator: one call turns a full, initialised model into this rank's share of it.

    plan = resolve_plan(cfg.parallel, cfg.mesh, model)        # globs matched, stages split
    pm = parallelize(model, plan, device=torch.device("cpu"))
    loss = pm.forward_backward(inputs, targets, loss_fn)     # this rank's dp share of the batch
    grad_norm = pm.clip_grad_norm_(1.0)
    optimizer.step(); optimizer.zero_grad()
    print(pm.reduce_loss(loss))                               # the global mean, on every rank

Order of application, as torchtitan does it: split into pipeline stages -> tensor parallel
(placements, layouts) -> expert parallel (experts ``Shard(0)``, all-to-all around them) -> activation
checkpointing -> torch.compile per block (``compile=True``) -> data parallel -> (a meta model only) allocate this rank's
shards and initialise them. The model is either built and initialised in full on every rank, or built on the ``meta``
device and initialised after sharding (``parallelize(meta_model, plan, device=..., init=lambda part:
part.init_weights(seed))``); because the initial values depend only on (seed, FQN, shape), both
give every value of one device. A tied parameter (input and output embeddings) stays one
parameter on a stage holding all its names; a pipeline that puts its names on different stages
holds one copy per stage, kept equal by summing their gradients (:mod:`parallel.pipeline.ties`).

With one device (a plan whose mesh is ``(1,)``) there is no mesh and ``forward_backward`` is a
plain forward and backward, so the training loop is the same code for every mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel.config import SPLIT_BACKWARD_SCHEDULES, DataParallelMode, Precision
from parallel.context import apply_context_parallel
from parallel.mesh import axis_rank, build_mesh, submesh
from parallel.model import ParallelModel
from parallel.pipeline.schedule import split_stages
from parallel.pipeline.stage_io import (
    attach_boundaries,
    lane_groups,
    stage_to_group_rank,
)
from parallel.pipeline.ties import StageTies, holders_on_mesh
from parallel.plan.spec import ParallelPlan
from parallel.sharding.activation_checkpointing import apply_ac
from parallel.sharding.compile import apply_compile
from parallel.sharding.data_parallel import apply_data_parallel, replicate_beside_experts
from parallel.sharding.expert_parallel import apply_expert_parallel, divide_expert_grads
from parallel.sharding.head_params import HeadGradients, find_head_parameters
from parallel.sharding.tensor_parallel import apply_placements
from parallel.sharding.tp_grid import apply_grid
from parallel.sharding.tp_cube import CubeAxes, apply_cube
from parallel.sharding.ties import placed_alike, retie, tied_groups
from parallel.sharding.tp_styles import classify


def parallelize(model: nn.Module, plan: ParallelPlan, *, device: torch.device,
                init: Callable[[nn.Module], None] | None = None, precision: Precision = "fp32",
                compile: bool = False) -> ParallelModel:
    """Spread ``model`` over the plan's mesh; returns this rank's :class:`ParallelModel`.

    Args:
        model: the whole model, either initialised on CPU (identically on every rank) or built
            on the ``meta`` device (names and shapes only). A meta model is split and sharded
            as it is, then each part is allocated on ``device`` (``to_empty``) and ``init(part)``
            fills this rank's shards: no rank ever allocates a parameter it does not hold.
        plan: from :func:`parallel.plan.resolve.resolve_plan` for this model and config.
        device: where this rank computes (``cpu``, or its own ``cuda`` device).
        init: with a meta model, fills a materialised part's parameters and buffers (the
            trainer passes the model's ``init_weights(seed)``, which computes each shard's
            block of the full value, so every mesh starts from one device's values).
        precision: ``bf16``: bf16 compute over fp32 master weights, optimizer state and
            gradient reduction; FSDP2's mixed-precision policy where data parallelism applies
            (every mode is FSDP2-based), ``torch.autocast`` otherwise.
        compile: ``torch.compile`` each block (:func:`parallel.sharding.compile.apply_compile`), or the
            whole module when the model has no blocks; parameter names do not change.
    """
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and init is None:
        raise ValueError("a model on the meta device needs init= to give its shards their values")
    heads = HeadGradients()  # filled part by part: parameters applied per attention head under tp
    part_options: dict[str, Any] = dict(device=device, init=init if on_meta else None, precision=precision,
                                        compile=compile, heads=heads)
    if plan.topology.world_size == 1:  # no placements, no data parallelism: materialise, AC, compile
        _parallelize_part(model, None, plan, pipelined=False, **part_options)
        return ParallelModel(model_parts=[model], mesh=None, device=device, autocast=_autocast_dtype(precision, None),
                             tied_names=tied_groups(model))

    pp = plan.pipeline
    if compile and pp is not None and pp.schedule in SPLIT_BACKWARD_SCHEDULES:
        raise ValueError(f"torch.compile does not compose with the {pp.schedule} schedule (its weight-gradient pass "
                         "re-runs a compiled block's whole backward); use 1F1B or Interleaved1F1B, or compile=False")
    if pp is not None and pp.stages:
        return _parallelize_stages(model, plan, **part_options)
    return _parallelize_on_mesh(model, plan, **part_options)


def _parallelize_on_mesh(model: nn.Module, plan: ParallelPlan, *, device: torch.device,
                         init: Callable[[nn.Module], None] | None, precision: Precision, compile: bool,
                         heads: HeadGradients) -> ParallelModel:
    """One layout on the world mesh: the pipeline's stages on this rank (when there is a pipeline),
    each placed, sharded and materialised by :func:`_parallelize_part`; tied parameters on different
    stages kept equal (:mod:`parallel.pipeline.ties`)."""
    pp = plan.pipeline
    # Explicit mesh rank ids only say which device each position's worker runs on (the launcher bound
    # it): the world mesh itself is always torch ranks 0..n-1 row-major.
    mesh = build_mesh(plan.mesh.shape, plan.mesh.dim_names, device_type=device.type)
    if dist.get_world_size() != mesh.size():
        raise ValueError(f"the mesh has {mesh.size()} ranks but the world has {dist.get_world_size()}")
    groups = tied_groups(model)  # before the split: a pipeline may put a tie's names on different stages
    if pp is not None:
        stages = split_stages(model, pp, units=plan.units, pp_rank=mesh.get_local_rank(pp.dim))
    else:
        stages = [(0, model)]
    report: dict[str, str] = {}
    for _, part in stages:
        report.update(_parallelize_part(part, mesh, plan, pipelined=pp is not None, model_ties=groups, device=device,
                                        init=init, precision=precision, compile=compile, heads=heads))
    ties = None
    if pp is not None and groups:
        ties = StageTies.build(groups, [part for _, part in stages], holders_on_mesh(groups, plan, mesh),
                               pairing="shards")
        ties.copy_values()
    topology = plan.topology  # the batch's axes: data parallel, expert parallel
    return ParallelModel(
        model_parts=[part for _, part in stages],
        mesh=mesh,
        dp_rank=axis_rank(mesh, list(topology.batch_axes)),
        dp_size=topology.dp_size,
        cp_rank=axis_rank(mesh, topology.cp_axis) if topology.cp_axis else 0,
        cp_size=topology.cp_size,
        stage_indices=[index for index, _ in stages],
        pipeline=pp,
        device=device,
        placement_report=report,
        autocast=_autocast_dtype(precision, plan.param_data_parallel),
        pp_group=mesh.get_group(pp.dim) if pp is not None else None,
        replicas=topology.replicas,
        repeats=topology.repeats,
        ties=ties,
        tied_names=groups,
        heads=heads,
        loss_parallel=plan.loss_parallel,
        optimizer_shard_axes=_optimizer_shard_axes(plan.param_data_parallel),
    )


def _parallelize_part(part: nn.Module, mesh: DeviceMesh | None, layout: ParallelPlan, *, pipelined: bool,
                      device: torch.device,
                      init: Callable[[nn.Module], None] | None, precision: Precision, compile: bool,
                      heads: HeadGradients, model_ties: Sequence[list[str]] = ()) -> dict[str, str]:
    """One model part (the model, or a pipeline stage) on ``mesh`` as ``layout`` places it:
    tensor parallel -> context parallel -> expert parallel -> activation checkpointing -> compile -> data
    parallel (over the dp and cp axes) -> (``init``: a meta part) allocate and initialise this rank's shards.
    Returns tensor parallelism's report and adds the part's per-head parameters to ``heads``
    (:mod:`parallel.sharding.head_params`). A tied parameter (input and output embeddings) stays one parameter
    throughout (:mod:`parallel.sharding.ties`)."""
    tied = tied_groups(part)
    if init is None:
        part.to(device)
    report = _apply_tensor_parallel(part, mesh, layout, heads=heads, model_ties=model_ties, tied=tied)
    cp = layout.context_parallel if layout.cp_size > 1 else None  # one cp rank: whole rows, plain attention
    if cp is not None:
        assert mesh is not None, "more than one cp rank: a mesh"
        if not apply_context_parallel(part, mesh, dim=cp.dim, method=cp.method):
            raise ValueError(f"context parallelism over {cp.dim!r}: no module of {type(part).__name__} attends over "
                             "a split sequence (none declares a context_parallel attribute)")
    ep = layout.expert_parallel
    experts = [] if ep is None or mesh is None else apply_expert_parallel(part, mesh, axis=ep.dim,
                                                                          module_fqns=ep.modules)
    apply_ac(part, mode=layout.activation_checkpointing, every=layout.activation_checkpointing_every,
             block_fqns=layout.blocks)
    if compile:
        apply_compile(part, block_fqns=layout.blocks)
    dp = layout.param_data_parallel  # cp ranks average gradients and shard parameters as dp ranks do
    if dp is not None and layout.cube is not None:
        assert mesh is not None, "data parallelism spans more than one rank"
        # The cube's weights carry the dp axes themselves (parallel.sharding.tp_cube); FSDP2's replicate the rest.
        from torch.distributed._composable.replicate_with_fsdp import replicate

        cube = {p for name in layout.cube.modules for p in part.get_submodule(name).parameters()}
        replicate(part, mesh=submesh(mesh, list(dp.dim_names)), ignored_params=cube)
    elif dp is not None:
        assert mesh is not None, "data parallelism spans more than one rank"
        # The plan's modes are the config's (DataParallelSpec keeps a str, as the topology does).
        apply_data_parallel(part, mesh, mode=cast(DataParallelMode, dp.mode), dim_names=list(dp.dim_names),
                            block_fqns=layout.blocks, pipelined=pipelined, precision=precision, experts=experts,
                            ep_dim=ep.dim if ep is not None else None)
    elif experts:
        assert mesh is not None and ep is not None, "experts are split over an ep axis of a mesh"
        replicate_beside_experts(part, mesh, ep_dim=ep.dim, experts=experts)
    if init is not None:
        _materialize(part, device, init, tied)
    retie(part, tied)
    if experts and dp is None:  # data parallelism divides their gradients by dp x ep; here ep alone
        assert mesh is not None and ep is not None, "experts are split over an ep axis of a mesh"
        divide_expert_grads(experts, mesh[ep.dim].size())
    return report


def _apply_tensor_parallel(part: nn.Module, mesh: DeviceMesh | None, layout: ParallelPlan, *, heads: HeadGradients,
                           model_ties: Sequence[list[str]], tied: list[list[str]]) -> dict[str, str]:
    """The part's tensor parallelism: per-parameter placements (1-D tp, sequence parallel), Colossal-AI's 2-D /
    2.5-D grid or its 3-D cube; their report (``{module FQN: style}``)."""
    report: dict[str, str] = {}
    if layout.placements or layout.layouts:
        assert mesh is not None, "a plan with placements spans more than one rank"
        placements = placed_alike(layout.placements, model_ties)
        heads.entries += find_head_parameters(part, classify(part, placements, layout.layouts).col, mesh).entries
        report = apply_placements(part, mesh, placements=placements, layouts=layout.layouts)
        retie(part, tied)  # each holder of a tied parameter was distributed on its own: one parameter again
    if layout.grid is not None:  # 2-D / 2.5-D tensor parallelism: the blocks over the rows x cols grid
        assert mesh is not None, "a grid spans more than one rank"
        report.update(apply_grid(part, mesh, rows=layout.grid.rows, cols=layout.grid.cols, blocks=layout.blocks))
    if layout.cube is not None:
        assert mesh is not None, "a cube spans more than one rank"
        report.update(_apply_cube(part, mesh, layout))
    return report


def _apply_cube(part: nn.Module, mesh: DeviceMesh, layout: ParallelPlan) -> dict[str, str]:
    """Colossal-AI's 3-D tensor parallelism on ``part``'s blocks (:mod:`parallel.sharding.tp_cube`)."""
    cube = layout.cube
    assert cube is not None, "called for a plan with a cube"
    dp = layout.data_parallel
    axes = CubeAxes(*cube.dims, dp=tuple(dp.dim_names) if dp is not None else ())
    return apply_cube(part, mesh, axes=axes, first=cube.first, second=cube.second, norms=cube.norms,
                      attention=cube.attention, split_heads=cube.split_heads, blocks=layout.blocks)


def _parallelize_stages(model: nn.Module, plan: ParallelPlan, *, device: torch.device,
                        init: Callable[[nn.Module], None] | None, precision: Precision, compile: bool,
                        heads: HeadGradients) -> ParallelModel:
    """Per-stage layouts (``parallel.pipeline.stages``): every stage on its own sub-mesh with its
    own layout, the schedule along lanes of one rank per stage (:mod:`parallel.pipeline.stage_io`)."""
    pp, topology = plan.pipeline, plan.topology
    assert pp is not None, "per-stage layouts are a pipeline's"
    if dist.get_world_size() != topology.world_size:
        raise ValueError(f"the mesh has {topology.world_size} ranks but the world has {dist.get_world_size()}")
    # Every rank builds every stage's mesh and every lane's group: both are collectives.
    meshes = [build_mesh(s.layout.mesh.shape, s.layout.mesh.dim_names, rank_ids=s.rank_ids, device_type=device.type)
              for s in pp.stages]
    lanes = lane_groups([s.ranks for s in pp.stages])
    rank = dist.get_rank()
    index = next(i for i, s in enumerate(pp.stages) if rank in s.ranks)
    stage, mesh = pp.stages[index], meshes[index]
    lane = stage.ranks.index(rank)
    groups = tied_groups(model)
    (_, part), = split_stages(model, pp, units=plan.units, pp_rank=index)
    report = _parallelize_part(part, mesh, stage.layout, pipelined=True, device=device, init=init,
                               precision=precision, compile=compile, heads=heads, model_ties=groups)
    holders = {name: list(pp.stages[plan.stage_of(name)].ranks) for names in groups for name in names}
    ties = StageTies.build(groups, [part], holders, pairing="whole")
    ties.copy_values()
    layout = stage.layout.topology  # the stage's rows split over its dp and ep axes, its sequences over cp
    attach_boundaries(part, mesh, dp_axes=layout.batch_axes, cp_axis=layout.cp_axis if layout.cp_size > 1 else None)
    lane_ranks, lane_group = lanes[lane]
    return ParallelModel(
        model_parts=[part], mesh=mesh, dp_rank=lane, dp_size=topology.dp_size, stage_indices=[index], pipeline=pp,
        device=device, placement_report=report, autocast=_autocast_dtype(precision, stage.layout.param_data_parallel),
        pp_group=lane_group,
        replicas=topology.replicas, repeats=topology.repeats, lanes=topology.stage_lanes,
        stage_to_group_rank=stage_to_group_rank(lane_ranks),
        ties=ties, tied_names=groups, heads=heads, loss_parallel=stage.layout.loss_parallel,
        optimizer_shard_axes=_optimizer_shard_axes(stage.layout.param_data_parallel),
    )


def _optimizer_shard_axes(dp: Any) -> tuple[str, ...]:
    """zero1's data-parallel axes (the optimizer's state is sharded over them); none for other modes."""
    return tuple(dp.dim_names) if dp is not None and dp.mode == "zero1" else ()


def _autocast_dtype(precision: Precision, dp: Any) -> torch.dtype | None:
    # With data parallelism FSDP2's policy already computes in bf16; autocast on top would only re-cast.
    return torch.bfloat16 if precision == "bf16" and dp is None else None


def _materialize(part: nn.Module, device: torch.device, init: Callable[[nn.Module], None] | None,
                 tied: list[list[str]]) -> None:
    """Move ``part`` to ``device``; a meta part is allocated there (its shards only: after
    tensor and data parallelism a DTensor's local tensor is the shard) and given its values.
    ``to_empty`` allocates each module's tensors apart, so ties are restored before ``init``,
    which then gives a tied parameter its first name's value, as on one device."""
    if init is None:
        part.to(device)
        return
    part.to_empty(device=device)
    retie(part, tied)
    init(part)


__all__ = ["ParallelModel", "parallelize", "submesh"]
