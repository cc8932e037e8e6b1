"""The memory model's meta pass takes its attention kernel as an argument and applies it in its own
thread only (a torch function mode): ``torch.nn.functional`` is never patched, so plans counted at
once in the control plane's thread pool, and anything else calling attention meanwhile, are unaffected."""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from trainer.config.compose import compose_dict
from trainer.models import build_model
from trainer.planner.memory.meta_pass import AttentionKernel, flash_attention_for_cpu, saved_activations
from trainer.validate.checks import validate_with_plan

REAL_SDPA = torch._C._nn.scaled_dot_product_attention  # what F.scaled_dot_product_attention is, unpatched
MICRO_BATCH, SEQ = 2, 32


def _debug(*overrides: str):
    """gpt_debug (4 layers, 4 heads) at seq 32: a meta pass of a quarter of a second."""
    return validate_with_plan(compose_dict(["model=gpt_debug", f"train.seq_len={SEQ}", *overrides, "tracking=none"]))


def test_the_attention_argument_is_what_the_pass_runs_and_counts():
    cfg, plan = _debug()
    calls = []

    def recording(*args, **kwargs):
        calls.append(args[0].shape)
        return flash_attention_for_cpu(*args, **kwargs)

    fused = saved_activations(cfg, plan, MICRO_BATCH, attention=recording)
    heads = cfg.model.n_heads
    assert calls == [(MICRO_BATCH, heads, SEQ, cfg.model.dim // heads)] * cfg.model.n_layers  # once per layer
    assert fused["units"] == saved_activations(cfg, plan, MICRO_BATCH)["units"]  # the default: the fused kernel
    # The unfused function (on meta: the math path) saves each layer's T x T softmax instead of a
    # log-sum-exp per row, and K and V repeated to the query heads where the fused kernel keeps them at
    # the kv heads' width (gpt_debug: 4 heads, 2 kv heads); the argument is what decides it.
    math = saved_activations(cfg, plan, MICRO_BATCH, attention=F.scaled_dot_product_attention)
    kv, head_dim = cfg.model.n_kv_heads, cfg.model.dim // heads
    # fp32
    per_layer = 4 * MICRO_BATCH * heads * (SEQ * SEQ - SEQ) + 2 * 4 * MICRO_BATCH * (heads - kv) * SEQ * head_dim
    assert {unit: math["units"][unit] - fused["units"][unit] for unit in fused["units"]} == {
        unit: per_layer if unit in plan.blocks else 0.0 for unit in fused["units"]}


def test_a_meta_pass_in_one_thread_leaves_attention_alone_in_another():
    cfg, plan = _debug("+parallel=tp", "mesh=[2]")
    inside, observed = threading.Event(), threading.Event()
    callers: list[int] = []
    result: dict = {}

    def pausing(*args, **kwargs):  # the first attention of the pass waits while the main thread looks
        callers.append(threading.get_ident())
        if not inside.is_set():
            inside.set()
            observed.wait()
        return flash_attention_for_cpu(*args, **kwargs)

    def meta_pass():
        try:
            result["saved"] = saved_activations(cfg, plan, MICRO_BATCH, attention=pausing)
        finally:
            inside.set()  # a pass that fails before its first attention must not leave the main thread waiting

    worker = threading.Thread(target=meta_pass)
    worker.start()
    inside.wait()
    try:
        function = F.scaled_dot_product_attention
        q, k, v = torch.randn(3, 1, 2, 8, 16).unbind()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    finally:
        observed.set()
        worker.join()
    assert function is REAL_SDPA  # never reassigned, not even while the pass is inside its kernel
    assert callers == [worker.ident] * cfg.model.n_layers  # this thread's call did not reach the pass's kernel
    reference = torch.softmax((q @ k.transpose(-1, -2)) / 4 + torch.full((8, 8), -torch.inf).triu(1), dim=-1) @ v
    torch.testing.assert_close(out, reference)
    assert sum(result["saved"]["units"].values()) == sum(saved_activations(cfg, plan, MICRO_BATCH)["units"].values())


def test_the_fused_kernel_falls_back_to_the_real_function_for_a_mask_without_recursing():
    q, k, v = torch.randn(3, 2, 2, 6, 8).unbind()
    mask = torch.rand(6, 6) > 0.3
    mask.fill_diagonal_(True)  # every row attends somewhere
    called = []

    def counting(*args, **kwargs):
        called.append(kwargs.get("attn_mask") is not None)
        return flash_attention_for_cpu(*args, **kwargs)

    with AttentionKernel(counting):
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert called == [True, False]  # once each: the fallback's own call went to torch, not back into the mode
    torch.testing.assert_close(masked, REAL_SDPA(q, k, v, attn_mask=mask))
    torch.testing.assert_close(causal, REAL_SDPA(q, k, v, is_causal=True))


class _Copy(torch.nn.Module):
    """A stand-in block norm that saves nothing for backward itself (a copy needs no input to differentiate)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


def test_the_projections_keep_a_sequence_parallel_norms_output_as_its_shard():
    """tp 2, with and without sequence parallelism, the block norms replaced by copies that save nothing
    themselves: a block then differs only by the two norm outputs its projections keep (attention's
    input, the MLP's): whole [2, 32, 64] fp32 without sequence parallelism (16384 bytes each), their
    sequence shard with it (the engine gathers them again in backward): 2 x 16384 / 2 = 16384 bytes less."""
    per_block = {}
    for extra in (["+parallel=tp"], ["+parallel=tp_sp"]):
        cfg, plan = _debug(*extra, "mesh=[2]", "parallel.tensor_parallel.loss_parallel=false")
        model = build_model(cfg.model, device="meta")
        for block in model.layers.values():
            block.attn_norm, block.mlp_norm = _Copy(), _Copy()
        units = saved_activations(cfg, plan, MICRO_BATCH, model=model)["units"]
        per_block[extra[0]] = {unit: units[unit] for unit in plan.blocks}
    whole = MICRO_BATCH * SEQ * 64 * 4
    assert whole == 16384
    tp, sp = per_block["+parallel=tp"], per_block["+parallel=tp_sp"]
    assert {unit: tp[unit] - sp[unit] for unit in tp} == {unit: 2 * whole / 2 for unit in tp}
