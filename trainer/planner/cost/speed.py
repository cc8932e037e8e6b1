"""What one device of a hardware profile does per second: :class:`DeviceSpeed`, the achieved (not
peak) rates :mod:`trainer.planner.cost.device` prices every op at, and :func:`wave_efficiency`, a
GEMM's wave quantisation over the SMs (see that module's docstring for the roofline they make).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.config.hardware import HardwareProfile

# torch's foreach AdamW on CUDA (its default there) and the gradient clipping before it: each foreach
# op reads and writes whole lists, per fp32 parameter: lerp m (12 B), v *= b2 (8), v += g*g (12), weight
# decay (8), sqrt v (8), / bias correction (8), + eps (8), p -= lr m / d (16); clipping's norm (4) and
# scale (8). Measured: 39.1 ms of multi_tensor_apply kernels per step for 1.16B parameters on an
# H100 at 2.95 TB/s, i.e. 99 B per parameter (tests/bench/gpu_kernel_sweep.py).
ADAMW_FOREACH_BYTES_PER_PARAM = 92
# The foreach ops listed above (8 of AdamW, 2 of clipping): each launches at least one kernel however small
# the model (torch/optim/adamw.py _multi_tensor_adamw; torch.nn.utils.clip_grad_norm_'s foreach norm and mul).
ADAMW_FOREACH_OPS = 10
TILES = ((128, 128), (128, 256), (256, 128), (64, 128), (128, 64))  # output tiles cuBLAS's Tensor Core kernels use


@dataclass(frozen=True)
class DeviceSpeed:
    """What one device of a profile does per second, as achieved (not peak) rates."""

    matmul_flops: float  # a large GEMM's achieved FLOP/s in the compute dtype
    attention_flops: tuple[float, float]  # flash attention's achieved FLOP/s: forward, backward
    memory_bytes: float  # achieved HBM bytes/s of a streaming kernel
    kernel_s: float  # the least a kernel costs: launch and the framework's dispatch
    sms: int  # streaming multiprocessors: the wave quantisation's unit
    matmul_fixed_s: float = 0.0  # what every GEMM costs beyond its FLOPs' time (prologue, tail): the size curve
    fused: float = 1.0  # the share of elementwise time left when torch.compile fuses the blocks' ops

    @classmethod
    def of(cls, profile: HardwareProfile, precision: str, *, compiled: bool = False) -> DeviceSpeed:
        a, bandwidth, sms = profile.achieved, profile.memory_bandwidth_gb_s, profile.sm_count
        assert a is not None and bandwidth is not None and sms is not None, \
            f"profile {profile.name!r} lacks a GPU key: {profile.missing_gpu_keys()}"
        peak = profile.peak_flops(precision)
        # The size curve F / (F + F_half) of the bf16 sweep is a fixed time per GEMM, F_half at the rate it
        # was measured at: (F + F_half) / R = F / R + F_half / R. A time, not FLOPs: an fp32 GEMM does not
        # pay 15x longer for its prologue because its FLOPs are 15x slower.
        fixed = a.matmul_half_gflop * 1e9 / (profile.peak_flops("bf16") * a.matmul)
        return cls(matmul_flops=peak * a.matmul,
                   attention_flops=(peak * a.attention_forward, peak * a.attention_backward),
                   memory_bytes=bandwidth * 1e9 * a.memory, kernel_s=a.kernel_us * 1e-6,
                   sms=sms, matmul_fixed_s=fixed, fused=a.compiled_elementwise if compiled else 1.0)

    def matmul_s(self, flops: float, nbytes: float, tiles_of) -> float:
        """A GEMM: its FLOPs over the rate its waves leave, plus the fixed time; at least its bytes' time
        and the kernel floor. Each penalty applies once: wave quantisation stretches the FLOPs' time only
        (the fixed time is per kernel, not per wave), and the kernel floor is a max, not a sum (the host
        dispatches the next op while this one runs)."""
        compute = flops / (self.matmul_flops * tiles_of(self.sms)) + self.matmul_fixed_s if flops > 0 else 0.0
        return max(compute, nbytes / self.memory_bytes, self.kernel_s)

    def memory_s(self, nbytes: float) -> float:
        return self.fused * max(nbytes / self.memory_bytes, self.kernel_s)

    def optimizer_s(self, numel: float) -> float:
        """Foreach AdamW and the gradient clipping before it over ``numel`` local parameters: its bytes at
        the HBM rate, at least one kernel per foreach op (:data:`ADAMW_FOREACH_OPS`)."""
        return max(numel * ADAMW_FOREACH_BYTES_PER_PARAM / self.memory_bytes, ADAMW_FOREACH_OPS * self.kernel_s)


def wave_efficiency(batch: int, m: int, n: int, sms: int) -> float:
    """The busy share of a GEMM's waves for the best output tile: ``tiles / (waves x SMs)``."""
    best = 0.0
    for tm, tn in TILES:
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        best = max(best, tiles / (math.ceil(tiles / sms) * sms))
    return best
