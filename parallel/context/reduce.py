"""Per-sequence statistics over a sequence split across a ``cp`` mesh axis: each rank holds some tokens
of every row, so a statistic of the whole row is the sum over the cp ranks of their shares.

    total = sum_over_context(share, shard)   # every cp rank: the whole rows' sum, with its gradient

The backward sums the ranks' gradients as well (an all-reduce each way): every cp rank computes the
same function of the total and adds it to its own loss, and data parallelism averages the gradients
over the cp ranks, so each rank's share must carry the gradient of all of them. That is the token
loss's scale too: each cp rank's loss is its share of the rows' sum over ``1 / cp`` of their tokens
(``cp`` times its share of the mean), and the average over the cp ranks is the whole rows' gradient.
A mixture of experts' balance loss reads its per-sequence choice counts and score sums this way
(:func:`trainer.models.moe.balance_loss`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.context.layout import ContextShard


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) forward; all-reduce (sum) of the gradients backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        total = x.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


def sum_over_context(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """``x`` summed over the cp ranks of ``shard`` (the same on each); with a gradient when ``x`` has one,
    each rank's share receiving the sum of every rank's gradient of the total. A meta tensor (a planner's
    pass, which has no values) is returned as it is."""
    if x.is_meta:
        return x
    if not x.requires_grad:
        total = x.clone()
        dist.all_reduce(total, group=shard.group)
        return total
    return _SumOverRanks.apply(x, shard.group)
