"""Colossal-AI's 3-D tensor parallelism (``+parallel=tp3d``): a decoder's blocks on a q x q x q cube.

    apply_cube(model, mesh, spec)        # spec: parallel.plan.cube.CubeSpec, from the plan

**The paper's 3-D matmul, on the axes (a, b, c)** (Agarwal et al. 1995, "A three-dimensional approach to
parallel matrix multiplication"; Bian et al. 2021, "Maximizing parallelism in distributed training for huge
neural networks", the scheme Colossal-AI's ``Linear3D`` implements). ``Y = X W`` with ``X [m, k]``,
``W [k, n]`` on p = q^3 ranks, rank (i, j, l) on the axes (a, b, c):

* ``X`` is cut into q x q blocks ``X[m over a, k over b]``; the block is stored further split over c (rows).
  Forward: **all-gather X over c** (Colossal-AI: the input parallel mode's all-gather).
* ``W`` is cut into ``W[k over b, n over c]``, the block stored further split over a (columns). Forward:
  **all-gather W over a** (the weight parallel mode).
* The local product ``X_ij W_jl`` is one of q partial sums of ``Y[m over a, n over c]``, summed over b:
  **reduce-scatter Y over b** (the output parallel mode), which leaves ``Y`` split like the next layer's
  input: rows over a then b, columns over c.
* Backward mirrors it: dY all-gathered over b, dX reduce-scattered over c, dW reduce-scattered over a.
  Per rank and per Linear that is ``2 (q - 1) / q^3 (mk + kn + mn)`` elements sent (forward + backward):
  each of X, W, Y moves ``(q - 1)`` times its stored block, twice (``tests/bench/bench_tp_grids.py``).
* The next Linear swaps the roles of b and c (Colossal-AI's ``swap_in_out_group``): its input is the
  previous output, ``[rows over a then b, k over c]``, gathered over b, reduce-scattered over c.

Here ``m`` is the token rows (the batch dim of ``[batch, seq, dim]``: a row's sequence stays whole), a
column-parallel Linear of the family's Megatron plan (q, k, v, gate, up) takes the roles (a, b, c) and a
row-parallel one (o, down) the swapped (a, c, b), so the residual stream between blocks is the output layout
of a swapped Linear, ``[rows over a then c, hidden over b]``, which is what the next block's first Linears
read. The norms run on it with the hidden split over b: each row's sum of squares is all-reduced over b
(Colossal-AI's ``LayerNorm3D``), the weight split over b like the hidden. Attention acts where heads split
cleanly: q/k/v leave their Linears with the heads over c; when the head or kv-head count does not divide by
q, they are gathered over c (heads whole, the attention core repeated on each c rank) and o takes its block
of them. A bias is split like the output's columns; per-head norms (Qwen3's q/k norms) act on the heads a
rank holds (:class:`CubeHeadNorm`). The embedding, final norm and head stay whole on every rank: the first
block takes this rank's block of the embedding's output, the last block's output is all-gathered.

**DTensor, explicitly.** Activations cross the module boundaries as local tensors; every move above is a
``DTensor.redistribute`` between the placements named (``_Layouts``), and ``to_local(grad_placements=...)``
states where backward's contributions are partial (a block used by ranks that differ along an axis), so
autograd's redistributions do the backward collectives. Weights are DTensors on the mesh with its axes
ordered (b, c, a): a tensor dim split over two axes is split in mesh order, and a weight's further split over
a is the inner one. The norm weights' gradients, partial over a and c, are summed by a redistribute too.
FSDP2 takes DTensor parameters of at most two placements (torch 2.13), so data parallelism
is the cube weights' own axis (``Replicate`` over dp, the gradient ``Partial`` until the backward
redistribute sums it) beside FSDP2's ``replicate`` for the whole parameters (:mod:`parallel.engine`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from parallel.sharding.head_params import norm_eps, rms_on_heads

ROWS, HIDDEN = 0, 2  # the dims of a [batch, seq, hidden] activation a cube splits


@dataclass(frozen=True)
class CubeAxes:
    """The cube's axes in the paper's roles (a: rows and weight gather, b / c: alternate reduce and gather)
    and the data-parallel axes the weights are replicated over (their gradients averaged)."""

    a: str
    b: str
    c: str
    dp: tuple[str, ...] = ()


class _Meshes:
    """The activations' mesh (a, b, c) and the weights' mesh (dp..., b, c, a): the same ranks, axes reordered."""

    def __init__(self, mesh: DeviceMesh, axes: CubeAxes) -> None:
        names = list(mesh.mesh_dim_names or ())
        self.axes = axes
        self.cube = mesh[(axes.a, axes.b, axes.c)]
        order = [*axes.dp, axes.b, axes.c, axes.a]
        if sorted(order) != sorted(names):
            raise ValueError(f"a cube mesh has the axes {order} only, got {names}")
        # A new DeviceMesh (its own process groups) over the same ranks: a DeviceMesh slice keeps the axes' order.
        ranks = mesh.mesh.permute(*[names.index(n) for n in order])
        self.weights = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=tuple(order))
        self.dp_size = math.prod(mesh.size(names.index(n)) for n in axes.dp)

    def act(self, **by_axis: Placement) -> list[Placement]:
        """Activation placements on (a, b, c); axes not named are Replicate."""
        return [by_axis.get(role, Replicate()) for role in ("a", "b", "c")]

    def weight(self, dp: Placement = Replicate(), **by_axis: Placement) -> list[Placement]:
        """Weight placements on (dp..., b, c, a); axes not named are Replicate."""
        return [dp] * len(self.axes.dp) + [by_axis.get(role, Replicate()) for role in ("b", "c", "a")]


class CubeLinear:
    """One ``nn.Linear`` as the paper's 3-D matmul with the roles ``(i, j, l)`` (``("a", "b", "c")`` or the
    swapped ``("a", "c", "b")``): input ``[rows over i (then l), k over j]``, weight ``[n over l (then i),
    k over j]``, output ``[rows over i then j, n over l]``. ``input_whole``: the input arrives whole over j
    (gathered heads) and the Linear takes its block; ``gather_output``: the output is all-gathered over l."""

    meshes: _Meshes
    linear: nn.Linear
    x_in: list[Placement]
    x_gathered: list[Placement]
    x_grad: list[Placement]
    w_gathered: list[Placement]
    w_grad: list[Placement]
    y_partial: list[Placement]
    y_out: list[Placement]
    y_final: list[Placement]
    b_stored: list[Placement]
    b_grad: list[Placement]

    def __init__(self, linear: nn.Linear, meshes: _Meshes, roles: tuple[str, str, str], *,
                 input_whole: bool = False, gather_output: bool = False) -> None:
        i, j, l_ = roles
        self.meshes = meshes
        m = meshes
        if input_whole:  # the previous Linear gathered its output over its l, which is this one's j
            self.x_in = m.act(**{i: Shard(ROWS), l_: Shard(ROWS)})
        else:
            self.x_in = m.act(**{i: Shard(ROWS), j: Shard(HIDDEN), l_: Shard(ROWS)})
        self.x_gathered = m.act(**{i: Shard(ROWS), j: Shard(HIDDEN)})
        self.x_grad = m.act(**{i: Shard(ROWS), j: Shard(HIDDEN), l_: Partial()})
        # torch's weight is [n, k]: n over l then i (the inner split), k over j.
        self.w_stored = m.weight(**{l_: Shard(0), j: Shard(1), i: Shard(0)})
        self.w_gathered = m.weight(**{l_: Shard(0), j: Shard(1)})
        self.w_grad = m.weight(dp=Partial(), **{l_: Shard(0), j: Shard(1), i: Partial()})
        self.y_partial = m.act(**{i: Shard(ROWS), j: Partial(), l_: Shard(HIDDEN)})
        self.y_out = m.act(**{i: Shard(ROWS), j: Shard(ROWS), l_: Shard(HIDDEN)})
        self.y_final = m.act(**{i: Shard(ROWS), j: Shard(ROWS)}) if gather_output else self.y_out
        weight = linear.weight
        dt = distribute_tensor(weight.detach(), m.weights, self.w_stored, src_data_rank=None)
        linear.register_parameter("weight", nn.Parameter(dt, requires_grad=weight.requires_grad))
        # A bias is split like Y's columns (over l); the rows' contributions to its gradient are partial over i, j.
        self.b_stored = m.weight(**{l_: Shard(0)})
        self.b_grad = m.weight(dp=Partial(), **{l_: Shard(0), i: Partial(), j: Partial()})
        if linear.bias is not None:
            bias = linear.bias
            dt = distribute_tensor(bias.detach(), m.weights, self.b_stored, src_data_rank=None)
            linear.register_parameter("bias", nn.Parameter(dt, requires_grad=bias.requires_grad))
        self.linear = linear
        linear.forward = self.forward  # type: ignore[method-assign,assignment]  # this instance's own forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.meshes
        xs = DTensor.from_local(x, m.cube, self.x_in, run_check=False)
        x_block = xs.redistribute(m.cube, self.x_gathered).to_local(grad_placements=self.x_grad)
        weight = cast(DTensor, self.linear.weight)  # a DTensor since __init__
        w_block = weight.redistribute(m.weights, self.w_gathered).to_local(grad_placements=self.w_grad)
        w_block = _average_over_dp(w_block, m)
        y = DTensor.from_local(F.linear(x_block, w_block), m.cube, self.y_partial, run_check=False)
        y = y.redistribute(m.cube, self.y_out)
        if self.linear.bias is not None:
            bias = cast(DTensor, self.linear.bias)
            b_block = bias.redistribute(m.weights, self.b_stored).to_local(grad_placements=self.b_grad)
            y = DTensor.from_local(y.to_local() + _average_over_dp(b_block, m), m.cube, self.y_out, run_check=False)
        return y.redistribute(m.cube, self.y_final).to_local()


def _take_norm(owner: CubeRMSNorm | CubeHeadNorm, norm: nn.Module, meshes: _Meshes,
               stored: Sequence[Placement]) -> torch.Tensor:
    """``norm``'s weight distributed as ``stored`` over the weights mesh (each rank's shard from its own
    initialisation: ``src_data_rank=None``), its eps (the dtype's when it has none) on ``owner``, and its forward
    ``owner``'s, per instance. Returns the weight as it was."""
    weight = cast(torch.Tensor, norm.weight)
    dt = distribute_tensor(weight.detach(), meshes.weights, stored, src_data_rank=None)
    norm.register_parameter("weight", nn.Parameter(dt, requires_grad=weight.requires_grad))
    owner.eps = norm_eps(norm, weight.dtype)
    owner.norm = norm
    norm.forward = owner.forward
    return weight


class CubeRMSNorm:
    """An RMSNorm on the residual stream ``[rows over a then c, hidden over b]``: each row's sum of squares is
    all-reduced over b (a ``Partial`` redistributed to ``Replicate``), the weight split over b like the
    hidden. Arithmetic as :class:`trainer.models.layers.RMSNorm` (fp32 statistics, the result cast back)."""

    eps: float  # set by _take_norm, with norm
    norm: nn.Module

    def __init__(self, norm: nn.Module, meshes: _Meshes) -> None:
        self.meshes = meshes
        m = meshes
        self.stats_partial = m.act(a=Shard(ROWS), b=Partial(), c=Shard(ROWS))
        self.stats = m.act(a=Shard(ROWS), c=Shard(ROWS))
        self.w_stored = m.weight(b=Shard(0))
        self.w_grad = m.weight(dp=Partial(), b=Shard(0), c=Partial(), a=Partial())
        self.dim = int(_take_norm(self, norm, meshes, self.w_stored).shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.meshes
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        partial = DTensor.from_local(xf.pow(2).sum(-1, keepdim=True), m.cube, self.stats_partial, run_check=False)
        total = partial.redistribute(m.cube, self.stats).to_local(grad_placements=self.stats_partial)
        rstd = torch.rsqrt(total / self.dim + self.eps)
        weight = cast(DTensor, self.norm.weight)  # a DTensor since __init__
        # Stored as used: the redistribute moves nothing forward; backward it sums the rows' contributions
        # (partial over dp, c and a) into the stored placements.
        w = _average_over_dp(weight.redistribute(m.weights, self.w_stored).to_local(grad_placements=self.w_grad), m)
        return (xf * rstd * w.to(xf.dtype)).type_as(x)


class CubeHeadNorm:
    """A per-head RMSNorm (Qwen3's q/k norms: one weight of head_dim shared by every head) on the heads this rank
    holds: the weight whole on every rank, its gradient's contributions partial over the rows' axes (a, b) and,
    with the heads split over c, over c too (gathered heads are the same on every c rank)."""

    eps: float  # set by _take_norm, with norm
    norm: nn.Module

    def __init__(self, norm: nn.Module, meshes: _Meshes, *, heads_split: bool) -> None:
        self.meshes = meshes
        m = meshes
        self.w_stored = m.weight()
        self.w_grad = m.weight(dp=Partial(), a=Partial(), b=Partial(), c=Partial() if heads_split else Replicate())
        _take_norm(self, norm, meshes, self.w_stored)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.meshes
        weight = cast(DTensor, self.norm.weight)  # a DTensor since __init__
        w = _average_over_dp(weight.redistribute(m.weights, self.w_stored).to_local(grad_placements=self.w_grad), m)
        return rms_on_heads(x, w, self.eps)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale`` (no communication)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _average_over_dp(block: torch.Tensor, meshes: _Meshes) -> torch.Tensor:
    """A weight's local block whose gradient backward's redistribute sums over the dp axes: scaled to their mean."""
    if meshes.dp_size == 1:
        return block
    return cast(torch.Tensor, _ScaleGrad.apply(block, 1.0 / meshes.dp_size))  # type: ignore[no-untyped-call]


def _scatter_into_cube(meshes: _Meshes) -> Any:
    """A forward pre-hook: the whole activation (the same on every rank) -> this rank's residual block."""
    stream = meshes.act(a=Shard(ROWS), b=Shard(HIDDEN), c=Shard(ROWS))
    whole = meshes.act()

    def hook(_mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x = DTensor.from_local(args[0], meshes.cube, whole, run_check=False)
        return (x.redistribute(meshes.cube, stream).to_local(), *args[1:]), kwargs

    return hook


def _gather_from_cube(meshes: _Meshes) -> Any:
    """A forward hook: the last block's residual block -> the whole activation on every rank."""
    stream = meshes.act(a=Shard(ROWS), b=Shard(HIDDEN), c=Shard(ROWS))
    whole = meshes.act()

    def hook(_mod: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(output, meshes.cube, stream, run_check=False).redistribute(meshes.cube,
                                                                                           whole).to_local()

    return hook


def apply_cube(model: nn.Module, mesh: DeviceMesh, *, axes: CubeAxes, first: Sequence[str], second: Sequence[str],
               norms: Sequence[str], attention: Sequence[str], split_heads: bool,
               blocks: Sequence[str]) -> dict[str, str]:
    """Colossal-AI's 3-D layout on ``model``'s blocks; returns ``{module FQN: "cube"}``.

    Args:
        mesh: the world mesh; ``axes`` name its cube axes (and its data-parallel axes).
        first, second: the blocks' Linears in the roles (a, b, c) and (a, c, b): the family's column- and
            row-parallel Linears.
        norms: the blocks' RMSNorms, run on the residual stream with the hidden split over b.
        attention: the attention modules (parents of q/k/v and o).
        split_heads: q/k/v keep their heads split over c; otherwise they are gathered over c and o takes its block.
        blocks: the blocks in forward order; the first takes its block of the input, the last's output is gathered.
    """
    meshes = _Meshes(mesh, axes)
    modules = dict(model.named_modules())
    report: dict[str, str] = {}
    in_attention = {name for name in [*first, *second] if name.rpartition(".")[0] in set(attention)}
    for name in first:
        gather = name in in_attention and not split_heads
        CubeLinear(modules[name], meshes, ("a", "b", "c"), gather_output=gather)
        report[name] = "cube"
    for name in second:
        whole = name in in_attention and not split_heads
        CubeLinear(modules[name], meshes, ("a", "c", "b"), input_whole=whole)
        report[name] = "cube"
    for name in norms:
        CubeRMSNorm(modules[name], meshes)
        report[name] = "cube"
    for name in attention:  # per-head parameters (q/k norms), as the module names them
        for pname in getattr(modules[name], "head_parameters", ()):
            owner = pname.rpartition(".")[0]
            CubeHeadNorm(modules[f"{name}.{owner}"], meshes, heads_split=split_heads)
            report[f"{name}.{owner}"] = "cube"
    present = [b for b in blocks if b in modules]
    if present:
        modules[present[0]].register_forward_pre_hook(_scatter_into_cube(meshes), with_kwargs=True)
        modules[present[-1]].register_forward_hook(_gather_from_cube(meshes))
    return report


__all__ = ["CubeAxes", "CubeHeadNorm", "CubeLinear", "CubeRMSNorm", "apply_cube"]
