"""Next-token cross-entropy that never holds the whole sequence's fp32 log-probabilities.

    total = cross_entropy_sum(logits, targets, chunk_tokens=4096)   # sum over the targets that count

``F.cross_entropy`` on ``[N, V]`` logits upcasts them to fp32 and saves the fp32 log-softmax ``[N, V]``
for backward, whose gradient and the logits' gradient then sit beside it: three ``[N, V]`` fp32 tensors
at a 128k vocabulary and 16k tokens are 24 GiB. Here the ``N`` tokens are taken ``chunk_tokens`` at a
time, and each chunk's gradient is computed in the forward pass (the softmax less the one-hot target,
as Megatron-LM's and Liger-Kernel's fused cross-entropies do): a chunk's fp32 upcast and softmax exist
only while it is computed, and what is kept for backward is the logits' gradient in the logits' own
dtype (``[N, V]``, which backward needs anyway), scaled in place by the loss's gradient. The logits
themselves are not kept (the head's backward needs its input, not its output).

On loss parallel's vocabulary shards (a ``Shard`` DTensor on the last dim, over one mesh axis) the same
runs on each rank's shard: the row maxima, the sums of exponentials and the target logits are summed
(or maxed) over the axis's ranks, three all-reduces of ``[chunk]`` per chunk, as Megatron-LM's
vocabulary-parallel cross-entropy does; the loss is then the same on every rank of the axis.

The losses and gradients are the unchunked ones up to the order of fp32 sums (tests: rel 1e-5).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

IGNORE_INDEX = -100  # a target that does not count (torch's cross_entropy default; the chat data's mask)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum of the cross-entropy of ``logits [N, V_local]`` (this rank's vocabulary columns from ``offset``;
    ``group`` sums over the ranks holding the others, ``None``: all of them here) against ``targets [N]``."""

    @staticmethod
    def forward(ctx, logits, targets, chunk_tokens, offset, group, need_grad):
        # Evaluation (no gradient wanted) makes no [N, V] gradient buffer.
        grad = torch.empty_like(logits) if need_grad else None
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        width = logits.shape[-1]
        for start in range(0, logits.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            total += _chunk(logits[rows], targets[rows], grad[rows] if need_grad else None, offset, width, group)
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        # In place, as Megatron-LM scales its fused gradient: the [N, V] buffer is this node's alone and
        # its only use; a second backward through the node (retain_graph) would find it scaled, so refuse one.
        if getattr(ctx, "done", False):
            raise RuntimeError("the chunked cross-entropy's backward ran twice; use train.loss_chunk_tokens=0")
        ctx.done = True
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_total.to(grad.dtype)), None, None, None, None, None


def _chunk(logits: torch.Tensor, targets: torch.Tensor, grad_out: torch.Tensor | None, offset: int, width: int,
           group: dist.ProcessGroup | None) -> torch.Tensor:
    """One chunk's summed loss; writes its gradient (softmax less the one-hot target, zero where ignored) into
    ``grad_out`` when given."""
    x = logits.float()  # fp32: a bf16 log-softmax over a large vocabulary loses the precision the loss needs
    row_max = x.max(dim=-1).values
    if group is not None:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    x = x - row_max[:, None]
    exp = x.exp()
    sum_exp = exp.sum(dim=-1)
    valid = targets != IGNORE_INDEX
    local = targets - offset
    here = valid & (local >= 0) & (local < width)  # this rank holds the target's column
    index = torch.where(here, local, 0)
    target_logit = torch.where(here, x.gather(1, index[:, None]).squeeze(1), 0.0)
    if group is not None:
        dist.all_reduce(sum_exp, group=group)
        dist.all_reduce(target_logit, group=group)
    loss = torch.where(valid, sum_exp.log() - target_logit, 0.0)
    if grad_out is None:
        return loss.sum()
    exp.div_(sum_exp[:, None])  # the softmax
    exp.scatter_add_(1, index[:, None], -here[:, None].to(exp.dtype))  # less the one-hot target (data-independent)
    exp.mul_(valid[:, None])
    grad_out.copy_(exp)
    return loss.sum()


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, *, chunk_tokens: int | None = None) -> torch.Tensor:
    """The summed cross-entropy of ``logits [..., V]`` against ``targets [...]`` over the targets that are
    not ``-100``; ``chunk_tokens`` (None or 0: ``F.cross_entropy`` on the whole) tokens at a time, gradients
    made in forward (a plain tensor, or a DTensor sharded on the vocabulary over one mesh axis)."""
    flat, labels = logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
    if not chunk_tokens or labels.shape[0] <= chunk_tokens:
        # fp32: a bf16 log-softmax over a large vocabulary loses the precision the loss needs.
        return _plain(F.cross_entropy(flat.float(), labels, reduction="sum", ignore_index=IGNORE_INDEX))
    if isinstance(flat, DTensor):
        return _sharded_sum(flat, labels, chunk_tokens)
    return _ChunkedCrossEntropy.apply(flat, labels, chunk_tokens, 0, None, _wants_grad(flat))


def _sharded_sum(flat: DTensor, labels: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """The chunked loss of vocabulary shards: each rank its columns, the sums over the sharding axis."""
    axes = [i for i, p in enumerate(flat.placements) if p.is_shard(flat.dim() - 1)]
    if len(axes) != 1 or any(not p.is_replicate() for i, p in enumerate(flat.placements) if i != axes[0]):
        raise ValueError(f"a chunked cross-entropy of logits placed {flat.placements}: only vocabulary shards over "
                         "one mesh axis (loss parallel) are supported; set train.loss_chunk_tokens=0")
    mesh, axis = flat.device_mesh, axes[0]
    local = flat.to_local()
    # torch.chunk's split, as DTensor's Shard places columns: rank r holds ceil(V / n) from r ceil(V / n).
    per = -(-flat.shape[-1] // mesh.size(axis))
    offset = per * mesh.get_local_rank(axis)
    return _ChunkedCrossEntropy.apply(local, labels, chunk_tokens, offset, mesh.get_group(axis), _wants_grad(local))


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain tensor, as the chunked path gives it: under loss parallel, torch's cross-entropy of
    vocabulary shards is a replicated DTensor scalar, which a plain term (an MoE's balance loss) cannot join."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _wants_grad(logits: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and logits.requires_grad


def cross_entropy_mean(logits: torch.Tensor, targets: torch.Tensor, *, chunk_tokens: int | None = None) -> torch.Tensor:
    """``F.cross_entropy``'s mean (over the targets that count), computed as :func:`cross_entropy_sum`."""
    if not chunk_tokens or targets.numel() <= chunk_tokens:
        return _plain(F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1)))
    count = (targets != IGNORE_INDEX).sum()
    return cross_entropy_sum(logits, targets, chunk_tokens=chunk_tokens) / count
