"""Data parallelism: DDP (``replicate``), FSDP2 (ZeRO-3 / ZeRO-2) and HSDP, all on FSDP2's
per-parameter DTensor machinery.

    apply_data_parallel(model, mesh, mode="fsdp", dim_names=["dp"], block_fqns=["layers.0", "layers.1"])

* ``ddp``   -> ``torch.distributed._composable.replicate_with_fsdp.replicate`` on the dp axis:
  parameters become ``Replicate`` DTensors, gradients are all-reduced (averaged) in backward.
  This is the composable DDP that ``PipelineStage`` knows how to drive (it is an
  ``FSDPModule``), unlike the older hook-based ``_composable.replicate``.
* ``fsdp``  -> ``fully_shard`` on every block, then on the root, ``reshard_after_forward=True``
  (ZeRO-3: parameters gathered per block in forward and again in backward).
* ``zero1`` -> ``replicate`` as ``ddp``; the optimizer's state is sharded over dp by
  :func:`parallel.sharding.zero1.shard_optimizer_state` (parameters and gradients stay whole).
* ``zero2`` -> ``fully_shard`` with ``reshard_after_forward=False`` (parameters stay gathered from
  forward to backward; gradients and optimizer state are sharded).
* ``hsdp``  -> ``fully_shard`` over the 2-D (replicate, shard) sub-mesh.

With tensor parallelism the parameters are already DTensors on the tp axis; ``fully_shard``
over the dp sub-mesh of the same parent mesh makes them 2-D (FSDP2 supports this). Every
mode averages gradients over dp, so with each rank's loss the mean over its local batch the
gradient equals the single-device gradient of the global-batch mean loss.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from parallel.config import DataParallelMode, Precision
from parallel.mesh import hsdp_mesh, submesh


def apply_data_parallel(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    mode: DataParallelMode,
    dim_names: Sequence[str],
    block_fqns: Sequence[str] = (),
    pipelined: bool = False,
    precision: Precision = "fp32",
    experts: Sequence[nn.Module] = (),
    ep_dim: str | None = None,
) -> nn.Module:
    """Wrap ``module`` (the model or one pipeline stage) for data parallelism over the mesh
    axes ``dim_names``; returns it (modified in place).

    Args:
        mode: ``ddp`` | ``zero1`` | ``fsdp`` | ``zero2`` | ``hsdp`` (``zero1`` wraps the module as ``ddp``;
            its optimizer is sharded by :func:`parallel.sharding.zero1.shard_optimizer_state`).
        dim_names: the dp axes; ``hsdp`` takes two, ``[replicate_axis, shard_axis]``.
        block_fqns: submodules sharded as their own FSDP units (e.g. ``["layers.0", ...]``),
            so parameters are gathered one block at a time; those absent from ``module``
            (another pipeline stage holds them) are skipped.
        pipelined: ``module`` is a pipeline stage run once per micro-batch. FSDP then keeps
            parameters gathered after forward (as torchtitan does): resharding would
            all-gather them again for every micro-batch. Gradients stay sharded.
        precision: ``bf16`` gathers parameters in bf16 and computes in bf16, while the sharded
            master weights (and so the optimizer state) stay fp32 and gradients are reduced in
            fp32 (FSDP2's ``MixedPrecisionPolicy``; ``ddp`` is FSDP2's replicate, so the same).
        experts, ep_dim: modules of experts split over the expert-parallel axis ``ep_dim``
            (:mod:`parallel.sharding.expert_parallel`), which splits the batch too. As torchtitan
            does, each is its own FSDP unit over the dp axes only, its gradients divided by dp x ep
            (every rank's tokens reach them); everything else is sharded over dp x ep (``hsdp``: the
            experts HSDP over its two axes, the rest replicated over its replicate axis and sharded over
            its shard axis x ep). Not ``ddp``.
    """
    dim_names = list(dim_names)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" \
        else MixedPrecisionPolicy()
    if mode in ("ddp", "zero1"):
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(module, mesh=submesh(mesh, dim_names), mp_policy=mp)  # in place: the module, typed ReplicateModule
        return module
    # hsdp keeps its two axes as a 2-D mesh: FSDP2 replicates over the first, shards over the second
    # (with context parallelism, the shard axis and the cp axis flattened into one).
    dp_mesh = hsdp_mesh(mesh, dim_names) if mode == "hsdp" else submesh(mesh, dim_names)
    reshard = mode != "zero2" and not pipelined
    if experts:
        if ep_dim is None:
            raise ValueError("experts split over an expert-parallel axis need that axis (ep_dim)")
        for unit in experts:
            sharded_unit = fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)  # in place
            # A sum divided afterwards (gloo has no pre-scaled sum for the divide factor to use), but not
            # where the reduce-scatter has one rank: torch 2.13 then divides by the factor as it copies
            # and again after the (hsdp: replicate axis's) all-reduce, gradients factor^2 too small;
            # without the forced sum it divides once and sums over the replicate axis.
            sharded_unit.set_force_sum_reduction_for_comms(dp_mesh.size(dp_mesh.ndim - 1) > 1)
            sharded_unit.set_gradient_divide_factor(float(dp_mesh.size() * mesh[ep_dim].size()))
        # In the mesh's order (a device mesh slices its axes in order): a cp axis may follow the ep axis.
        replicated, shard = (dim_names[:1], dim_names[1:]) if mode == "hsdp" else ([], dim_names)
        shard = sorted([*shard, ep_dim], key=list(mesh.mesh_dim_names or ()).index)
        dp_mesh = hsdp_mesh(mesh, [*replicated, *shard]) if mode == "hsdp" else submesh(mesh, shard)
    modules = dict(module.named_modules())
    for fqn in block_fqns:
        if fqn in modules:
            fully_shard(modules[fqn], mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    # The root's parameters (embeddings, final norm, head) are needed again right at the start
    # of backward: keeping them gathered saves an all-gather for nothing.
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp)
    return module


def replicate_beside_experts(module: nn.Module, mesh: DeviceMesh, *, ep_dim: str,
                             experts: Sequence[nn.Module]) -> nn.Module:
    """Without data parallelism, the expert-parallel axis ``ep_dim`` still splits the batch: every
    parameter but the experts' is replicated over it, its gradients averaged (FSDP2's ``replicate``, as
    ``ddp``); the experts, split over it, are left to :mod:`parallel.sharding.expert_parallel`.
    bf16 compute comes from autocast here (the engine's, as without data parallelism)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    ignored = {p for unit in experts for p in unit.parameters()}
    replicate(module, mesh=submesh(mesh, ep_dim), ignored_params=ignored)  # in place: the module, typed ReplicateModule
    return module
