"""Next-token cross-entropy that never holds the whole sequence's fp32 log-probabilities.

    total = cross_entropy_sum(logits, targets, chunk_tokens=4096)   # sum over the targets that count

``F.cross_entropy`` on ``[N, V]`` logits upcasts them to fp32 and saves the fp32 log-softmax
``[N, V]`` for backward: at a 128k vocabulary and 16k tokens that is 8 GiB beside the logits. Here
the ``N`` tokens are taken ``chunk_tokens`` at a time; each chunk's upcast, log-softmax and loss run
under ``torch.utils.checkpoint`` (non-reentrant), which keeps only the chunk's inputs (views of the
logits, which exist anyway) and recomputes the chunk in backward, one chunk at a time. So at most
one chunk's fp32 exists at once, forward or backward; the losses and gradients are the unchunked
ones up to the order of an fp32 sum. Works on loss parallel's vocabulary shards too (a ``Shard``
DTensor on the last dim, under ``torch.distributed.tensor.parallel.loss_parallel``): a chunk of
tokens is a slice of the other dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100  # a target that does not count (torch's cross_entropy default; the chat data's mask)


def _chunk_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # fp32: a bf16 log-softmax over a large vocabulary loses the precision the loss needs.
    return F.cross_entropy(logits.float(), targets, reduction="sum", ignore_index=IGNORE_INDEX)


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, *, chunk_tokens: int | None = None) -> torch.Tensor:
    """The summed cross-entropy of ``logits [..., V]`` against ``targets [...]`` over the targets that are
    not ``-100``; ``chunk_tokens`` (None or 0: all at once) tokens at a time, each chunk recomputed in backward."""
    flat, labels = logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
    tokens = labels.shape[0]
    if not chunk_tokens or tokens <= chunk_tokens:
        return _chunk_sum(flat, labels)
    total = None
    for start in range(0, tokens, chunk_tokens):
        part = checkpoint(_chunk_sum, flat[start:start + chunk_tokens], labels[start:start + chunk_tokens],
                          use_reentrant=False)
        total = part if total is None else total + part
    return total


def cross_entropy_mean(logits: torch.Tensor, targets: torch.Tensor, *, chunk_tokens: int | None = None) -> torch.Tensor:
    """``F.cross_entropy``'s mean (over the targets that count), computed as :func:`cross_entropy_sum`."""
    if not chunk_tokens or targets.numel() <= chunk_tokens:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
    count = (targets != IGNORE_INDEX).sum()
    return cross_entropy_sum(logits, targets, chunk_tokens=chunk_tokens) / count
