"""Which tokens of a sequence each context-parallel rank holds: the load-balanced causal split.

A sequence of ``T`` tokens is cut into ``2 * cp`` equal chunks; cp rank ``i`` holds chunk ``i`` and
chunk ``2 * cp - 1 - i`` (a head and a tail). Under a causal mask a token attends to the tokens
before it, so a rank holding only the last chunk would do the most work; a head and a tail give
every rank the same number of (query, key) pairs. With ``cp = 2`` and ``T = 8``::

    token_index(8, cp_rank=0, cp_size=2)   # tensor([0, 1, 6, 7])
    token_index(8, cp_rank=1, cp_size=2)   # tensor([2, 3, 4, 5])

The data loader cuts every row this way (:func:`shard_sequence`), and attention computes rotary
angles and masks from these true indices (:mod:`parallel.context.attention`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel.config import ContextParallelMethod


def token_index(seq_len: int, *, cp_rank: int, cp_size: int) -> torch.Tensor:
    """The positions in the full sequence of the ``seq_len // cp_size`` tokens cp rank ``cp_rank`` holds,
    in the order it holds them (its head chunk, then its tail chunk)."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"a sequence of {seq_len} tokens does not split into 2 x {cp_size} equal chunks")
    chunk = seq_len // (2 * cp_size)
    head, tail = cp_rank, 2 * cp_size - 1 - cp_rank
    return torch.cat((torch.arange(head * chunk, (head + 1) * chunk), torch.arange(tail * chunk, (tail + 1) * chunk)))


def shard_sequence(x: torch.Tensor, *, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """This cp rank's tokens of ``x`` along its sequence dimension ``dim`` (a copy; ``x`` itself when
    ``cp_size == 1``)."""
    if cp_size == 1:
        return x
    return x.index_select(dim, token_index(x.shape[dim], cp_rank=cp_rank, cp_size=cp_size).to(x.device))


def unshard_sequence(shards: list[torch.Tensor], *, dim: int) -> torch.Tensor:
    """The inverse of :func:`shard_sequence`: every cp rank's tokens (in cp-rank order) back in sequence order."""
    cp_size = len(shards)
    local = shards[0].shape[dim]
    order = torch.cat([token_index(local * cp_size, cp_rank=r, cp_size=cp_size) for r in range(cp_size)])
    return torch.cat(shards, dim=dim).index_select(dim, torch.argsort(order).to(shards[0].device))


@dataclass(frozen=True)
class ContextShard:
    """What an attention module needs to attend over the whole sequence from its rank's share of it:
    the cp process group, this rank's place in it, and how K/V travel (``ring`` or ``allgather``).

    Set on every module that declares a ``context_parallel`` attribute by
    :func:`parallel.context.apply_context_parallel`; ``None`` there means one whole sequence per rank."""

    group: dist.ProcessGroup = field(repr=False)
    rank: int
    size: int
    method: ContextParallelMethod = "ring"

    def token_index(self, local_len: int, *, rank: int | None = None,
                    device: torch.device | str = "cpu") -> torch.Tensor:
        """The true positions of the ``local_len`` tokens cp rank ``rank`` (default: this one) holds."""
        index = token_index(local_len * self.size, cp_rank=self.rank if rank is None else rank, cp_size=self.size)
        return index.to(device)
