"""A seeded order-k Markov chain with an exactly known entropy rate: data with a loss floor.

A model that learns the chain perfectly reaches a mean cross-entropy of
:meth:`MarkovSource.entropy_rate` nats per token and no lower, so training curves on this
data can be judged against a number, not against a feeling::

    src = MarkovSource(SyntheticDataConfig(order=2, num_symbols=16), seq_len=128)
    src.entropy_rate()                # 1.164 nats for seed 1234; < ln(16) = 2.773
    inputs, targets = src[0]          # int64 [128] each

The chain's *state* is its last k tokens, encoded base ``num_symbols`` with the newest token
as the least significant digit, so ``next_state = (state * S + token) % S**k``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from trainer.config.schema import SyntheticDataConfig
from trainer.data.base import TokenWindows

# Transition tables larger than this (float64 entries, 8 B each) are refused: 2**22 entries
# is 32 MiB plus as much again for the cumulative table, and covers 16 symbols at order 3.
MAX_TABLE_ENTRIES = 2**22
# Blocks of the stream generated side by side (see `sample_chain`): enough to make numpy's
# per-call overhead negligible, long enough that a block's repair is short relative to it.
MAX_PARALLEL_CHAINS = 512
MIN_CHAIN_LENGTH = 1024


def transition_table(num_states: int, num_symbols: int, concentration: float, generator: torch.Generator) -> np.ndarray:
    """Rows of P[state, next_token] ~ Dirichlet(concentration), float64 [num_states, num_symbols].

    Dirichlet = normalised Gamma draws. float64 because at concentration 0.1 about 1 draw in
    6000 falls below float32's smallest normal number; zeros could make the chain reducible,
    and the stationary distribution would no longer be unique.
    """
    alpha = torch.full((num_states, num_symbols), concentration, dtype=torch.float64)
    gamma = torch._standard_gamma(alpha, generator=generator)  # the only Gamma sampler taking a generator
    row_sums = gamma.sum(dim=1, keepdim=True)
    # An all-underflowed row (probability ~1e-30 per entry at 0.1) falls back to uniform.
    table = torch.where(row_sums > 0, gamma / row_sums.clamp_min(1e-300), 1.0 / num_symbols)
    return table.numpy()


def next_states(num_states: int, num_symbols: int) -> np.ndarray:
    """next_state[state, token] of the order-k state process, int64 [num_states, num_symbols]."""
    states = np.arange(num_states, dtype=np.int64)[:, None]
    tokens = np.arange(num_symbols, dtype=np.int64)[None, :]
    return (states * num_symbols + tokens) % num_states


def stationary_distribution(table: np.ndarray, *, tol: float = 1e-14, max_iters: int = 200_000) -> np.ndarray:
    """The stationary distribution of the state process, by power iteration.

    The state process is sparse (S successors per state), so one step is a bincount over the
    S**(k+1) table entries rather than a dense [S**k, S**k] product. Every entry of the table
    is positive, so after k steps every state reaches every state: the chain is irreducible
    and aperiodic, and the iteration converges to the unique fixed point.
    """
    num_states, num_symbols = table.shape
    successors = next_states(num_states, num_symbols).ravel()
    pi = np.full(num_states, 1.0 / num_states)
    for _ in range(max_iters):
        new = np.bincount(successors, weights=(pi[:, None] * table).ravel(), minlength=num_states)
        new = new / new.sum()  # weighted counts: floats, whatever numpy's stubs say
        if np.abs(new - pi).sum() < tol:
            return new
        pi = new
    raise RuntimeError(f"stationary distribution did not converge in {max_iters} iterations")


Step = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def _inverse_cdf_step(flat_cdf: np.ndarray, num_symbols: int, num_states: int) -> Step:
    """A vectorised step ``(states, uniforms) -> (tokens, next_states)`` by inverse-CDF sampling.

    Row s of the cumulative table is shifted by +s, so the flattened table is sorted and one
    ``searchsorted`` of ``s + u`` lands inside row s for every chain at once. With at most
    2**21 states, ``s + u`` keeps u to ~2**-31: transition probabilities move by < 1e-9.
    """

    def step(states: np.ndarray, uniforms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        index = np.searchsorted(flat_cdf, states + uniforms, side="right")
        tokens = np.clip(index - states * num_symbols, 0, num_symbols - 1)
        return tokens, (states * num_symbols + tokens) % num_states

    return step


def sample_chain(table: np.ndarray, start_state: int, uniforms: np.ndarray, *, num_chains: int) -> np.ndarray:
    """Tokens of the chain from ``start_state`` driven by ``uniforms`` (one per token), as uint8.

    The result is exactly the sequential inverse-CDF chain, whatever ``num_chains``; more
    chains only make it faster. A Python loop over 2M tokens takes seconds, so the uniforms
    are cut into ``num_chains`` consecutive blocks run side by side, each block's chain
    started from a guess. The guess is then repaired: from the true start (the end state of
    the previous block) the block is re-run with the same uniforms until it reaches the state
    the guessed run had at that step; from there on the two runs are the same function of
    the same uniforms, so they agree (coupling). A block that never meets its guessed run
    changes its end state, and the next pass repairs its successor: the loop ends when every
    block starts where its predecessor ended (1 pass for order 1, about 3 for order 3).
    """
    num_states, num_symbols = table.shape
    num_tokens = len(uniforms)
    num_chains = max(1, min(num_chains, num_tokens))
    block = -(-num_tokens // num_chains)
    padded = np.full(num_chains * block, 0.5)  # the padding's tokens are cut off below
    padded[:num_tokens] = uniforms
    blocks = padded.reshape(num_chains, block)

    cumulative = np.cumsum(table, axis=1)
    cumulative[:, -1] = 1.0  # rounding must not leave a gap above the last token
    flat_cdf = (cumulative + np.arange(num_states, dtype=np.float64)[:, None]).ravel()
    step = _inverse_cdf_step(flat_cdf, num_symbols, num_states)

    tokens = np.empty((num_chains, block), dtype=np.uint8)
    states = np.empty((num_chains, block), dtype=np.int64)
    used_starts = np.full(num_chains, start_state, dtype=np.int64)
    current = used_starts.copy()
    for j in range(block):
        tokens[:, j], current = step(current, blocks[:, j])
        states[:, j] = current

    while True:
        true_starts = np.concatenate([[start_state], states[:-1, -1]])
        active = np.nonzero(true_starts != used_starts)[0]
        if not active.size:
            break
        used_starts[active] = true_starts[active]
        current = true_starts[active]
        for j in range(block):
            tokens[active, j], current = step(current, blocks[active, j])
            met = current == states[active, j]
            states[active, j] = current
            active, current = active[~met], current[~met]
            if not active.size:
                break
    return tokens.ravel()[:num_tokens]


class MarkovSource(TokenWindows):
    """Token windows over a seeded order-k Markov chain (``data.kind: synthetic``).

    Args:
        cfg: the ``data`` section; ``cfg.seed`` alone fixes the table and the stream.
        seq_len: tokens per sample (``train.seq_len``).
    """

    def __init__(self, cfg: SyntheticDataConfig, seq_len: int) -> None:
        entries = cfg.num_symbols ** (cfg.order + 1)
        if entries > MAX_TABLE_ENTRIES:
            raise ValueError(
                f"data.num_symbols ** (data.order + 1) = {cfg.num_symbols}**{cfg.order + 1} = {entries} transition "
                f"probabilities, more than {MAX_TABLE_ENTRIES}; lower data.order or data.num_symbols"
            )
        self.cfg = cfg
        self.num_symbols = cfg.num_symbols
        self.order = cfg.order
        self.num_states = cfg.num_symbols**cfg.order
        generator = torch.Generator().manual_seed(cfg.seed)
        self.table = transition_table(self.num_states, cfg.num_symbols, cfg.concentration, generator)
        self.stationary = stationary_distribution(self.table)
        stream = self._generate_stream(generator)
        super().__init__(torch.from_numpy(stream), seq_len, what="the synthetic stream (data.num_tokens)")

    def entropy_rate(self) -> float:
        """H = sum_s pi(s) * H(P[s, :]) in nats per token: the best achievable mean loss."""
        table = self.table
        logs = np.log(np.where(table > 0, table, 1.0))  # 0 * log 0 = 0
        row_entropy = -(table * logs).sum(axis=1)
        return float(self.stationary @ row_entropy)

    def _generate_stream(self, generator: torch.Generator) -> np.ndarray:
        """``cfg.num_tokens`` tokens (uint8) of one chain, stationary from the first token.

        The start state is drawn from the stationary distribution and its k digits are the
        first k tokens, so every position of the stream has the same law: the mean loss of a
        perfect model is the entropy rate from the first window on.
        """
        num_tokens = self.cfg.num_tokens
        start_uniform = torch.rand(1, generator=generator, dtype=torch.float64).item()
        start_state = int(np.searchsorted(np.cumsum(self.stationary), start_uniform, side="right"))
        start_state = min(start_state, self.num_states - 1)
        place_values = [self.num_symbols ** (self.order - 1 - d) for d in range(self.order)]
        digits = [(start_state // value) % self.num_symbols for value in place_values]

        uniforms = torch.rand(num_tokens - self.order, generator=generator, dtype=torch.float64).numpy()
        num_chains = min(MAX_PARALLEL_CHAINS, max(1, len(uniforms) // MIN_CHAIN_LENGTH))
        body = sample_chain(self.table, start_state, uniforms, num_chains=num_chains)
        return np.concatenate([np.array(digits, dtype=np.uint8), body])
