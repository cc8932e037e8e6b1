"""Exact attention over a sequence split across a ``cp`` mesh axis (see :mod:`parallel.context.layout`).

Each rank holds its queries, keys and values for its share of the tokens; every query must still
see every key the full-sequence mask allows. Two ways, chosen by ``parallel.context_parallel.method``:

* ``allgather``: the ranks all-gather K/V once per layer and run ``scaled_dot_product_attention``
  of their queries against the whole sequence, masked by true positions. Simple; K/V of the full
  sequence live on every rank for the layer.
* ``ring``: K/V blocks travel around the ring of cp ranks, one hop per step; each rank attends its
  queries to the block it holds and merges the partial results by their log-sum-exp (online
  softmax), so only two blocks are alive at a time. A block nothing may see (a later rank's head
  under a causal mask) is skipped. Each block runs a fused attention kernel (CPU's flash kernel;
  CUDA's flash kernel in bf16 / fp16) inside one autograd Function that keeps nothing per block
  (:mod:`parallel.context.ring`).

Both are differentiable end to end: K/V travel through autograd-aware communication (the ring's
backward sends the K/V gradients the other way round; the all-gather's is a reduce-scatter), so the
backward is the exact gradient of full attention, whatever the mask.

Why not ``torch.distributed.tensor.experimental.context_parallel``: in torch 2.13 it reroutes the
CUDA SDPA kernels (flash, efficient, cuDNN) only; on CPU, SDPA runs
``aten._scaled_dot_product_flash_attention_for_cpu``, for which it has no ring and DTensor no
sharding rule ("does not have a sharding strategy registered"), and it cannot mask packed
documents. The tests and the CPU workers need both, so the ring is written here.

    out = context_attention(q, k, v, shard=shard, q_index=shard.token_index(q.shape[2]))
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_gather_single_autograd

from parallel.context.layout import ContextShard
from parallel.context.ring import BlockMaskValue, fused_ring


def _start_shift(x: torch.Tensor, group: dist.ProcessGroup) -> Callable[[], torch.Tensor]:
    """Start sending ``x`` to the next rank of the cp ring and receiving the previous rank's; returns
    a function that waits for both and gives what was received (the fused ring computes meanwhile)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty_like(x)
    x = x.contiguous()
    ops = [dist.P2POp(dist.isend, x, group=group, group_peer=(rank + 1) % size),
           dist.P2POp(dist.irecv, received, group=group, group_peer=(rank - 1) % size)]
    works = dist.batch_isend_irecv(ops)

    def wait() -> torch.Tensor:
        for work in works:
            work.wait()
        return received

    return wait


def visible(q_index: torch.Tensor, k_index: torch.Tensor, *, causal: bool, q_doc: torch.Tensor | None = None,
            k_doc: torch.Tensor | None = None) -> torch.Tensor:
    """``[B or 1, Tq, Tk]`` boolean: which keys each query may see, from true token positions
    (``q_index [Tq]``, ``k_index [Tk]``) and, for packed documents, each token's document
    (``q_doc [B, Tq]``, ``k_doc [B, Tk]``: the position its document starts at)."""
    mask = (k_index[None, :] <= q_index[:, None]) if causal else torch.ones(
        len(q_index), len(k_index), dtype=torch.bool, device=q_index.device)
    mask = mask[None]
    if q_doc is not None:
        assert k_doc is not None, "packed documents give the keys' documents too"
        mask = mask & (q_doc[:, :, None] == k_doc[:, None, :])
    return mask


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, shard: ContextShard,
                      q_index: torch.Tensor, causal: bool = True, doc: torch.Tensor | None = None,
                      scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, equal to full attention.

    Args:
        q: ``[B, H, Tl, D]`` this rank's queries; ``k``, ``v``: ``[B, Hkv, Tl, D]`` its keys and values,
            ``H`` a multiple of ``Hkv`` (grouped-query heads: query head ``h`` reads kv head ``h // (H / Hkv)``).
        shard: the cp group and method (:class:`~parallel.context.layout.ContextShard`).
        q_index: ``[Tl]`` the true positions of this rank's tokens (``shard.token_index(Tl)``).
        causal: mask keys after each query (by true position).
        doc: ``[B, Tl]`` packed documents: the true position each token's document starts at; a
            query sees only keys of its own document.
        scale: the softmax scale; default ``1 / sqrt(D)``, as ``scaled_dot_product_attention``.
    Returns ``[B, H, Tl, D]`` in ``q``'s dtype.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    docs = _gather_plain(doc, shard) if doc is not None else None
    if shard.method == "allgather":
        return _allgather_attention(q, k, v, shard=shard, q_index=q_index, causal=causal, doc=doc, docs=docs,
                                    scale=scale)
    return _ring_attention(q, k, v, shard=shard, q_index=q_index, causal=causal, doc=doc, docs=docs, scale=scale)


def _gather_plain(x: torch.Tensor, shard: ContextShard) -> list[torch.Tensor]:
    """Every cp rank's ``x`` (no gradient: document starts are integers)."""
    parts = [torch.empty_like(x) for _ in range(shard.size)]
    dist.all_gather(parts, x.contiguous(), group=shard.group)
    return parts


def _allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, shard: ContextShard,
                         q_index: torch.Tensor, causal: bool, doc: torch.Tensor | None,
                         docs: list[torch.Tensor] | None, scale: float) -> torch.Tensor:
    tl = q.shape[2]
    # One message for K and V; autograd's backward of the gather is a reduce-scatter of their gradients.
    kv = all_gather_single_autograd(torch.stack((k, v)).contiguous(), 3, shard.group)
    k_all, v_all = kv[0], kv[1]
    k_index = torch.cat([shard.token_index(tl, rank=r, device=q.device) for r in range(shard.size)])
    k_doc = torch.cat(docs, dim=1) if docs is not None else None
    mask = visible(q_index, k_index, causal=causal, q_doc=doc, k_doc=k_doc)[:, None]
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k_all, v_all = k_all.repeat_interleave(rep, dim=1), v_all.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale)


def _ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, shard: ContextShard, q_index: torch.Tensor,
                    causal: bool, doc: torch.Tensor | None, docs: list[torch.Tensor] | None,
                    scale: float) -> torch.Tensor:
    tl = q.shape[2]

    def seen(step: int) -> torch.Tensor:
        """``[B or 1, Tl, Tl]``: which keys of the block held at ``step`` each query may see."""
        source = (shard.rank - step) % shard.size  # whose K/V this rank holds at this step
        return visible(q_index, shard.token_index(tl, rank=source, device=q.device), causal=causal, q_doc=doc,
                       k_doc=docs[source] if docs is not None else None)

    def mask(step: int) -> BlockMaskValue:
        if doc is None and (not causal or step == 0):  # the whole block, or its own (positions rise: the triangle)
            return "causal" if causal else None
        if doc is None:  # causal: from the positions alone, no Tl x Tl mask made
            return _causal_block(q_index, shard.token_index(tl, rank=(shard.rank - step) % shard.size, device=q.device))
        block = seen(step)  # packed documents: the block's mask, made for this step and dropped after it
        # Step 0 (its own block) always holds every query's own key, so only a later block is skipped.
        if step and not bool(block.any()):
            return "skip"
        return None if bool(block.all()) else block

    return fused_ring(q, k, v, masks=mask, send=lambda x: _start_shift(x, shard.group), steps=shard.size,
                      scale=scale)


def _causal_block(q_index: torch.Tensor, k_index: torch.Tensor) -> BlockMaskValue:
    """The ring's :data:`~parallel.context.ring.BlockMask` of a causal block from rising positions: a
    query sees a prefix of the keys (those at or before it). Under the balanced split every other
    rank's block is a rectangle, all queries over the head chunk or the tail queries over all keys:
    ``(queries, keys)`` slices; any other staircase, the boolean mask."""
    seen = torch.searchsorted(k_index, q_index, right=True)  # how many keys each query sees
    counts = seen.unique()  # type: ignore[no-untyped-call]  # torch: untyped
    if counts.tolist() == [0]:
        return "skip"
    if counts.tolist() == [len(k_index)]:
        return None
    if len(counts) == 1 or (len(counts) == 2 and int(counts[0]) == 0):
        rows = (seen > 0).nonzero().flatten()
        if len(rows) == int(rows[-1]) - int(rows[0]) + 1:
            return slice(int(rows[0]), int(rows[-1]) + 1), slice(0, int(counts[-1]))
    return visible(q_index, k_index, causal=True)


def ring_alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, blocks: int, causal: bool = False,
               scale: float | None = None, merged: bool = False) -> torch.Tensor:
    """The ring's arithmetic on one process, with its own K/V (a copy each step, as a received block)
    standing in for each of ``blocks`` blocks, nothing sent: what a cp rank's ring saves for backward
    and makes at its worst moment, for a memory and time model's pass on the meta device. Unmasked;
    ``causal``: with the shapes a causal mask gives the balanced split (the own block's triangle, then
    every query over half of each other block's keys). Not attention over anything real.

    What the ring keeps and its worst moment do not grow with ``blocks`` (each step's block replaces
    the last): a memory model counts ``min(cp, 3)`` blocks. ``merged``: the ``blocks - 1`` received
    blocks as one kernel call over their keys side by side, the FLOPs of all of them in two calls (a
    time model's pass at cp 512 runs 2 kernels a layer rather than 512; it leaves out the skipped
    calls' launches and merges, and holds ``blocks - 1`` blocks at once: no memory model's)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    tokens = k.shape[2]
    half = slice(0, tokens // 2)
    if not merged or blocks <= 3:
        return fused_ring(q, k, v, masks=lambda step: ("causal" if step == 0 else (slice(None), half)) if causal
                          else None,
                          send=lambda x: _arrived(x.clone()), steps=blocks, scale=scale)
    # Merged: two steps, the second's block the received blocks' keys side by side (longer than the
    # rank's own: a causal row's cp - 1 halves, cp - 1 > 2); the hop home gives back the own block's shape.
    keys = half if causal else slice(None)

    def send(x: torch.Tensor) -> Callable[[], torch.Tensor]:
        if x.shape[3] == tokens:
            return _arrived(x[:, :, :, keys].repeat(1, 1, 1, blocks - 1, 1))
        return _arrived(x[:, :, :, :tokens].clone())

    return fused_ring(q, k, v, masks=lambda step: "causal" if causal and step == 0 else None, send=send, steps=2,
                      scale=scale)


def _arrived(block: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A hop that has already happened: waiting for it gives ``block`` (made when it was sent)."""
    return lambda: block
