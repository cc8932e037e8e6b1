"""The seeds' two-matmul model: ``y = act(x @ w0) @ w1`` with raw weights stored ``[in, out]``.

OneFlow's and PaddlePaddle's auto-parallel examples write their weights this way (not as
``nn.Linear``'s ``[out, in]``), so a placement such as ``w0: {tp: Shard(1)}`` followed by
``w1: {tp: Shard(0)}`` is the column/row-parallel pair in the seeds' own notation.

Quick check::

    python -c "from trainer.config import MLPConfig; from trainer.models import build_model; \
import torch; print(build_model(MLPConfig(in_features=8, hidden_features=16, out_features=4))(torch.randn(2, 8)).shape)"
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config.schema import MLPConfig
from trainer.models.init import InitKind, init_named_parameters


def identity(x: torch.Tensor) -> torch.Tensor:
    """``activation: none``; a named function rather than a lambda so the model pickles."""
    return x


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "none": identity,
    "relu": F.relu,
    "gelu": F.gelu,
}


class MatmulMLP(nn.Module):
    """``x [B, in] -> act(x @ w0) @ w1 -> [B, out]`` with ``w0: [in, hidden]``, ``w1: [hidden, out]``."""

    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.activation = ACTIVATIONS[cfg.activation]
        # torch.empty picks up the ambient device, so building under torch.device("meta")
        # allocates nothing; init_weights fills the values.
        self.w0 = nn.Parameter(torch.empty(cfg.in_features, cfg.hidden_features))
        self.w1 = nn.Parameter(torch.empty(cfg.hidden_features, cfg.out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(self.activation(torch.matmul(x, self.w0)), self.w1)

    def _init_rule(self, fqn: str) -> tuple[InitKind, float]:
        return "normal", self.cfg.init_std

    def init_weights(self, seed: int | None = None) -> None:
        """Set ``w0`` and ``w1`` from ``(seed, FQN, shape)``; ``seed=None`` means 0."""
        init_named_parameters(self.named_parameters(), 0 if seed is None else seed, self._init_rule)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.cfg.in_features}, hidden_features={self.cfg.hidden_features}, "
            f"out_features={self.cfg.out_features}, activation={self.cfg.activation}"
        )
