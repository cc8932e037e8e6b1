"""Seeded teacher-student regression data for the ``mlp`` model (``data.kind: regression``).

``x ~ N(0, I)`` and ``y = tanh(x @ A) @ B / scale + noise``, with a fixed random teacher
(A, B) and ``scale`` chosen so that the noiseless outputs have unit standard deviation. A
student that matches the teacher reaches a mean squared error of ``noise_std**2``::

    src = RegressionSource(RegressionDataConfig(), in_features=1024, out_features=1024)
    x, y = src[0]                     # float32 [1024], float32 [1024]

Samples are generated on access, each from its own generator seeded by (seed, index), rather
than materialised: the default 65536 x 1024 inputs and outputs would take 512 MiB on every
rank, while a rank only ever touches its own share, and access stays random and O(1).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from trainer.config.schema import RegressionDataConfig
from trainer.data.base import derive_seed

# Width of the teacher's hidden layer: narrower than the student's default (4096), so the
# student can represent the teacher exactly, and cheap to evaluate per sample.
TEACHER_HIDDEN = 64
# Inputs used once to measure the teacher's output scale; 1024 x out values pin it to ~1%.
PROBE_SAMPLES = 1024


class RegressionSource:
    """``num_samples`` pairs ``(x, y)``, float32 ``[in_features]`` and ``[out_features]``.

    Args:
        cfg: the ``data`` section (``kind: regression``); ``cfg.seed`` fixes teacher and samples.
        in_features: width of x (``model.in_features``).
        out_features: width of y (``model.out_features``).
    """

    def __init__(self, cfg: RegressionDataConfig, in_features: int, out_features: int) -> None:
        if in_features < 1 or out_features < 1:
            raise ValueError(f"in_features and out_features must be >= 1, got {in_features}, {out_features}")
        self.cfg = cfg
        self.in_features = in_features
        self.out_features = out_features
        generator = torch.Generator().manual_seed(derive_seed(cfg.seed, "teacher"))
        # 1/sqrt(fan_in) keeps the pre-activations O(1), so tanh is neither linear nor saturated.
        self.w_in = torch.randn(in_features, TEACHER_HIDDEN, generator=generator) / math.sqrt(in_features)
        self.w_out = torch.randn(TEACHER_HIDDEN, out_features, generator=generator) / math.sqrt(TEACHER_HIDDEN)
        probe = torch.randn(PROBE_SAMPLES, in_features, generator=generator)
        self.scale = float(self._unscaled(probe).std())

    def _unscaled(self, x: Tensor) -> Tensor:
        return torch.tanh(x @ self.w_in) @ self.w_out

    def teacher(self, x: Tensor) -> Tensor:
        """The noiseless target for inputs ``x`` of shape ``[..., in_features]``."""
        return self._unscaled(x) / self.scale

    def __len__(self) -> int:
        return self.cfg.num_samples

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not 0 <= index < self.cfg.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.cfg.num_samples})")
        generator = torch.Generator().manual_seed(derive_seed(self.cfg.seed, "sample", index))
        x = torch.randn(self.in_features, generator=generator)
        noise = torch.randn(self.out_features, generator=generator) * self.cfg.noise_std
        return x, self.teacher(x) + noise

    def __repr__(self) -> str:
        return (
            f"RegressionSource(num_samples={len(self)}, in_features={self.in_features}, "
            f"out_features={self.out_features}, noise_std={self.cfg.noise_std})"
        )
