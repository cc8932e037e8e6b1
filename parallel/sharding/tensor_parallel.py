"""Tensor (and sequence) parallelism from per-parameter placements.

The config names a placement per parameter and mesh axis (``{"layers.*.attn.wq.weight":
{"tp": Shard(0)}}``); :func:`apply_placements` turns those into torch's machinery, choosing
the efficient form where it recognises one:

* **Megatron pairs.** Inside one parent module, ``nn.Linear`` weights that are ``Shard(0)``
  (column parallel: ``[out, in]`` split by rows) and ``Shard(1)`` (row parallel) on the same
  single axis get ``ColwiseParallel`` / ``RowwiseParallel`` on that axis's 1-D mesh: no
  communication between them, one all-reduce at the row-parallel output. A Linear with LoRA
  adapters shards them with its weight (:mod:`parallel.sharding.adapters`).
* **Sequence parallel.** A ``layouts`` entry giving a module (a norm) the input ``Shard(d)``
  on that axis makes it ``SequenceParallel``: the residual stream of its parent block is kept
  as sequence shards, the row-parallel outputs reduce-scatter into them, and the norm's
  output is all-gathered once before the column-parallel projections, which keep only its
  shard for backward and gather it again there (:mod:`parallel.sharding.sequence_parallel`).
* **Everything else** (the seeds' raw ``w0: Shard(1)`` / ``w1: Shard(0)``, a lone shard,
  placements over two axes = 2-D TP) becomes DTensor parameters on the sub-mesh of the axes
  named, via ``distribute_module``: inputs enter as ``Replicate`` DTensors (or per
  ``layouts``), DTensor's sharding propagation inserts the redistributions, and outputs
  leave as plain replicated tensors (or stay DTensors if ``layouts`` asks, e.g. ``Partial``).

    report = apply_placements(model, mesh, placements={"w0": {"tp": Shard(1)}, "w1": {"tp": Shard(0)}})
    # {"": "dtensor"}

The placements and layouts arrive resolved by :func:`parallel.plan.resolve.resolve_plan` (one entry per
parameter / module FQN, globs already matched and checked), so this module matches nothing
itself. :func:`~parallel.sharding.tp_styles.classify` is the pure part (which module gets which style);
the plan uses it to refuse layouts that would be ignored, before any worker starts. Parameter values are taken
from the (already initialised, identical on every rank) full tensors: each rank keeps its
slice, nothing is communicated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from parallel.mesh import submesh
from parallel.placements import PlacementSpec
from parallel.sharding.adapters import colwise_style, rowwise_style
from parallel.sharding.sequence_parallel import apply_sequence_parallel
from parallel.sharding.tp_styles import AxisSpecs, block_of, classify, enclosing, non_replicate, sharded_axes


def apply_placements(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    placements: Mapping[str, AxisSpecs],
    layouts: Mapping[str, Any] | None = None,
    regather: bool = True,
) -> dict[str, str]:
    """Shard ``module``'s parameters over ``mesh`` as ``placements`` says; returns
    ``{module FQN: style}`` (``colwise``, ``rowwise``, ``sequence_parallel``, ``dtensor``).

    Args:
        module: the model (or a pipeline stage of it), parameters plain and initialised.
        mesh: the full device mesh; axes are referred to by name.
        placements: parameter FQN -> ``{axis: PlacementSpec}``; axes not named are ``Replicate``
            (a plan's ``placements``; FQNs of other stages are ignored).
        layouts: module FQN -> :class:`~parallel.plan.spec.LayoutSpec` (sequence parallel, a
            ``Partial`` output).
        regather: sequence parallel keeps a gathered norm output for backward as its shard and
            gathers it again there (default ``True``); ``False`` keeps it whole (a measurement's baseline).
    """
    layouts = dict(layouts or {})
    axes = list(mesh.mesh_dim_names or ())
    modules = dict(module.named_modules())
    plan = classify(module, placements, layouts)
    if plan.unsupported:  # the plan refuses these before launch; a direct caller gets told too
        raise ValueError(f"layouts on {plan.unsupported}: only a Shard input of a norm-like module (sequence "
                         "parallel) or the input/output of a module with DTensor-placed parameters is supported")
    report: dict[str, str] = {}
    col, row, sp_norms = plan.col, plan.row, plan.sp_norms

    # Rows inside a sequence-parallel block reduce-scatter into the sharded residual stream.
    sp_blocks = {block_of(name): (axis, dim) for name, (axis, dim) in sp_norms.items()}
    for name, axis in col.items():
        parallelize_module(modules[name], submesh(mesh, axis), colwise_style(modules[name]))
        report[name] = "colwise"
    _share_pair_inputs(modules, col, sp_blocks, mesh)
    for name, axis in row.items():
        seq = enclosing(sp_blocks, name)
        out = Shard(seq[1]) if seq is not None and seq[0] == axis else Replicate()
        parallelize_module(modules[name], submesh(mesh, axis), rowwise_style(modules[name], output_layouts=out))
        report[name] = "rowwise"
    apply_sequence_parallel(modules, mesh, norms=sp_norms, col=col, regather=regather)
    report.update(dict.fromkeys(sp_norms, "sequence_parallel"))

    # The rest: DTensor parameters on the sub-mesh of the axes they name.
    for owner, param_specs in plan.owners.items():
        owner_axes = [a for a in axes if any(a in sharded_axes(s) for s in param_specs.values())]
        _distribute_owner(modules[owner], mesh, owner_axes, param_specs, layouts.get(owner))
        report[owner] = "dtensor"
    return report


def _share_pair_inputs(modules: Mapping[str, nn.Module], col: Mapping[str, str],
                       sp_blocks: Mapping[str, tuple[str, int]], mesh: DeviceMesh) -> None:
    """Column-parallel Linears that read the same input tensor (attention's wq/wk/wv, the MLP's
    w1/w3) get it as one shared Replicate DTensor, so their Partial input-gradients are summed
    first and all-reduced once in backward (Megatron's count), instead of once per layer.

    The conversion happens at the Linears' inputs, not at their parent's: the parent may do other
    things with its input (a residual add, a norm with plain parameters) or be called with keyword
    arguments (Hugging Face's ``hidden_states=``), and all of that keeps seeing plain tensors.
    Sequence-parallel blocks already gather their input as a DTensor and are left alone."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name, axis in col.items():
        parent = name.rpartition(".")[0]
        if enclosing(sp_blocks, parent) is None:
            groups.setdefault((parent, axis), []).append(name)
    for (parent, axis), names in groups.items():
        shared = _SharedReplicate(submesh(mesh, axis))
        for name in names:
            # prepend: before ColwiseParallel's own input hook, which then finds a DTensor.
            modules[name].register_forward_pre_hook(shared.hook, prepend=True, with_kwargs=True)
        modules[parent].register_forward_hook(shared.forget)


class _SharedReplicate:
    """Turns a tensor into a Replicate DTensor once: every module that reads the same tensor
    object (until the parent's forward ends) gets the same DTensor, so autograd sums their gradients.

    The parent's forward hook (:meth:`forget`) drops the pair: nothing outlives one forward, so
    a block compiled by ``torch.compile`` neither returns the cached DTensor as an extra output
    (a graph output that needs a gradient but gets none fails in backward) nor guards on it."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.last_input: torch.Tensor | None = None
        self.last_output: DTensor | None = None

    def convert(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
            return x
        if x is not self.last_input:
            self.last_input, self.last_output = x, DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        return self.last_output

    def hook(self, _mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            return (self.convert(args[0]), *args[1:]), kwargs
        return args, {key: self.convert(value) if key == "input" else value for key, value in kwargs.items()}

    def forget(self, _mod: nn.Module, _args: tuple[Any, ...], _output: Any) -> None:
        self.last_input = self.last_output = None


def _distribute_owner(
    owner: nn.Module,
    mesh: DeviceMesh,
    owner_axes: list[str],
    param_specs: Mapping[str, Mapping[str, PlacementSpec]],
    layout: Any,
) -> None:
    """Make every parameter under ``owner`` a DTensor on the sub-mesh of ``owner_axes`` (the
    unnamed ones ``Replicate``, so no plain tensor meets a DTensor in ``forward``)."""
    sub = mesh if list(mesh.mesh_dim_names or ()) == owner_axes else mesh[tuple(owner_axes)]

    def placements_over(axis_specs: Mapping[str, PlacementSpec]) -> list[Placement]:
        return [axis_specs.get(a, PlacementSpec("replicate")).to_torch() for a in owner_axes]

    def partition(name: str, mod: nn.Module, device_mesh: DeviceMesh) -> None:
        for pname, param in list(mod.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue
            spec = param_specs.get(pname, {}) if mod is owner else {}
            dt = distribute_tensor(param.detach(), device_mesh, placements_over(spec), src_data_rank=None)
            mod.register_parameter(pname, nn.Parameter(dt, requires_grad=param.requires_grad))

    in_placements = placements_over(layout.input) if layout is not None else [Replicate()] * len(owner_axes)
    out_spec = layout.output if layout is not None else {}
    out_placements = placements_over(out_spec)
    keep_dtensor = bool(non_replicate(out_spec))

    def to_dtensor(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            return DTensor.from_local(x, sub, in_placements, run_check=False)
        return x

    def input_fn(_mod: nn.Module, inputs: tuple[Any, ...], _mesh: DeviceMesh) -> tuple[Any, ...]:
        return tuple(to_dtensor(x) for x in inputs)

    def from_dtensor(y: Any) -> Any:
        if not isinstance(y, DTensor):
            return y
        y = y.redistribute(sub, out_placements)
        return y if keep_dtensor else y.to_local()

    def output_fn(_mod: nn.Module, outputs: Any, _mesh: DeviceMesh) -> Any:
        if isinstance(outputs, tuple):
            return tuple(from_dtensor(y) for y in outputs)
        return from_dtensor(outputs)

    # torch types input_fn and output_fn as returning None, but uses what they return (new inputs, output).
    distribute_module(owner, sub, partition, input_fn, output_fn)  # type: ignore[arg-type]


__all__ = ["apply_placements"]
