"""What a decoder block keeps for backward, byte for byte: Megatron-LM's count, not autograd's default.

Each norm keeps its input and one fp32 scale per token (not two fp32 copies of its input), the gated
MLP unit its two inputs (not ``silu(gate)`` beside them), attention K and V at the kv heads' width (the
kernel reads grouped heads in place). The meta pass counts what the block's autograd graph saves
(:func:`trainer.planner.memory.meta_pass.saved_activations`); the numbers are computed here by hand.

    python -m pytest tests/unit/test_block_saves.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.config.compose import compose_dict
from trainer.models.layers import RMSNorm, swiglu
from trainer.planner.memory.meta_pass import saved_activations
from trainer.validate.checks import validate_with_plan

DIM, HEADS, KV, FFN, SEQ, MAX_SEQ = 256, 8, 2, 640, 128, 256


def _cfg(precision: str):
    return validate_with_plan(compose_dict([
        "model=gpt_small", f"model.dim={DIM}", "model.n_layers=2", f"model.n_heads={HEADS}", f"model.n_kv_heads={KV}",
        f"model.ffn_hidden_dim={FFN}", f"model.max_seq_len={MAX_SEQ}", f"train.seq_len={SEQ}",
        f"train.precision={precision}", "tracking=none", "data=synthetic"]))


@pytest.mark.parametrize("precision,size", [("bf16", 2), ("fp32", 4)])
def test_a_block_keeps_megatrons_count(precision, size):
    cfg, plan = _cfg(precision)
    micro = 2
    units = saved_activations(cfg, plan, micro)["units"]
    tokens, head_dim = micro * SEQ, DIM // HEADS
    rows = (tokens * DIM  # the attention norm's input
            + tokens * DIM  # its output: the q, k, v projections' input
            + tokens * DIM + 2 * tokens * KV * head_dim  # q, and K, V at the kv heads' width
            + tokens * DIM  # attention's output, read in place by the output projection
            + tokens * DIM  # the MLP norm's input
            + tokens * DIM  # its output: the gate and up projections' input
            + 3 * tokens * FFN)  # gate, up, and their product (the down projection's input)
    fp32 = 2 * tokens + HEADS * tokens  # each norm's reciprocal RMS, attention's log-sum-exp
    rope = 2 * MAX_SEQ * head_dim // 2  # the rotary tables the rotation keeps (whole buffers)
    assert units["layers.0"] == units["layers.1"] == rows * size + fp32 * 4 + rope * size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_and_the_gated_unit_equal_torchs_own(dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64, dtype=dtype, requires_grad=True)
    norm = RMSNorm(64, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    reference = torch.nn.RMSNorm(64, eps=1e-5).to(dtype)
    reference.load_state_dict(norm.state_dict())
    grad = torch.randn(2, 16, 64, dtype=dtype)
    out, expected = norm(x), reference(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for got, want in zip(torch.autograd.grad(out, (x, norm.weight), grad),
                         torch.autograd.grad(expected, (x, reference.weight), grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    gate, up = (torch.randn(2, 16, 64, dtype=dtype, requires_grad=True) for _ in range(2))
    out, expected = swiglu(gate, up), F.silu(gate) * up
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for got, want in zip(torch.autograd.grad(out, (gate, up), grad), torch.autograd.grad(expected, (gate, up), grad)):
        torch.testing.assert_close(got, want, **tol)


def test_the_backward_formulas_are_exact_in_double_precision():
    x, weight = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True), torch.randn(8, dtype=torch.float64,
                                                                                          requires_grad=True)
    norm = RMSNorm(8, 1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(weight)
    assert torch.autograd.gradcheck(lambda t: norm(t), (x,))
    assert torch.autograd.gradcheck(swiglu, tuple(torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
                                                  for _ in range(2)))
