"""What the cost model knows of a host: the calibration's measured fits (``time = latency + size / rate``)
for matmuls per dtype, elementwise work, each collective per group size, and the measured step
references. :mod:`trainer.planner.calibration` probes and caches them; the cost model reads them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

SCHEMA_VERSION = 5  # 5: a causal attention backward counts half its FLOPs, as its forward does
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


@dataclass(frozen=True)
class Fit:
    """``time = latency_s + size / rate``: size in FLOPs (matmul) or bytes (the rest)."""

    latency_s: float = field(metadata={"help": "seconds per call, whatever the size"})
    rate: float = field(metadata={"help": "FLOP/s or bytes/s once the call is large"})

    def time(self, size: float) -> float:
        return self.latency_s + size / self.rate


@dataclass(frozen=True)
class Calibration:
    """What one worker can do while ``workers`` run on this host at once.

    ``matmul``: dtype (``fp32``, ``bf16``) -> fit over FLOPs (2 m k n per matmul).
    ``elementwise``: fit over bytes read + written by one pointwise op.
    ``collectives``: op -> group size -> fit over the op's buffer bytes: all_reduce's tensor,
    all_gather's gathered output, reduce_scatter's full input, send_recv's message.
    """

    host: str
    device: str
    workers: int
    matmul: dict[str, Fit]
    elementwise: Fit
    collectives: dict[str, dict[int, Fit]]
    op_latency_s: float = 0.0  # seconds per op of a module's forward and backward under autograd, at tiny sizes
    optimizer_tensor_s: float = 0.0  # seconds per parameter tensor of clip, AdamW step and zero_grad, tiny tensors
    dtensor_linear_s: float = 0.0  # extra seconds of a Linear's forward + backward when its weight is a DTensor
    optimizer_dtensor_tensor_s: float = 0.0  # optimizer_tensor_s for DTensor parameters (FSDP, tp)
    cores: int = 0  # CPU cores the workers share (0: a device each, nothing shared)
    compute_efficiency: float = 1.0  # a real decoder pass's measured time over what the fits above predict for it
    # layout family (ddp, fsdp, tp) -> a real training step of a small decoder laid out so over all the
    # workers, measured over what the cost model predicts for it (trainer.planner.calibration.framework.probe_steps)
    step_efficiency: dict[str, float] = field(default_factory=dict)
    # a pipelined step's fixed costs beyond the prediction (trainer.planner.cost.reference.pipeline_overhead_s),
    # from real steps of dp x pp2 and dp x pp2 x tp2: per schedule action, and per tp all-reduce of a stage
    schedule_action_s: float = 0.0
    pipelined_tp_collective_s: float = 0.0
    probe_s: float = 0.0
    torch_version: str = torch.__version__
    created: float = 0.0
    schema: int = SCHEMA_VERSION

    def matmul_time(self, dtype: str, flops: float) -> float:
        fit = self.matmul.get(dtype) or self.matmul["fp32"]
        return fit.time(flops)

    def elementwise_time(self, nbytes: float) -> float:
        return self.elementwise.time(nbytes)

    def collective_time(self, op: str, group_size: int, nbytes: float) -> float:
        """Seconds for one ``op`` over ``group_size`` ranks. A size the probe did not measure is
        scaled from the nearest measured one by the ring algorithm: latency with the ring's
        steps (g - 1), bandwidth with the share each rank sends ((g - 1) / g)."""
        if group_size <= 1:
            return 0.0
        # all_to_all is not probed: each rank sends (g-1)/g of its buffer, as in a ring reduce-scatter.
        fits = self.collectives.get(op) or self.collectives.get("reduce_scatter" if op == "all_to_all" else op) \
            or self.collectives["all_reduce"]  # an odd worker count has no pairs
        if group_size in fits:
            return fits[group_size].time(nbytes)
        near = min(fits, key=lambda g: abs(g - group_size))
        steps = (group_size - 1) / (near - 1) if op != "send_recv" else 1.0
        share = ((group_size - 1) / group_size) / ((near - 1) / near) if op != "send_recv" else 1.0
        return fits[near].latency_s * steps + nbytes * share / fits[near].rate

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        raw = json.loads(text)
        return cls(**{**raw, "matmul": {k: Fit(**v) for k, v in raw["matmul"].items()},
                      "elementwise": Fit(**raw["elementwise"]),
                      "collectives": {op: {int(g): Fit(**f) for g, f in by.items()}
                                      for op, by in raw["collectives"].items()}})


def fit_line(sizes: list[float], seconds: list[float]) -> Fit:
    """Least squares of ``t = a + s / r`` on relative error (small calls matter as much as big ones)."""
    s, t = np.asarray(sizes, float), np.asarray(seconds, float)
    design = np.stack([np.ones_like(s), s], axis=1) / t[:, None]
    (a, inv_rate), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if inv_rate <= 0:  # flat in size (all latency): the largest size's own rate bounds it
        inv_rate = 1e-3 * t.max() / s.max()
    return Fit(latency_s=max(0.0, float(a)), rate=float(1.0 / inv_rate))
