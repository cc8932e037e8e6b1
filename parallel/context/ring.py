"""The ring over a fused attention kernel: per K/V block, the kernel's output and log-sum-exp,
merged by log-sum-exp; nothing of a block (scores, probabilities, masks) is kept for backward.

Autograd through the blocks would keep every block's inputs and the merge's terms; instead one
:class:`torch.autograd.Function` holds the whole ring and saves only what flash attention's own
backward needs: this rank's q, k, v, the merged output and the merged log-sum-exp. Its backward
sends the K/V blocks round the ring again and runs the kernel's backward on each block against the
*merged* output and log-sum-exp: with the whole row's log-sum-exp a block's probabilities are the
row's, and the row's output gives the row's ``sum(dO * O)``, so each block's gradients are exactly
its share of full attention's (what flash-attention's ring implementations do). The K/V gradients
travel with their block and take one more hop home at the end.

The kernel, per block (:func:`kernel_for`):

* CPU (and the meta device, for the memory and time models): ``aten._scaled_dot_product_flash_attention_for_cpu``
  and its backward op; it takes grouped-query K/V as they are and an additive mask in the inputs'
  dtype, built per block and dropped after it (in backward it is built again from the token positions).
* CUDA, bf16 / fp16 and a block mask the flash kernel can express (the whole block, its causal
  triangle, a rectangle of it: every block of the balanced causal split): ``aten._scaled_dot_product_flash_attention``
  and its backward op, grouped K/V heads repeated to the query heads for the call (the saved K/V stay
  grouped). Written against the ops' schemas and checked on the meta device; no GPU has run it here
  (docs/context-parallel.md, Limits).
* Anything else (fp32 on CUDA, a boolean mask there: packed documents): the same arithmetic by plain
  tensor operations, one block's scores alive while it is computed and none kept (:func:`_math_forward`).

    out = fused_ring(q, k, v, masks=lambda step: None, send=lambda x: (lambda c=x.clone(): c), steps=4, scale=0.25)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_CUDA_FLASH = torch.ops.aten._scaled_dot_product_flash_attention
_CUDA_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_backward

# A block's mask by ring step: None where every query may see every key of the block, "causal"
# where the block is the rank's own (positions rise in both, so the causal mask is the lower
# triangle), "skip" where no query sees any key, a pair of slices ``(queries, keys)`` where exactly
# those queries see exactly those keys (the balanced split's other blocks under a causal mask: all
# queries over the head chunk, or the tail queries over all keys), else a boolean [B or 1, Tq, Tk].
BlockMaskValue = torch.Tensor | tuple[slice, slice] | str | None
BlockMask = Callable[[int], BlockMaskValue]
# A block's mask within the queries and keys it involves: a boolean tensor, "causal", "skip" or None.
KernelMask = torch.Tensor | str | None


# ``send(x)`` starts passing ``x`` to the next rank and receiving the previous rank's; it returns
# a function that waits for the hop and gives what was received.
Send = Callable[[torch.Tensor], Callable[[], torch.Tensor]]

# One block's kernel: forward(q, k, v, mask, scale) -> (out, lse); backward(grad, q, k, v, out, lse, mask, scale)
# -> (dq, dk, dv).
Tensor = torch.Tensor
Grads = tuple[Tensor, Tensor, Tensor]
KernelForward = Callable[[Tensor, Tensor, Tensor, KernelMask, float], tuple[Tensor, Tensor]]
KernelBackward = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, KernelMask, float], Grads]


def fused_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, masks: BlockMask,
               send: Send, steps: int, scale: float) -> torch.Tensor:
    """Attention of ``q`` ``[B, H, Tq, D]`` over ``steps`` K/V blocks: this rank's ``k``, ``v``
    ``[B, Hkv, Tk, D]`` and, at each later step, the block ``send`` receives for the one it passes on
    (the previous rank's). ``masks(step)`` is the step's :data:`BlockMask`. Returns ``[B, H, Tq, D]``
    in ``q``'s dtype, differentiable in q, k and v (``send`` must be the same in backward).

    Each hop runs while a block is computed: a block is passed on as its attention starts (forward
    and backward), and the K/V gradients of a block go on as the next block's backward starts, waited
    for only when that block's gradients are added to them; only the last hop home is waited for
    with nothing to compute (what :func:`trainer.planner.cost.comm.ring_exposed_s` prices)."""
    return _FusedRing.apply(q, k, v, masks, send, steps, scale)  # type: ignore[no-untyped-call, no-any-return]


class _FusedRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: BlockMask, send: Send, steps: int,
                scale: float) -> torch.Tensor:
        acc = torch.promote_types(q.dtype, torch.float32)  # the kernel's log-sum-exp dtype; bf16 merges in fp32
        kv = torch.stack((k, v))
        out = torch.zeros_like(q, dtype=acc)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        pending: Callable[[], torch.Tensor] | None = None
        for step in range(steps):
            if step:
                assert pending is not None, "every step but the last sends"
                kv = pending()
            if step < steps - 1:
                pending = send(kv)  # on its way to the next rank while this rank computes on it
            mask = masks(step)
            if isinstance(mask, str) and mask == "skip":
                continue
            rows, cols, mask = _slices(mask)
            forward, _ = kernel_for(q, mask)
            block_out, block_lse = forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], mask, scale)
            seen, total = lse[:, :, rows], torch.logaddexp(lse[:, :, rows], block_lse)
            # A row nothing has shown yet (-inf) takes the block's; a row this block shows nothing
            # (-inf) keeps its own: exp(-inf - total) = 0. Step 0 (the rank's own block) shows every row something.
            out[:, :, rows] = (out[:, :, rows] * (seen - total).exp()[..., None]
                               + block_out.to(acc) * (block_lse - total).exp()[..., None])
            lse[:, :, rows] = total
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.masks, ctx.send, ctx.steps, ctx.scale = masks, send, steps, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        acc = lse.dtype
        grad = grad.contiguous()
        kv = torch.stack((k, v))
        dq = torch.zeros_like(q, dtype=acc)
        dkv = torch.zeros_like(kv, dtype=acc)  # the gradient of the block held, travelling with it
        kv_next: Callable[[], torch.Tensor] | None = None
        dkv_next: Callable[[], torch.Tensor] | None = None
        for step in range(ctx.steps):
            if step:
                assert kv_next is not None, "every step but the last sends"
                kv = kv_next()
            if step < ctx.steps - 1:
                kv_next = ctx.send(kv)
            mask = ctx.masks(step)
            rows, cols, mask = _slices(mask)
            block = None
            if not (isinstance(mask, str) and mask == "skip"):
                _, backward = kernel_for(q, mask)
                block = backward(grad[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                 out[:, :, rows], lse[:, :, rows], mask, ctx.scale)
            if step:  # the held block's gradient so far, sent on by the rank that held it last step
                assert dkv_next is not None, "with more than one step every step sends"
                dkv = dkv_next()
            if block is not None:
                dq[:, :, rows] += block[0]
                dkv[0, :, :, cols] += block[1]
                dkv[1, :, :, cols] += block[2]
            if ctx.steps > 1:
                dkv_next = ctx.send(dkv)  # after the last step a rank holds the next rank's block's: one more hop home
        if ctx.steps > 1:
            assert dkv_next is not None, "the last step sends the gradient home"
            dkv = dkv_next()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _slices(mask: BlockMaskValue) -> tuple[slice, slice, KernelMask]:
    """The queries and keys a block mask involves, and the mask within them."""
    if isinstance(mask, tuple):
        return mask[0], mask[1], None
    return slice(None), slice(None), mask


def _kernel_mask(mask: KernelMask, dtype: torch.dtype) -> tuple[bool, torch.Tensor | None]:
    """The kernel's ``is_causal`` and additive mask (``[B or 1, 1, Tq, Tk]``, -inf where hidden) for a block mask."""
    if mask is None:
        return False, None
    if isinstance(mask, str):  # "causal"
        return True, None
    return False, torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))[:, None]


def kernel_for(q: torch.Tensor, mask: KernelMask) -> tuple[KernelForward, KernelBackward]:
    """``(forward, backward)`` of one block (see the module docstring): ``forward(q, k, v, mask, scale)
    -> (out, lse)``, ``backward(grad, q, k, v, out, lse, mask, scale) -> (dq, dk, dv)``, ``out`` and
    ``lse`` in backward the merged ones. ``mask``: the block's mask within its slices."""
    if q.device.type in ("cpu", "meta"):
        return _cpu_forward, _cpu_backward
    if (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0
            and q.shape[-1] <= 256 and not isinstance(mask, torch.Tensor)):  # flash's dtypes and head widths
        return _cuda_forward, _cuda_backward
    return _math_forward, _math_backward


def _cpu_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: KernelMask, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's normalised output and log-sum-exp ``[B, H, Tq]`` (``-inf`` for a query that sees
    none of its keys: the kernel gives such a row 0 and a log-sum-exp of 0)."""
    causal, additive = _kernel_mask(mask, q.dtype)
    out, lse = _FLASH(q, k, v, 0.0, causal, attn_mask=additive, scale=scale)
    if isinstance(mask, torch.Tensor):
        lse = lse.masked_fill(~mask.any(-1)[:, None], float("-inf"))
    return out, lse


def _cpu_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, mask: KernelMask, scale: float) -> Grads:
    causal, additive = _kernel_mask(mask, q.dtype)
    # torch.ops are untyped.
    return _FLASH_BACKWARD(grad, q, k, v, out, lse, 0.0, causal, attn_mask=additive,  # type: ignore[no-any-return]
                           scale=scale)


def _repeat_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """CUDA's flash call gets K/V with the query's heads (``repeat_interleave``: query head ``h``
    reads kv head ``h // rep``), made for the call and dropped after it."""
    rep = q.shape[1] // k.shape[1]
    if rep == 1:
        return k.contiguous(), v.contiguous(), rep
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), rep


def _cuda_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: KernelMask, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    k, v, _ = _repeat_heads(q, k, v)
    result = _CUDA_FLASH(q.contiguous(), k, v, 0.0, mask == "causal", False, scale=scale)
    return result[0], result[1]  # the output and the fp32 log-sum-exp [B, H, Tq]


def _cuda_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, mask: KernelMask, scale: float) -> Grads:
    kv_heads = k.shape[1]
    k, v, rep = _repeat_heads(q, k, v)
    tq, tk = q.shape[2], k.shape[2]
    seed = torch.zeros(2, dtype=torch.uint64, device=q.device)  # dropout 0: the kernel reads no random state
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = _CUDA_FLASH_BACKWARD(grad.contiguous(), q.contiguous(), k, v, out.contiguous(), lse.contiguous(),
                                      None, None, tq, tk, 0.0, mask == "causal", seed, offset, scale=scale)
    if rep > 1:  # each kv head's gradient: the sum over the query heads that read it
        dk = dk.unflatten(1, (kv_heads, rep)).sum(2)
        dv = dv.unflatten(1, (kv_heads, rep)).sum(2)
    return dq, dk, dv


def _math_scores(q: torch.Tensor, k: torch.Tensor, mask: KernelMask, scale: float) -> torch.Tensor:
    """``[B, Hkv, rep, Tq, Tk]`` fp32 scores of grouped queries over their kv head, -inf where hidden."""
    b, heads, tq, d = q.shape
    acc = _acc(q)
    grouped = q.to(acc).view(b, k.shape[1], heads // k.shape[1], tq, d)
    scores = grouped @ k.to(acc)[:, :, None].transpose(-1, -2) * scale
    if mask == "causal":
        mask = torch.ones(tq, k.shape[2], dtype=torch.bool, device=q.device).tril()[None]
    if isinstance(mask, torch.Tensor):
        scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    return scores


def _acc(q: torch.Tensor) -> torch.dtype:  # fp32 at least, as the fused kernels accumulate
    return torch.promote_types(q.dtype, torch.float32)


def _probabilities(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    # A query that sees nothing: exp(-inf - 0) = 0 weights, not NaN.
    return (scores - lse.masked_fill(lse.isneginf(), 0.0)[..., None]).exp()


def _math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: KernelMask, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    scores = _math_scores(q, k, mask, scale)
    lse = scores.logsumexp(-1)
    out = _probabilities(scores, lse) @ v.to(scores.dtype)[:, :, None]
    return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)


def _math_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, mask: KernelMask, scale: float) -> Grads:
    """Flash attention's backward by tensor operations, against the merged ``out`` and ``lse``:
    ``P = exp(S - lse)``, ``dV = P^T dO``, ``dS = P (dO V^T - rowsum(dO O))``, ``dQ = dS K scale``,
    ``dK = dS^T Q scale``."""
    b, heads, tq, d = q.shape
    groups = (b, k.shape[1], heads // k.shape[1], tq, d)
    probs = _probabilities(_math_scores(q, k, mask, scale), lse.view(groups[:-1]))
    acc = probs.dtype
    dout = grad.to(acc).view(groups)
    dv = (probs.transpose(-1, -2) @ dout).sum(2)
    rowsum = (dout * out.to(acc).view(groups)).sum(-1, keepdim=True)
    dscores = probs * (dout @ v.to(acc)[:, :, None].transpose(-1, -2) - rowsum)
    dq = (dscores @ k.to(acc)[:, :, None]) * scale
    dk = (dscores.transpose(-1, -2) @ q.to(acc).view(groups)).sum(2) * scale
    return dq.view(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
