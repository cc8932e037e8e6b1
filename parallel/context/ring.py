"""The ring over torch's fused attention kernel: per K/V block, the kernel's output and log-sum-exp,
merged by log-sum-exp; nothing of a block (scores, probabilities, masks) is kept for backward.

Autograd through the blocks would keep every block's inputs and the merge's terms; instead one
:class:`torch.autograd.Function` holds the whole ring and saves only what flash attention's own
backward needs: this rank's q, k, v, the merged output and the merged log-sum-exp. Its backward
sends the K/V blocks round the ring again and runs the kernel's backward on each block against the
*merged* output and log-sum-exp: with the whole row's log-sum-exp a block's probabilities are the
row's, and the row's output gives the row's ``sum(dO * O)``, so each block's gradients are exactly
its share of full attention's (what flash-attention's ring implementations do). The K/V gradients
travel with their block and take one more hop home at the end.

On CPU (and the meta device, for the memory model) the kernel is
``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward op; it takes grouped-query
K/V as they are and an additive mask in the inputs' dtype, built per block and dropped after it (in
backward it is built again from the token positions). :func:`fused_ring_supported` says where it runs.

    out = fused_ring(q, k, v, masks=lambda step: None, send=lambda x: x.clone(), steps=4, scale=0.25)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

# A block's mask by ring step: None where every query may see every key of the block, "causal"
# where the block is the rank's own (positions rise in both, so the causal mask is the lower
# triangle), "skip" where no query sees any key, a pair of slices ``(queries, keys)`` where exactly
# those queries see exactly those keys (the balanced split's other blocks under a causal mask: all
# queries over the head chunk, or the tail queries over all keys), else a boolean [B or 1, Tq, Tk].
BlockMask = Callable[[int], "torch.Tensor | tuple[slice, slice] | str | None"]


def fused_ring_supported(q: torch.Tensor) -> bool:
    """The CPU kernel runs on CPU tensors and, for shapes only, on the meta device. CUDA has no
    such op (its flash kernel takes no mask; its efficient kernel's log-sum-exp is padded and its
    backward takes random-state arguments), and this project's tests run no GPU, so CUDA keeps the
    block-by-block path (:func:`parallel.context.attention._block`)."""
    return q.device.type in ("cpu", "meta")


def fused_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, masks: BlockMask,
               send: Callable[[torch.Tensor], torch.Tensor], steps: int, scale: float) -> torch.Tensor:
    """Attention of ``q`` ``[B, H, Tq, D]`` over ``steps`` K/V blocks: this rank's ``k``, ``v``
    ``[B, Hkv, Tk, D]`` and, at each later step, the block ``send`` receives for the one it passes on
    (the previous rank's). ``masks(step)`` is the step's :data:`BlockMask`. Returns ``[B, H, Tq, D]``
    in ``q``'s dtype, differentiable in q, k and v (``send`` must be the same in backward)."""
    return _FusedRing.apply(q, k, v, masks, send, steps, scale)


class _FusedRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, masks: BlockMask, send, steps: int, scale: float):
        acc = torch.promote_types(q.dtype, torch.float32)  # the kernel's log-sum-exp dtype; bf16 merges in fp32
        kv = torch.stack((k, v))
        out = torch.zeros_like(q, dtype=acc)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        for step in range(steps):
            if step:
                kv = send(kv)
            mask = masks(step)
            if isinstance(mask, str) and mask == "skip":
                continue
            rows, cols, mask = _slices(mask)
            block_out, block_lse = _flash(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], mask, scale)
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
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        acc = lse.dtype
        grad = grad.contiguous()
        kv = torch.stack((k, v))
        dq = torch.zeros_like(q, dtype=acc)
        dkv = torch.zeros_like(kv, dtype=acc)  # the gradient of the block held, travelling with it
        for step in range(ctx.steps):
            if step:
                kv, dkv = ctx.send(kv), ctx.send(dkv)
            mask = ctx.masks(step)
            if isinstance(mask, str) and mask == "skip":
                continue
            rows, cols, mask = _slices(mask)
            causal, additive = _kernel_mask(mask, q.dtype)
            dq_block, dk_block, dv_block = _FLASH_BACKWARD(
                grad[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], out[:, :, rows],
                lse[:, :, rows], 0.0, causal, attn_mask=additive, scale=ctx.scale)
            dq[:, :, rows] += dq_block
            dkv[0, :, :, cols] += dk_block
            dkv[1, :, :, cols] += dv_block
        if ctx.steps > 1:
            dkv = ctx.send(dkv)  # after the last step a rank holds the next rank's block's: one more hop home
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _slices(mask) -> tuple[slice, slice, "torch.Tensor | str | None"]:
    """The queries and keys a block mask involves, and the mask within them."""
    if isinstance(mask, tuple):
        return mask[0], mask[1], None
    return slice(None), slice(None), mask


def _kernel_mask(mask, dtype: torch.dtype) -> tuple[bool, torch.Tensor | None]:
    """The kernel's ``is_causal`` and additive mask (``[B or 1, 1, Tq, Tk]``, -inf where hidden) for a block mask."""
    if mask is None:
        return False, None
    if isinstance(mask, str):  # "causal"
        return True, None
    return False, torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))[:, None]


def _flash(q, k, v, mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's normalised output and log-sum-exp ``[B, H, Tq]`` (``-inf`` for a query that sees
    none of its keys: the kernel gives such a row 0 and a log-sum-exp of 0)."""
    causal, additive = _kernel_mask(mask, q.dtype)
    out, lse = _FLASH(q, k, v, 0.0, causal, attn_mask=additive, scale=scale)
    if isinstance(mask, torch.Tensor):
        lse = lse.masked_fill(~mask.any(-1)[:, None], float("-inf"))
    return out, lse
