"""The cp ring's block kernels (parallel/context/ring.py) on one process: the plain-operations kernel
(fp32 on CUDA, boolean masks there) against CPU's fused one, CUDA's flash adapter on the meta device
(its shapes and GQA gradients), and the models' shortened rings (ring_alone)."""

from __future__ import annotations

import pytest
import torch

import parallel.context.ring as ring
from parallel.context import ring_alone
from parallel.context.ring import fused_ring


def _inputs(heads=4, kv_heads=2, tokens=6, width=8):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, tokens, width, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, tokens, width, generator=g, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    return q, k, v


def _run(q, k, v, masks, steps=3):
    out = fused_ring(q, k, v, masks=masks, send=lambda x: (lambda r=x.roll(1, dims=3): r), steps=steps, scale=0.3)
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum(),
                                (q, k, v))
    return out, grads


BOOLEAN = torch.tensor([[[True, False, True, False, True, True]] * 3 + [[False] * 6] + [[True] * 6] * 2])


@pytest.mark.parametrize("masks", [
    lambda step: None,
    lambda step: "causal" if step == 0 else (slice(None), slice(0, 3)),
    lambda step: "causal" if step == 0 else (slice(2, 6), slice(None)) if step == 1 else "skip",
    lambda step: "causal" if step == 0 else BOOLEAN,
], ids=["whole", "causal-slices", "causal-skip", "boolean"])
def test_the_plain_operations_kernel_equals_the_fused_one(monkeypatch, masks):
    q, k, v = _inputs()
    expected = _run(q, k, v, masks)
    monkeypatch.setattr(ring, "kernel_for", lambda q, mask: (ring._math_forward, ring._math_backward))
    got = _run(q, k, v, masks)
    assert torch.allclose(got[0], expected[0], rtol=0, atol=1e-12)
    for a, b in zip(got[1], expected[1]):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_cuda_flash_adapter_keeps_grouped_kv_shapes_on_meta():
    q = torch.empty(2, 8, 16, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 2, 12, 64, device="meta", dtype=torch.bfloat16)
    out, lse = ring._cuda_forward(q, k, k, None, 0.125)
    assert out.shape == (2, 8, 16, 64) and lse.shape == (2, 8, 16) and lse.dtype == torch.float32
    dq, dk, dv = ring._cuda_backward(out, q, k, k, out, lse, "causal", 0.125)
    assert dq.shape == q.shape and dk.shape == k.shape == dv.shape


def test_cuda_picks_flash_for_half_precision_and_the_plain_kernel_otherwise():
    class Fake:  # kernel_for reads only device, dtype and shape
        def __init__(self, dtype, width=128):
            self.device, self.dtype, self.shape = torch.device("cuda"), dtype, (1, 8, 16, width)

    assert ring.kernel_for(Fake(torch.bfloat16), "causal")[0] is ring._cuda_forward
    assert ring.kernel_for(Fake(torch.bfloat16), (slice(None), slice(0, 4)))[0] is ring._cuda_forward
    assert ring.kernel_for(Fake(torch.float32), None)[0] is ring._math_forward
    assert ring.kernel_for(Fake(torch.bfloat16), torch.ones(1, 16, 16, dtype=torch.bool))[0] is ring._math_forward
    assert ring.kernel_for(Fake(torch.bfloat16, width=320), None)[0] is ring._math_forward


def _flops(fn) -> float:
    from trainer.planner.cost.model import _FLASH_CPU, flash_flops
    from torch.utils._python_dispatch import TorchDispatchMode

    total = [0.0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in _FLASH_CPU:
                total[0] += flash_flops(func, args, kwargs)[1]
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return total[0]


@pytest.mark.parametrize("causal", [True, False])
def test_a_merged_ring_does_the_whole_rings_flops(causal):
    # b=1, h=4, T=64, d=16, 6 blocks. Forward, causal: own triangle 4*4*64*64*16/2 = 524,288, then
    # 5 blocks of half the keys 5 * 4*4*64*32*16 = 2,621,440; backward 2.5 times: 10,485,760 in all.
    q = torch.empty(1, 4, 64, 16, device="meta", requires_grad=True)
    k = torch.empty(1, 4, 64, 16, device="meta", requires_grad=True)

    def run(merged):
        return lambda: ring_alone(q, k, k, blocks=6, causal=causal, merged=merged).sum().backward()

    expected = 3.5 * (524_288 + 2_621_440) if causal else 3.5 * 6 * 4 * 4 * 64 * 64 * 16
    assert _flops(run(False)) == pytest.approx(expected)
    assert _flops(run(True)) == pytest.approx(expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's flash kernel: needs a GPU")
@pytest.mark.parametrize("mask", [None, "causal"])
def test_cuda_flash_adapter_equals_the_plain_kernel_on_a_gpu(mask):
    """One block on CUDA in bf16: the flash adapter's output, log-sum-exp and gradients (against
    its own output and log-sum-exp, as the ring's backward passes the merged ones) equal the
    plain-operations kernel's within bf16 rounding; 8 query heads over 2 kv heads of 64."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 2, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    grad = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse = ring._cuda_forward(q, k, v, mask, 0.125)
    want_out, want_lse = ring._math_forward(q, k, v, mask, 0.125)
    assert torch.allclose(out.float(), want_out.float(), atol=2e-2) and torch.allclose(lse, want_lse, atol=1e-2)
    got = ring._cuda_backward(grad, q, k, v, want_out, want_lse, mask, 0.125)
    want = ring._math_backward(grad, q, k, v, want_out, want_lse, mask, 0.125)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=5e-2, rtol=5e-2)
