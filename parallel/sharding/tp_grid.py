"""Colossal-AI's 2-D (Optimus / SUMMA) and 2.5-D (Tesseract) tensor parallelism, as DTensor placements.

    apply_grid(model, mesh, rows="row", cols="col", blocks=["layers.0", "layers.1"])

The blocks' activations and weights are both partitioned over a ``q x q`` grid of ranks (mesh axes
``rows`` = r and ``cols`` = c); 2.5-D adds a depth axis d of ``q x q`` grids side by side.

**2-D, Optimus (Xu et al. 2021, "An Efficient 2D Method for Training Super-Large Deep Learning
Models") on SUMMA (van de Geijn & Watts 1997).** A layer ``Y = X W`` with ``X [b, h]`` and ``W [h, h']``
stores block ``X_ij`` (rows ``i`` of the tokens, columns ``j`` of the hidden) and block ``W_ij`` on the
rank at grid position ``(i, j)``. SUMMA forms ``Y_ij = sum_k X_ik W_kj`` by broadcasting ``X_ik`` along
grid row ``i`` and ``W_kj`` along grid column ``j`` for ``k = 1..q``; the ``q`` broadcasts of one
row together are an all-gather of ``X_i.`` over the row, those of one column an all-gather of
``W_.j`` over the column. Here, as DTensor placements on the grid mesh ``(r, c)``:

* the residual stream ``[B, T, h]`` is ``(Shard(0), Shard(2))``: batch rows over r, hidden over c;
* an ``nn.Linear`` weight ``[out, in]`` (``W^T``) is stored ``(Shard(1), Shard(0))``: its input rows
  over r, its output columns over c, ``h h' / q^2`` elements per rank;
* forward: ``X.redistribute((Shard(0), Replicate()))`` (the all-gather over c of SUMMA's ``X``
  broadcasts) and ``W.redistribute((Replicate(), Shard(0)))`` (the all-gather over r of its ``W``
  broadcasts), then one local matmul gives ``Y`` as ``(Shard(0), Shard(2))``: the input's layout again;
* backward is autograd of those two redistributions: ``dX`` is summed over c by a reduce-scatter
  (SUMMA's ``dX_ik = sum_j dY_ij W_kj^T``, reduced along row ``i``) and ``dW`` over r by a
  reduce-scatter (``dW_kj = sum_i X_ik^T dY_ij``, reduced along column ``j``), Optimus's backward.

Per layer and rank that is ``(q-1)/q`` of ``X_i.`` (``b h / q`` elements) and of ``W_.j``
(``h h' / q``) in forward, the same again in backward: Optimus's ``O(b h / q + h h' / q)`` per rank.
Each Linear is one SUMMA product with its own gathers, as Colossal-AI's ``Linear2D`` is (attention's q,
k and v each gather the norm's output).

The block norms run on the sharded hidden, as Optimus's (and Colossal-AI's ``LayerNorm2D``): their
row statistics are reduced over c (one value per token), their weight is ``(Replicate(), Shard(0))``.
Attention acts per head on whole sequences: the q/k/v outputs ``(Shard(0), Shard(2))`` hold this
rank's batch rows and its ``1/q`` of the heads (kv heads alike), so the scaled-dot-product attention
is local and its output, this rank's heads, is exactly the ``in`` block the output projection's
input gathers. Per-head q/k norms (Qwen3: one weight of ``head_dim`` shared by every head) act on those
local heads: their weight is whole on every rank (``WHOLE``), and its gradient, this rank's rows' and heads'
share, is summed over the grid (``Partial`` over r and c, all-reduced by the redistribute's backward), as the
3-D cube's :class:`parallel.sharding.tp_cube.CubeHeadNorm` does. The embedding, the final norm and the head
stay outside the grid (replicated over it): the stream enters the first block as a local slice and leaves the
last by one all-gather.

**2.5-D, Tesseract (Wang et al. 2021, "2.5-dimensional distributed model training", arXiv
2105.14500).** ``p = d q^2`` ranks as ``d`` layers of ``q x q`` grids: ``X [b, h]`` is cut into ``d q``
row blocks, the ``k``-th layer runs the 2-D SUMMA above on its ``q`` of them, and ``W`` is stored once
per layer (replicated over d), its gradient summed over the layers (Tesseract's all-reduce of ``dW``
among depth). The depth axis therefore splits the batch as a data-parallel axis does and wraps the
parameters as one (:attr:`parallel.topology.Topology.batch_axes`): each layer's grid holds the same
``(Shard(1), Shard(0))`` weight blocks, and DDP (or FSDP, sharding them further) over d sums their
gradients. ``d = 1`` is 2-D; a data-parallel axis beside d is more depth.

What this module does not do: split the embedding, the head or the loss over the grid, and the
parts of a block it does not recognise (experts, LoRA adapters, biases other
than a Linear's own): validation refuses those models (:mod:`trainer.validate.grid_checks`).
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from parallel.sharding.head_params import norm_eps, rms_on_heads

# The layouts on the grid mesh (r, c).
STREAM = (Shard(0), Shard(2))            # batch rows over r, hidden over c: the residual stream, every Linear's output
GATHERED = (Shard(0), Replicate())       # a Linear's input: the hidden whole (all-gathered over c)
WEIGHT = (Shard(1), Shard(0))            # nn.Linear [out, in]: in over r, out over c
WEIGHT_GATHERED = (Replicate(), Shard(0))  # a Linear's weight at use: its in whole (all-gathered over r)
VECTOR = (Replicate(), Shard(0))         # a bias or norm weight [h]: its columns over c
WHOLE = (Replicate(), Replicate())
SUMMED = (Partial(), Partial())          # a per-head norm weight's gradient on one rank: its rows' and heads' share


def apply_grid(part: nn.Module, mesh: DeviceMesh, *, rows: str, cols: str, blocks: Sequence[str]) -> dict[str, str]:
    """Partition every block of ``part`` named in ``blocks`` over the grid ``(rows, cols)`` of ``mesh``:
    its Linears SUMMA-style, its norms on the hidden's shards, attention (and its per-head q/k norms) on this
    rank's heads. Returns ``{module FQN: style}`` (``grid_linear``, ``grid_norm``, ``grid_head_norm``,
    ``grid_stream``)."""
    grid = mesh if tuple(mesh.mesh_dim_names or ()) == (rows, cols) else mesh[(rows, cols)]  # 2-D, not flattened
    modules = dict(part.named_modules())
    present = [fqn for fqn in blocks if fqn in modules]
    report: dict[str, str] = {}
    for fqn in present:
        block = modules[fqn]
        attention = _attention_of(block)
        head_norms = _head_norms(attention)
        for name, module in block.named_modules():
            full = f"{fqn}.{name}" if name else fqn
            if any(module is norm for norm in head_norms):
                _grid_head_norm(module, grid)
                report[full] = "grid_head_norm"
            elif isinstance(module, nn.Linear):
                _grid_linear(module, grid, local_out=attention is not None and _projects_heads(attention, module))
                report[full] = "grid_linear"
            elif isinstance(module, nn.RMSNorm) and module.weight is not None:
                _grid_norm(module, grid)
                report[full] = "grid_norm"
        block.register_forward_pre_hook(_local_positions(grid), with_kwargs=True)
        report[fqn] = "grid_stream"
    if present:
        modules[present[0]].register_forward_pre_hook(_enter(grid))
        modules[present[-1]].register_forward_hook(_leave(grid))
    return report


# --------------------------------------------------------------------------- the stream in and out


def _enter(grid: DeviceMesh) -> Any:
    """The first block's input, replicated over the grid, becomes its ``STREAM`` shard: a local slice
    forward; backward all-gathers the stream's gradient, whole again for the embedding."""

    def hook(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x, *rest = args
        if isinstance(x, DTensor):
            return args
        stream = DTensor.from_local(x, grid, WHOLE, run_check=False).redistribute(grid, STREAM)
        return (stream, *rest)

    return hook


def _leave(grid: DeviceMesh) -> Any:
    """The last block's output, all-gathered over the grid: the final norm and the head see it whole."""

    def hook(_module: nn.Module, _args: tuple[Any, ...], out: Any) -> Any:
        return out.redistribute(grid, WHOLE).to_local() if isinstance(out, DTensor) else out

    return hook


def _local_positions(grid: DeviceMesh) -> Any:
    """Packed documents' positions ``[B, T]``: this rank's batch rows, as the stream holds them."""
    rows = grid.size(0)
    row = grid.get_local_rank(0)

    def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        positions = kwargs.get("positions")
        if isinstance(positions, torch.Tensor) and not isinstance(positions, DTensor):
            kwargs = {**kwargs, "positions": positions.chunk(rows, dim=0)[row]}
        return args, kwargs

    return hook


# --------------------------------------------------------------------------- Linears and norms


def _grid_linear(linear: nn.Linear, grid: DeviceMesh, *, local_out: bool) -> None:
    """``linear``'s weight stored ``WEIGHT`` (its bias ``VECTOR``) and its forward SUMMA's:
    input gathered over c, weight gathered over r, a local matmul. ``local_out``: the output leaves as
    this rank's local block (attention's q/k/v: its batch rows and heads). A plain input is such a block
    (the attention core's output, this rank's heads): it is taken as the stream's layout."""
    linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), grid, WEIGHT, src_data_rank=None),
                                 requires_grad=linear.weight.requires_grad)
    if linear.bias is not None:
        linear.bias = nn.Parameter(distribute_tensor(linear.bias.detach(), grid, VECTOR, src_data_rank=None),
                                   requires_grad=linear.bias.requires_grad)

    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, grid, STREAM, run_check=False)
        weight = self.weight
        assert isinstance(weight, DTensor), "placed by _grid_linear"
        gathered = x.redistribute(grid, GATHERED)
        y = F.linear(gathered, weight.redistribute(grid, WEIGHT_GATHERED), self.bias)
        return y.to_local() if local_out and isinstance(y, DTensor) else y

    linear.forward = types.MethodType(forward, linear)  # type: ignore[method-assign]


def _grid_norm(norm: nn.RMSNorm, grid: DeviceMesh) -> None:
    """A block norm on the stream's hidden shards: its weight ``VECTOR``, its row statistics reduced
    over c by DTensor (one value per token)."""
    assert norm.weight is not None, "only norms with a weight are placed"
    norm.weight = nn.Parameter(distribute_tensor(norm.weight.detach(), grid, VECTOR, src_data_rank=None),
                               requires_grad=norm.weight.requires_grad)

    def forward(self: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
        # rms_norm's arithmetic out of place (DTensor has no in-place add on a pending mean).
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        eps = self.eps if self.eps is not None else torch.finfo(xf.dtype).eps
        square_sum = xf.pow(2).sum(-1, keepdim=True)
        if isinstance(square_sum, DTensor):  # a Partial(sum) over c: one all-reduce of a value per token
            square_sum = square_sum.redistribute(grid, GATHERED)
        rstd = torch.rsqrt(square_sum / x.shape[-1] + eps)
        return (xf * rstd * self.weight.to(xf.dtype)).type_as(x)

    norm.forward = types.MethodType(forward, norm)  # type: ignore[method-assign]


def _grid_head_norm(norm: nn.Module, grid: DeviceMesh) -> None:
    """A per-head RMSNorm (over ``head_dim``) on this rank's batch rows and heads, a plain local tensor: its
    weight ``WHOLE``; used as this rank's local copy whose gradient is ``SUMMED``, so backward's redistribute
    all-reduces the rows' and heads' shares over the grid (the one-device gradient sums every head's)."""
    weight = norm.weight
    assert isinstance(weight, torch.Tensor), "only norms with a weight are placed"
    norm.weight = nn.Parameter(distribute_tensor(weight.detach(), grid, WHOLE, src_data_rank=None),
                               requires_grad=weight.requires_grad)
    eps = norm_eps(norm, weight.dtype)

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        stored = self.weight
        assert isinstance(stored, DTensor), "placed by _grid_head_norm"
        return rms_on_heads(x, stored.redistribute(grid, WHOLE).to_local(grad_placements=SUMMED), eps)

    norm.forward = types.MethodType(forward, norm)


# --------------------------------------------------------------------------- attention


def _attention_of(block: nn.Module) -> nn.Module | None:
    return next((m for m in block.modules() if hasattr(m, "head_dim") and hasattr(m, "_names")), None)


def _head_norms(attention: nn.Module | None) -> list[nn.Module]:
    """The attention's per-head norms: the modules owning the parameters it names in ``head_parameters``
    (:mod:`parallel.sharding.head_params`), e.g. Qwen3's ``q_norm`` and ``k_norm``."""
    if attention is None:
        return []
    owners = (name.rpartition(".")[0] for name in getattr(attention, "head_parameters", ()))
    return [attention.get_submodule(owner) for owner in owners]


def _projects_heads(attention: nn.Module, linear: nn.Linear) -> bool:
    """Whether ``linear`` is one of the attention's q, k, v projections (named by its ``_names``)."""
    names: Any = attention._names
    return any(getattr(attention, n, None) is linear for n in (names.q, names.k, names.v))


__all__ = ["apply_grid"]
