"""``parallel.tensor_parallel_3d`` matched against one model: which Linears take the 3-D matmul's roles, which
norms run on the cube, whether attention's heads split over its side, and what the cube cannot split.

    spec = resolve_cube(parallel, mesh, model, issues)   # a CubeSpec, or None without the section

The family's Megatron plan names the pieces (its column-parallel Linears take the roles (a, b, c), its
row-parallel ones (a, c, b), its sequence-parallel norms run with the hidden split over b), so a model
with a Megatron plan needs nothing more (:mod:`parallel.sharding.tp_cube`).
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch
from torch import nn

from parallel.errors import ConfigIssue, override
from parallel.topology import MeshSpec

PATH = "parallel.tensor_parallel_3d"


@dataclass(frozen=True)
class CubeSpec:
    """The cube's axes (a, b, c) and the modules it splits, by FQN; ``split_heads``: every attention's head and
    kv-head counts divide by the cube's side (else q/k/v are gathered over c for the attention core)."""

    dims: tuple[str, str, str]
    first: tuple[str, ...]
    second: tuple[str, ...]
    norms: tuple[str, ...]
    attention: tuple[str, ...]
    split_heads: bool

    @property
    def modules(self) -> tuple[str, ...]:
        """The modules whose parameters the cube holds (attention's per-head norms with their attention)."""
        return (*self.first, *self.second, *self.norms, *self.attention)


def cube_side(mesh: MeshSpec, dims: tuple[str, ...]) -> int:
    return mesh.size(dims[0]) if dims[0] in mesh.dim_names else 1


def resolve_cube(parallel: object, mesh: MeshSpec, model: nn.Module, issues: list[ConfigIssue]) -> CubeSpec | None:
    """The :class:`CubeSpec` of ``parallel.tensor_parallel_3d`` on ``model``; problems appended to ``issues``."""
    section = getattr(parallel, "tensor_parallel_3d", None)
    if section is None:
        return None
    dims = (section.dims[0], section.dims[1], section.dims[2])
    sizes = [mesh.size(d) for d in dims if d in mesh.dim_names]
    if len(sizes) != 3:
        return None  # an axis missing from parallel.dims is reported with the other axes' issues
    if len(set(sizes)) != 1:
        side = max(sizes)
        shape = [side if name in dims else size for name, size in zip(mesh.dim_names, mesh.shape)]
        issues.append(ConfigIssue("mesh", f"axes {list(dims)} of sizes {sizes} are not a cube: the 3-D matmul cuts "
                                  "X, W and Y into q x q blocks, so its three axes need one size q",
                                  f"give them one size: {override('mesh', shape)}"))
        return None
    provider = getattr(model, "parallel_plan", None)
    if provider is None:
        issues.append(ConfigIssue(PATH, f"model {type(model).__name__} provides no Megatron plan, whose column- and "
                                  "row-parallel Linears the cube splits", "use a Llama-family model (one with a "
                                  "Megatron plan), or tensor parallelism by placements"))
        return None
    if getattr(model, "expert_modules", lambda: [])():
        issues.append(ConfigIssue(PATH, f"model {type(model).__name__} has experts, whose MLP would read the cube's "
                                  "residual block (its hidden split over b) as whole tokens",
                                  "split the experts instead: +parallel=ep (in place of the tp3d preset)"))
        return None
    placements, layouts = provider("megatron", axis="tp", sequence_parallel=True)
    modules = dict(model.named_modules())
    first = _linears(placements, modules, "Shard(0)")
    second = _linears(placements, modules, "Shard(1)")
    norms = [name for name in modules if any(fnmatchcase(name, glob) for glob in layouts)]
    attention = sorted({name.rpartition(".")[0] for name in [*first, *second]
                        if hasattr(modules[name.rpartition(".")[0]], "head_dim")})
    spec = CubeSpec(dims, tuple(first), tuple(second), tuple(norms), tuple(attention),
                    split_heads=all(_heads_split(modules[a], first, modules, a, sizes[0]) for a in attention))
    issues += _check_sizes(spec, modules, mesh, sizes[0])
    return spec


def _linears(placements: dict[str, dict[str, str]], modules: dict[str, nn.Module], placement: str) -> list[str]:
    globs = [glob.removesuffix(".weight") for glob, axes in placements.items()
             if glob.endswith(".weight") and axes.get("tp") == placement]
    return [name for name, module in modules.items()
            if isinstance(module, nn.Linear) and any(fnmatchcase(name, g) for g in globs)]


def _heads_split(attention: nn.Module, first: list[str], modules: dict[str, nn.Module], name: str,
                 side: int) -> bool:
    """Whether every column-parallel projection of ``attention`` (q, k, v) holds a multiple of ``side`` heads."""
    head_dim = int(getattr(attention, "head_dim"))  # noqa: B009  (mypy: nn.Module's attributes are Tensor | Module)
    widths = [_linear(modules, n).out_features for n in first if n.rpartition(".")[0] == name]
    return all(w % head_dim == 0 and (w // head_dim) % side == 0 for w in widths)


def _unsplit(spec: CubeSpec, modules: dict[str, nn.Module], side: int) -> list[str]:
    """What a cube of ``side`` cannot split: a Linear's out features into side^2 blocks or its in features into
    side, a norm's width into side."""
    bad = []
    for name in (*spec.first, *spec.second):
        linear = _linear(modules, name)
        if linear.out_features % (side * side):
            bad.append(f"{name}: out features ({linear.out_features}) do not divide by {side * side}")
        if linear.in_features % side:
            bad.append(f"{name}: in features ({linear.in_features}) do not divide by {side}")
    for name in spec.norms:
        width = _width(modules, name)
        if width % side:
            bad.append(f"{name}: width ({width}) does not divide by {side}")
    return bad


def _linear(modules: dict[str, nn.Module], name: str) -> nn.Linear:
    module = modules[name]
    assert isinstance(module, nn.Linear), "the family's Megatron plan places Linears"
    return module


def _width(modules: dict[str, nn.Module], name: str) -> int:
    weight = modules[name].weight
    assert isinstance(weight, torch.Tensor), "a norm has a weight"
    return int(weight.shape[0])


def _check_sizes(spec: CubeSpec, modules: dict[str, nn.Module], mesh: MeshSpec, side: int) -> list[ConfigIssue]:
    """Every width splits (:func:`_unsplit`); the fix is the largest smaller cube that splits them all."""
    bad = _unsplit(spec, modules, side)
    if not bad:
        return []
    fits = next(q for q in range(side - 1, 0, -1) if not _unsplit(spec, modules, q))
    shape = [fits if name in spec.dims else size for name, size in zip(mesh.dim_names, mesh.shape)]
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    return [ConfigIssue(PATH, f"the cube of side {side} cannot split {bad[0]}{more}",
                        f"use a cube whose side divides the model's widths: {override('mesh', shape)}")]


def cube_traffic(spec: CubeSpec, model: nn.Module, *, side: int, tokens: int, dtype_bytes: int = 4) -> dict[str, float]:
    """Bytes one rank sends in one forward and backward of ``tokens`` token rows (a data-parallel rank's
    micro-batch) on a cube of ``side`` q, by term, with ring collectives (an all-gather or reduce-scatter over n
    ranks sends (n - 1) / n of the whole buffer, an all-reduce twice that):

    * ``3-D matmul``: the paper's volume, per Linear ``[m, k] x [k, n]`` ``2 (q - 1) / q^3 (mk + kn + mn)``
      elements (X gathered over c and its gradient reduce-scattered, W gathered over a and its gradient
      reduce-scattered, Y reduce-scattered over b and its gradient gathered);
    * ``heads gathered``: q/k/v gathered over c and o's input gradient likewise, when heads do not split;
    * ``norm statistics``: each norm's row sums of squares all-reduced over b, forward and backward;
    * ``norm weights``: each norm weight's gradient all-reduced over c, then over a;
    * ``entry / exit``: the first block's input gradient and the last block's output gathered whole.
    """
    modules = dict(model.named_modules())
    q, m = side, tokens
    matmul = gathered = 0.0
    attention_first = {n for n in spec.first if n.rpartition(".")[0] in spec.attention}
    attention_second = {n for n in spec.second if n.rpartition(".")[0] in spec.attention}
    for name in (*spec.first, *spec.second):
        linear = _linear(modules, name)
        k, n = linear.in_features, linear.out_features
        matmul += 2 * (q - 1) / q**3 * (m * k + k * n + m * n)
        if not spec.split_heads and name in attention_first:
            gathered += (q - 1) / q**3 * m * n
        if not spec.split_heads and name in attention_second:
            gathered += (q - 1) / q**3 * m * k
    ring = 2 * (q - 1) / q  # an all-reduce over q ranks, per element
    widths = [_width(modules, name) for name in spec.norms]
    hidden = widths[0] if widths else 0
    terms = {"3-D matmul (paper)": matmul, "heads gathered": gathered,
             "norm statistics": len(widths) * 2 * ring * m / q**2,
             "norm weights": sum(2 * ring * w / q for w in widths),
             "entry / exit": 2 * m * hidden * (1 - 1 / q**3)}
    return {term: value * dtype_bytes for term, value in terms.items()}


def cube_memory(spec: CubeSpec, model: nn.Module, *, side: int, tokens: int, dtype_bytes: int = 4) -> dict[str, float]:
    """Bytes one rank holds, by term: its blocks of the cube's weights (a Linear ``[n, k]``: ``kn / q^3``; a norm:
    ``H / q``), the other weights whole, and what the cube keeps for backward of ``tokens`` token rows: each
    Linear its gathered input block ``[m / q, k / q]`` and gathered weight block ``[n / q, k / q]``, each norm its
    input and normalised input ``[m / q^2, H / q]`` and one scale per row (``m / q^2``)."""
    modules = dict(model.named_modules())
    q, m = side, tokens
    cube_params = {id(p) for name in spec.modules for p in modules[name].parameters()}
    linears = [_linear(modules, name) for name in (*spec.first, *spec.second)]
    widths = [_width(modules, name) for name in spec.norms]
    terms = {
        "cube weights": sum(lin.in_features * lin.out_features / q**3 for lin in linears) + sum(w / q for w in widths),
        "whole weights": float(sum(p.numel() for p in model.parameters() if id(p) not in cube_params)),
        "Linear activations": sum((m * lin.in_features + lin.out_features * lin.in_features) / q**2 for lin in linears),
        "norm activations": sum(2 * m * w / q**3 + m / q**2 for w in widths),
    }
    return {term: value * dtype_bytes for term, value in terms.items()}
