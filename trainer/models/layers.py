"""The decoder's small layers, and what they keep for backward.

* :class:`RMSNorm` and :func:`swiglu` save what Megatron-LM's fused kernels save: the norm its input
  and one fp32 scale per row (:class:`_RMSNormFunction`), the gated unit its two inputs
  (:class:`_SwiGLUFunction`). Written as autograd functions, not left to autograd, because torch's own
  saves more on every device that lacks a fused kernel (CPU, the planner's meta pass): ``rms_norm``
  keeps two fp32 copies of its input (measured: 4 bytes per element of a bf16 block input where the
  input itself is 1), and ``silu(gate) * up`` keeps ``silu(gate)`` beside ``gate`` and ``up``. On a
  Llama block at bf16 that was 24.8 of the activations' ``s x h`` units per block against 16 now
  (tests/unit/test_block_saves.py). Both run under DTensor unchanged (every op has a sharding rule).
* Rotary embeddings (:func:`rope_tables`, :func:`llama3_frequencies`, :func:`apply_rope`) and the
  packed-documents mask (:func:`document_mask`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config.schema import RopeScaling


class _RMSNormFunction(torch.autograd.Function):
    """``rms_norm``'s arithmetic as torch 2.13 computes it (statistics, scale and weight in fp32 or wider,
    the result cast back), keeping the input and ``rstd`` only; backward rebuilds the normalised row."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * weight.to(xf.dtype)).type_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xf = x.to(rstd.dtype)
        g = grad.to(rstd.dtype)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.mul(g, xf).mul_(rstd).sum_to_size(weight.shape).type_as(weight)
        grad_normed = g * weight.to(rstd.dtype)
        # d/dx of x * rstd(x): rstd * g - x * rstd^3 * mean(g * x) over the row. In place on this function's
        # own temporaries, the products in the same order (bit for bit): three row-sized buffers at once.
        mean = (grad_normed * xf).mean(-1, keepdim=True)
        grad_x = grad_normed.mul_(rstd).sub_(torch.mul(xf, rstd.pow(3)).mul_(mean))
        return grad_x.type_as(x), grad_weight, None


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` over the last dim with a learnable ``weight`` (initialised to ones), saving its
    input and one scale per row for backward (:class:`_RMSNormFunction`).

    Subclassed also for a stable type the init rule can recognise and a two-argument constructor.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps=eps, elementwise_affine=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return super().forward(x)
        return _RMSNormFunction.apply(x, self.weight, self.eps)


class _SwiGLUFunction(torch.autograd.Function):
    """``silu(gate) * up``, keeping ``gate`` and ``up`` only; backward recomputes ``silu(gate)`` and runs
    the ops autograd runs for ``F.silu(gate) * up`` (the product's two gradients, ``silu_backward``), so the
    gradients are torch's own bit for bit, in every dtype, for one more pass over ``gate``."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_up = grad * F.silu(gate)
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, the gated unit of a SwiGLU MLP (:class:`_SwiGLUFunction` when autograd records)."""
    if not torch.is_grad_enabled():
        return F.silu(gate) * up
    return _SwiGLUFunction.apply(gate, up)


def rope_tables(max_seq_len: int, head_dim: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each ``[max_seq_len, head_dim // 2]`` fp32 on CPU.

    Angles are computed in fp64 so long tables do not lose precision at high positions.
    ``scaling`` (Llama 3.x) adjusts the frequencies first: :func:`llama3_frequencies`.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is not None:
        inv_freq = llama3_frequencies(inv_freq, scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def llama3_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3's context extension applied to the rotary frequencies ``inv_freq`` (radians per position).

    With ``L = original_max_position_embeddings``, a frequency whose wavelength ``2 pi / f`` is
    longer than ``L / low_freq_factor`` (it turned less than ``low_freq_factor`` times over the
    pre-training context) becomes ``f / factor``; one shorter than ``L / high_freq_factor`` stays
    ``f``; in between, the weight ``w = (L / wavelength - low) / (high - low)`` (0 at the long end,
    1 at the short end) blends them: ``(1 - w) f / factor + w f``. Clamping ``w`` to ``[0, 1]``
    gives the two outer cases from the same formula.
    """
    turns = scaling.original_max_position_embeddings * inv_freq / (2 * math.pi)  # = L / wavelength
    weight = ((turns - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(0.0, 1.0)
    return (1 - weight) * inv_freq / scaling.factor + weight * inv_freq


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "pairs") -> torch.Tensor:
    """Rotate pairs of dimensions of ``x: [B, T, H, D]`` by the angles at each position.

    ``cos``/``sin`` are ``[T, D // 2]``, or ``[B, T, D // 2]`` at each row's own positions. ``pairs`` rotates adjacent
    ``(x[2i], x[2i+1])``, Meta's Llama convention; ``halves`` rotates ``(x[i], x[i + D/2])``, Hugging Face's. Written in
    real arithmetic so it works for any dtype and under DTensor.
    """
    if style == "pairs":
        pairs = x.float().unflatten(-1, (-1, 2))
        x0, x1 = pairs[..., 0], pairs[..., 1]
    else:
        x0, x1 = x.float().chunk(2, dim=-1)
    cos, sin = (cos[:, :, None, :], sin[:, :, None, :]) if cos.dim() == 3 else (cos[None, :, None, :],
                                                                                sin[None, :, None, :])
    r0, r1 = x0 * cos - x1 * sin, x0 * sin + x1 * cos
    rotated = torch.stack((r0, r1), dim=-1).flatten(-2) if style == "pairs" else torch.cat((r0, r1), dim=-1)
    return rotated.type_as(x)


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """``[B, 1, T, T]`` boolean: token i attends to token j <= i of its own document, a document being
    a run of ``positions`` starting at 0 (packed rows: :mod:`trainer.data.chat`). Every token sees
    itself, so no row of the mask is empty."""
    document = (positions == 0).cumsum(dim=1)
    same = document[:, :, None] == document[:, None, :]
    seqlen = positions.shape[1]
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=positions.device).tril()
    return (same & causal)[:, None]
