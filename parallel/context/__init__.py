"""Context parallelism: each sequence split over a ``cp`` mesh axis, attention still exact.

    apply_context_parallel(model, mesh, dim="cp", method="ring")   # every supporting attention module
    loader rows -> shard_sequence(row, dim=1, cp_rank=r, cp_size=cp)  # each rank its head and tail chunks

The engine is model-agnostic: a module supports context parallelism by declaring an attribute
``context_parallel = None`` and, when it holds a :class:`ContextShard`, attending over the whole
sequence with :func:`context_attention` (the built-in Llama-family attention does); a mixture of
experts declares one too and sums its balance loss's per-sequence statistics over the cp ranks
(:func:`sum_over_context`). Parameters are not split over cp: the cp ranks shard them as more
data-parallel ranks (FSDP over dp x cp, as torchtitan folds cp into its fsdp mesh), see
:func:`parallel.engine.parallelize`.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel.config import ContextParallelMethod
from parallel.context.attention import context_attention, ring_alone, visible
from parallel.context.layout import ContextShard, shard_sequence, token_index, unshard_sequence
from parallel.context.reduce import sum_over_context
from parallel.mesh import submesh


def supports_context_parallel(module: nn.Module) -> bool:
    """Whether ``module`` holds some submodule that attends over a cp-split sequence."""
    return any(hasattr(m, "context_parallel") for m in module.modules())


def apply_context_parallel(module: nn.Module, mesh: DeviceMesh, *, dim: str, method: ContextParallelMethod) -> int:
    """Give every supporting submodule of ``module`` the cp group of mesh axis ``dim``; returns how many."""
    axis = submesh(mesh, dim)
    shard = ContextShard(group=axis.get_group(), rank=axis.get_local_rank(), size=axis.size(), method=method)
    found = 0
    for m in module.modules():
        if hasattr(m, "context_parallel"):
            m.context_parallel = shard  # type: ignore[assignment]  # Module's stub types attributes Tensor | Module
            found += 1
    return found


__all__ = ["ContextShard", "apply_context_parallel", "context_attention", "ring_alone", "shard_sequence",
           "sum_over_context", "supports_context_parallel", "token_index", "unshard_sequence", "visible"]
