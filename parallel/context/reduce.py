"""Per-sequence statistics over a sequence split across a ``cp`` mesh axis: each rank holds some tokens
of every row, so a statistic of the whole row is the sum over the cp ranks of their shares.

    total = sum_over_context(share, shard)   # every cp rank: the whole rows' sum, with its gradient

The backward sums the ranks' gradients as well (an all-reduce each way, ``torch.distributed.nn``'s): every cp rank
computes the same function of the total and adds it to its own loss, and data parallelism averages the gradients
over the cp ranks, so each rank's share must carry the gradient of all of them. That is the token
loss's scale too: each cp rank's loss is its share of the rows' sum over ``1 / cp`` of their tokens
(``cp`` times its share of the mean), and the average over the cp ranks is the whole rows' gradient.
A mixture of experts' balance loss reads its per-sequence choice counts and score sums this way
(:func:`trainer.models.moe.balance_loss`).
"""

from __future__ import annotations

import torch
import torch.distributed.nn.functional as dist_nn

from parallel.context.layout import ContextShard


def sum_over_context(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """``x`` summed over the cp ranks of ``shard`` (the same on each); with a gradient when ``x`` has one,
    each rank's share receiving the sum of every rank's gradient of the total (torch's autograd
    all-reduce). A meta tensor (a planner's pass, which has no values) is returned as it is."""
    if x.is_meta:
        return x
    return dist_nn.all_reduce(x, group=shard.group)  # type: ignore[no-untyped-call, no-any-return]  # torch: untyped
