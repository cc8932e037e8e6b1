"""The global sample stream, cut into per-rank batches; resumable on any number of dp ranks.

Global sample ``g`` is ``source[perm_e[g % N]]`` with ``e = g // N`` and ``perm_e`` a
permutation of the N samples seeded by (seed, e): every epoch visits every sample once, in
its own order. Each step consumes the next ``global_batch_size`` global samples; dp rank r
of R gets the r-th of R equal contiguous slices. The only state is the global position
(``next_sample``), so a checkpoint taken on 2 dp ranks resumes on 4 and the 4 ranks together
see exactly the samples one rank would have seen::

    loader = GlobalBatchLoader(source, global_batch_size=16, dp_rank=rank, dp_size=2, seed=0)
    inputs, targets = loader.next_batch()        # [8, ...] each: this rank's half

With context parallelism (``cp_size > 1``) the ranks of one dp rank get the same rows, each its
chunks of every row (:func:`parallel.context.shard_sequence`): ``[8, seq_len / cp]`` each.
    saved = loader.state_dict()                  # {"next_sample": 16, ...}

Evaluation reads a validation split with :class:`ValidationRows` instead: each row once, never wrapping.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from parallel.context import shard_sequence
from trainer.data.base import CountedSource, Source, derive_seed

# A target that does not count: torch's cross_entropy ignore_index, as the chat data's mask.
IGNORE = -100
# Permutations kept in memory: the current epoch's and the next, since one batch may span both.
_CACHED_EPOCHS = 2


class GlobalBatchLoader:
    """Stateful, resumable loader of this dp rank's share of each global batch.

    Args:
        source: the samples (``len`` per epoch, ``source[i] -> (inputs, targets)``).
        global_batch_size: samples per step summed over dp ranks (``train.global_batch_size``).
        dp_rank: this rank's index among the data-parallel ranks, in [0, dp_size).
        dp_size: number of data-parallel ranks; must divide ``global_batch_size``.
        seed: seed of the data order (``train.seed``).
        cp_rank, cp_size: this rank's place among the context-parallel ranks: each row is cut into
            ``2 * cp_size`` chunks and this rank gets chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank``.
    """

    def __init__(self, source: Source, *, global_batch_size: int, dp_rank: int, dp_size: int, seed: int,
                 cp_rank: int = 0, cp_size: int = 1) -> None:
        if len(source) < 1:
            raise ValueError("the data source is empty: no samples to load")
        if global_batch_size < 1:
            raise ValueError(f"train.global_batch_size: must be >= 1, got {global_batch_size}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must lie in [0, dp_size); got dp_rank={dp_rank}, dp_size={dp_size}")
        if global_batch_size % dp_size:
            raise ValueError(
                f"train.global_batch_size: {global_batch_size} is not divisible by the {dp_size} data-parallel "
                f"ranks (use a multiple of {dp_size}, or change the dp size of the mesh)"
            )
        self.source = source
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.next_sample = 0
        self._permutations: dict[int, Tensor] = {}

    @property
    def local_batch_size(self) -> int:
        """Samples this rank receives per step."""
        return self.global_batch_size // self.dp_size

    @property
    def epoch(self) -> int:
        """The epoch the next global sample belongs to."""
        return self.next_sample // len(self.source)

    def permutation(self, epoch: int) -> Tensor:
        """The order of the source's samples in ``epoch`` (same on every rank and every run)."""
        if epoch not in self._permutations:
            generator = torch.Generator().manual_seed(derive_seed(self.seed, "epoch", epoch))
            self._permutations[epoch] = torch.randperm(len(self.source), generator=generator)
            while len(self._permutations) > _CACHED_EPOCHS:
                del self._permutations[min(self._permutations)]
        return self._permutations[epoch]

    def source_indices(self, first_sample: int, count: int) -> list[int]:
        """Source indices of global samples ``first_sample .. first_sample + count - 1``."""
        num_samples = len(self.source)
        return [
            int(self.permutation(g // num_samples)[g % num_samples]) for g in range(first_sample, first_sample + count)
        ]

    def target_tokens(self, count: int) -> int:
        """How many targets count in the loss among the next ``count`` global samples (all ranks'
        shares: every rank gets the same number without communicating), from a source whose rows
        know it (``target_count``: chat data)."""
        source = self.source
        if not isinstance(source, CountedSource):
            raise TypeError(f"{type(source).__name__} rows do not count their targets: every target counts")
        return sum(source.target_count(i) for i in self.source_indices(self.next_sample, count))

    def next_batch(self) -> tuple[Tensor, ...]:
        """This rank's slice of the next global batch, stacked: ``[local_batch_size, ...]`` each
        (inputs, targets, and the positions of packed documents where the source has them); with
        context parallelism, this cp rank's chunks of each row's tokens.

        Advances the position by the whole global batch, as every rank does, so the ranks
        stay in step without communicating.
        """
        first = self.next_sample + self.dp_rank * self.local_batch_size
        samples = [self.source[i] for i in self.source_indices(first, self.local_batch_size)]
        self.next_sample += self.global_batch_size
        return tuple(shard_sequence(torch.stack(column), dim=1, cp_rank=self.cp_rank, cp_size=self.cp_size)
                     for column in zip(*samples))

    def __iter__(self) -> Iterator[tuple[Tensor, ...]]:
        return self

    def __next__(self) -> tuple[Tensor, ...]:
        return self.next_batch()  # the stream is endless: epochs follow one another

    def state_dict(self) -> dict[str, int]:
        """The global position (plus what it depends on); the same on every dp rank."""
        return {"next_sample": self.next_sample, "global_batch_size": self.global_batch_size, "seed": self.seed,
                "num_samples": len(self.source)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position, whatever dp_size and dp_rank it was saved with.

        A different ``global_batch_size`` is accepted: the position counts samples, not
        steps, so no sample is skipped or repeated. A different seed is refused, because
        the saved position would then index a different order and the run would silently
        revisit some samples and miss others.
        """
        next_sample = state["next_sample"]
        if not isinstance(next_sample, int) or next_sample < 0:
            raise ValueError(f"loader state: next_sample must be a non-negative int, got {next_sample!r}")
        if "seed" in state and state["seed"] != self.seed:
            raise ValueError(
                f"train.seed: the checkpoint's data order was seeded with {state['seed']}, this run uses "
                f"{self.seed}; resume with train.seed={state['seed']} (or start a fresh run)"
            )
        if "num_samples" in state and state["num_samples"] != len(self.source):
            raise ValueError(
                f"data: the checkpoint's data had {state['num_samples']} samples per epoch, this run's has "
                f"{len(self.source)}, so the saved position would index a different order; resume with the same "
                "data, train.seq_len and validation split (or start a fresh run)"
            )
        self.next_sample = next_sample

    def __repr__(self) -> str:
        return (
            f"GlobalBatchLoader(global_batch_size={self.global_batch_size}, dp_rank={self.dp_rank}, "
            f"dp_size={self.dp_size}, seed={self.seed}, next_sample={self.next_sample})"
        )


class ValidationRows:
    """A validation split's rows for one evaluation, each exactly once: the first ``max_batches *
    global_batch_size`` rows of the split's epoch-0 order (the same ones every time; the whole split
    when it is smaller), in global batches cut over the dp (and cp) ranks as training batches are.

    The last batch is filled up with padding rows whose targets do not count (``IGNORE``; NaN for
    float targets), so every batch has the shape the layout expects (its dp shares and micro-batches
    equal) while no row counts twice::

        rows = ValidationRows(source, global_batch_size=8, max_batches=4, dp_rank=0, dp_size=2, seed=0)
        for batch in range(len(rows)):
            inputs, targets, *positions = rows.batch(batch)       # this rank's [4, ...] share
            rows.target_count(batch)                              # the batch's targets, all ranks'
    """

    def __init__(self, source: Source, *, global_batch_size: int, max_batches: int, dp_rank: int, dp_size: int,
                 seed: int, cp_rank: int = 0, cp_size: int = 1) -> None:
        order = GlobalBatchLoader(source, global_batch_size=global_batch_size, dp_rank=dp_rank, dp_size=dp_size,
                                  seed=seed)
        self.indices = order.source_indices(0, min(len(source), max_batches * global_batch_size))
        self.source, self.global_batch_size = source, global_batch_size
        self.dp_rank, self.local_batch_size = dp_rank, order.local_batch_size
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self._first = source[self.indices[0]]

    def __len__(self) -> int:
        return math.ceil(len(self.indices) / self.global_batch_size)

    def _rows(self, batch: int) -> list[int]:
        return self.indices[batch * self.global_batch_size : (batch + 1) * self.global_batch_size]

    def target_count(self, batch: int) -> int:
        """The targets that count in global batch ``batch`` (every rank's share; padding none)."""
        rows, source = self._rows(batch), self.source
        if isinstance(source, CountedSource):  # chat data: rows of their own counts
            return sum(source.target_count(i) for i in rows)
        return len(rows) * self._first[1].numel()  # every target counts

    def batch(self, batch: int) -> tuple[Tensor, ...]:
        """This rank's share of global batch ``batch``: ``[local_batch_size, ...]`` each (this cp rank's
        chunks of every row), padding rows where the split ran out."""
        rows: list[int | None] = list(self._rows(batch))
        rows += [None] * (self.global_batch_size - len(rows))
        mine = rows[self.dp_rank * self.local_batch_size : (self.dp_rank + 1) * self.local_batch_size]
        samples = [self.source[i] if i is not None else self._padding() for i in mine]
        return tuple(shard_sequence(torch.stack(column), dim=1, cp_rank=self.cp_rank, cp_size=self.cp_size)
                     for column in zip(*samples))

    def _padding(self) -> tuple[Tensor, ...]:
        """A row that counts for nothing: the first row's inputs (and positions), no target."""
        inputs, targets, *rest = self._first
        filler = torch.full_like(targets, math.nan if targets.is_floating_point() else IGNORE)
        return (inputs, filler, *rest)
