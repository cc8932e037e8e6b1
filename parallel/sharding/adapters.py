"""Low-rank adapters inside a tensor-parallel Linear: sharded consistently with their base.

A Linear holding adapters (children ``lora_A``: ``[rank, in]`` and ``lora_B``: ``[out, rank]``, as
PEFT names them; its forward adds ``scaling * lora_B(lora_A(x))`` to ``W x``) keeps the Megatron
style its weight's placement gives it, with the adapters split so that no extra communication is
needed and the sum stays exact:

* **column-parallel** (``W`` ``Shard(0)``): ``A`` replicated, ``B`` ``Shard(0)``. ``B A x`` comes out
  split over the output features like ``W x``.
* **row-parallel** (``W`` ``Shard(1)``): ``A`` ``Shard(1)`` (its input features, like ``W``'s), ``B``
  replicated. ``A x`` and so ``B A x`` are partial sums, added to ``W x``'s partial sum and reduced
  with it by the one all-reduce (or reduce-scatter) the row-parallel output already does.

    parallelize_module(linear, tp_mesh, colwise_style(linear))     # ColwiseParallel, adapters or not

Modules without adapters get torch's own styles. The adapters' gradients follow from DTensor's
rules; a replicated ``B`` of a row-parallel Linear gets a ``Partial`` gradient, which
:meth:`parallel.model.ParallelModel.clip_grad_norm_` sums once per step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from parallel.placements import PlacementSpec
from parallel.sharding.tp_styles import AxisSpecs, classify

ADAPTERS = ("lora_A", "lora_B")


def has_adapters(module: nn.Module) -> bool:
    """Whether ``module`` (a Linear) holds LoRA adapters as ``lora_A`` / ``lora_B`` Linear children."""
    return all(isinstance(getattr(module, name, None), nn.Linear) for name in ADAPTERS)


def _distribute(module: nn.Module, mesh: DeviceMesh, placements: dict[str, list[Placement]],
                src_data_rank: int | None) -> None:
    """``module``'s own parameters named in ``placements`` as DTensors (``requires_grad`` kept)."""
    for pname, param in list(module.named_parameters(recurse=False)):
        if pname in placements and not isinstance(param, DTensor):
            dt = distribute_tensor(param.detach(), mesh, placements[pname], src_data_rank=src_data_rank)
            module.register_parameter(pname, nn.Parameter(dt, requires_grad=param.requires_grad))


class ColwiseParallelWithAdapters(ColwiseParallel):
    """``ColwiseParallel`` for a Linear with adapters: ``weight`` and ``bias`` ``Shard(0)``, ``lora_A``
    replicated, ``lora_B`` ``Shard(0)``. Keyword arguments are ``ColwiseParallel``'s."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        # distribute_module calls this for the Linear ("") and each of its children.
        by_name: dict[str, dict[str, list[Placement]]] = {
            "": {"weight": [Shard(0)], "bias": [Shard(0)]}, "lora_A": {"weight": [Replicate()]},
            "lora_B": {"weight": [Shard(0)]}}
        own = by_name.get(name, {})
        _distribute(module, device_mesh, own, self.src_data_rank)


class RowwiseParallelWithAdapters(RowwiseParallel):
    """``RowwiseParallel`` for a Linear with adapters: ``weight`` ``Shard(1)``, ``bias`` replicated,
    ``lora_A`` ``Shard(1)``, ``lora_B`` replicated. Keyword arguments are ``RowwiseParallel``'s."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        by_name: dict[str, dict[str, list[Placement]]] = {
            "": {"weight": [Shard(1)], "bias": [Replicate()]}, "lora_A": {"weight": [Shard(1)]},
            "lora_B": {"weight": [Replicate()]}}
        own = by_name.get(name, {})
        _distribute(module, device_mesh, own, self.src_data_rank)


def adapter_placements(model: nn.Module, placements: Mapping[str, AxisSpecs]) -> dict[str, dict[str, PlacementSpec]]:
    """The placements the styles above give the adapters of ``model`` (param FQN -> ``{axis:
    placement}``, sharded ones only) under the resolved ``placements``, which name base weights alone:
    a column-parallel Linear's ``lora_B`` ``Shard(0)``, a row-parallel one's ``lora_A`` ``Shard(1)``, on
    the pair's axis. Every other adapter is replicated (a Linear on the DTensor path keeps plain
    adapters). What a planner needs to give the adapters their tp-local shapes; empty without adapters."""
    modules = dict(model.named_modules())
    if not any(has_adapters(m) for m in modules.values()):
        return {}
    pairs = classify(model, placements, {})
    out: dict[str, dict[str, PlacementSpec]] = {}
    for names, adapter, dim in ((pairs.col, "lora_B", 0), (pairs.row, "lora_A", 1)):
        for name, axis in names.items():
            if has_adapters(modules[name]):
                out[f"{name}.{adapter}.weight"] = {axis: PlacementSpec("shard", dim=dim)}
    return out


def colwise_style(module: nn.Module, **kwargs: Any) -> ColwiseParallel:
    """The column-parallel style for ``module``: with adapters or torch's own."""
    return ColwiseParallelWithAdapters(**kwargs) if has_adapters(module) else ColwiseParallel(**kwargs)


def rowwise_style(module: nn.Module, **kwargs: Any) -> RowwiseParallel:
    """The row-parallel style for ``module``: with adapters or torch's own."""
    return RowwiseParallelWithAdapters(**kwargs) if has_adapters(module) else RowwiseParallel(**kwargs)


__all__ = ["ColwiseParallelWithAdapters", "RowwiseParallelWithAdapters", "adapter_placements", "colwise_style",
           "has_adapters", "rowwise_style"]
