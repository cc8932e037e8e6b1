"""Checks of context parallelism (``parallel.context_parallel``), run inside the worker processes of one
launch per world size (``dist_harness``):

* ``attention``: :func:`parallel.context.context_attention` (ring and all-gather) against full
  attention on the whole sequence, outputs and the gradients of q, k and v, in fp64 and fp32, over
  shapes (heads, kv heads, lengths, batch), causal and not, with packed documents and without;
  the cp size is the world's (2 or 4).
* ``trained``: the trainer's own loop (:func:`trainer.run.loop.train`: config, loader, model, steps)
  on a cp layout; the parent compares the losses with one device's (and, for the mixture of experts
  ``gpt_moe``, the balance losses and the gradient norms).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.context import ContextShard, context_attention, shard_sequence
from trainer.config.compose import compose_dict
from trainer.run.metrics import NullProgress
from trainer.tracking.tracker import NullTracker
from trainer.validate.checks import validate_config

STEPS = 5
# gpt_debug: 4 layers, 4 query heads over 2 kv heads; 256 tokens, so each of 2 x cp chunks holds 32 or more.
BASE = ["model=gpt_debug", "train.seq_len=256", "train.global_batch_size=2", f"train.steps={STEPS}", "tracking=none",
        "train.checkpoint.save_final=false", "tracking.pictures=false", "train.eval_at_start=false", "optim.lr=1e-3",
        "optim.warmup_steps=0"]
# gpt_moe (8 experts, top 2) with its balance loss weighted 1, not the preset's 0.01, so that its gradient weighs:
# a balance-loss gradient not summed over the cp ranks (1 / cp of it) moved cp [2]'s gradient norms by 8% (by 6e-4 at 0.01).
MOE = ["model=gpt_moe", "model.moe.aux_loss_weight=1.0"]
DATA_ENV = "MESHFLOW_TEST_CP_DATA_DIR"  # set by the parent test: docs.jsonl, and a chat model/ and chats.jsonl

# The memory check: cp [4], 2 rows of 16,384 tokens, 3 steps (the peak settles from step 2 on). Attention
# over the row is what the plan has to get right there: scores kept for backward would be 2 rows x 4
# heads x 4,096 x 16,384 fp32 a layer, 2 GiB, ten times everything else. (Measured within 5% of the plan
# at 4,096-16,384 tokens too.)
MEMORY = ["+parallel=cp", "mesh=[4]", "model.max_seq_len=16384", "train.seq_len=16384", "train.steps=3"]

# (batch, heads, kv heads, tokens per chunk of 2 x cp, head dim): whole heads, grouped heads, one kv head.
SHAPES = [(2, 4, 4, 4, 8), (1, 4, 2, 8, 16), (2, 6, 2, 3, 8), (1, 2, 1, 16, 4)]
# (causal, packed documents): the decoder's two cases, and attention that sees the whole row.
MASKS = [(True, False), (True, True), (False, False)]


def overrides(data: str, extra: list[str]) -> list[str]:
    """``synthetic`` rows; ``packed`` documents (byte tokens, positions restarting at each); ``chat``: the tiny
    Hugging Face Llama on packed conversations whose targets are masked but the assistant's (uneven counts);
    ``qwen2``: synthetic rows through a tiny Hugging Face Qwen2 of a checkpoint's awkward shapes; ``moe``: synthetic
    rows through the mixture of experts ``gpt_moe``."""
    root = os.environ.get(DATA_ENV, "")
    if data == "moe":
        return [*MOE, *BASE[1:], "data=synthetic", "data.num_tokens=65536", *extra]
    if data == "chat":
        return ["model=hf", f"model.path={root}/model", "data=chat", f"data.paths=[{root}/chats.jsonl]",
                "train.seq_len=64", "train.global_batch_size=4", *BASE[3:], *extra]  # 4 rows: uneven target counts
    if data == "qwen2":  # a checkpoint's shapes: 9 query heads over 3 kv heads (width 8), q/k/v biases, tied embeddings
        return ["model=hf", f"model.path={root}/qwen2", "data=synthetic", "data.num_tokens=65536", *BASE[1:], *extra]
    rows = {"synthetic": ["data=synthetic", "data.num_tokens=65536"],
            "packed": ["data=files", f"data.paths=[{root}/docs.jsonl]", "data.packing=true"]}[data]
    return [*BASE, *rows, *extra]


def trained(data: str, extra: list[str]):
    """A check: the trainer's loop on ``data`` under ``extra``; its losses, as every rank reports them."""

    def check(*, rank: int, world_size: int) -> dict:
        from trainer.run.loop import train

        began = time.perf_counter()
        # The model-aware checks and the memory prediction (a meta pass each) are test_context_configs.py's.
        cfg = validate_config(compose_dict(overrides(data, extra)), check_model=False)
        validated = time.perf_counter()
        result = train(cfg, tracker=NullTracker(), progress=NullProgress(), rank=rank, predicted_peak_mib=0.0)
        return {"losses": result.losses, "aux_losses": result.aux_losses, "grad_norms": result.grad_norms,
                "validate_s": validated - began, "train_s": time.perf_counter() - validated,
                "step_s": result.step_times, "peak_mib": result.peak_memory_mb}

    return check


def _documents(batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """``[batch, seq_len]`` positions of packed documents: each row cut at a few random places (row 0 not at all)."""
    positions = torch.arange(seq_len).repeat(batch, 1)
    for row in range(1, batch):
        for cut in sorted(torch.randperm(seq_len - 1, generator=generator)[:3].add(1).tolist()):
            positions[row, cut:] = torch.arange(seq_len - cut)
    return positions


def _full(q, k, v, *, causal: bool, doc: torch.Tensor | None) -> torch.Tensor:
    """Attention over the whole sequence on one process: SDPA with the mask spelled out."""
    seq_len = q.shape[2]
    index = torch.arange(seq_len)
    mask = (index[None, :] <= index[:, None]) if causal else torch.ones(seq_len, seq_len, dtype=torch.bool)
    mask = mask[None, None]
    if doc is not None:
        mask = mask & (doc[:, None, :, None] == doc[:, None, None, :])
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)


def _one_case(shard: ContextShard, dtype: torch.dtype, seed: int, shape: tuple, causal: bool, packed: bool) -> float:
    """The largest difference from full attention of the output and the q, k, v gradients."""
    batch, heads, kv_heads, chunk, dim = shape
    g = torch.Generator().manual_seed(seed)  # every rank draws the same full tensors, then takes its chunks
    seq_len = 2 * shard.size * chunk
    q = torch.randn(batch, heads, seq_len, dim, generator=g, dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, seq_len, dim, generator=g, dtype=dtype) for _ in range(2))
    grad_out = torch.randn(batch, heads, seq_len, dim, generator=g, dtype=dtype)
    # A document is known by the position it starts at.
    doc = torch.arange(seq_len) - _documents(batch, seq_len, g) if packed else None
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = _full(*full, causal=causal, doc=doc)
    (expected * grad_out).sum().backward()

    def mine(t: torch.Tensor, dim: int = 2) -> torch.Tensor:
        return shard_sequence(t, dim=dim, cp_rank=shard.rank, cp_size=shard.size)

    local = [mine(t).clone().requires_grad_() for t in (q, k, v)]
    out = context_attention(*local, shard=shard, q_index=shard.token_index(2 * chunk), causal=causal,
                            doc=mine(doc, 1) if doc is not None else None)
    (out * mine(grad_out)).sum().backward()
    pairs = [(out, expected)] + [(a.grad, b.grad) for a, b in zip(local, full)]
    return max(float((a - mine(b)).abs().max()) for a, b in pairs)


def attention_check(*, rank: int, world_size: int) -> dict:
    """The largest difference from full attention (outputs and q/k/v gradients) per dtype, over
    both methods, every shape and mask in fp64 and one shape's masks in fp32 (rounding only)."""
    began = time.perf_counter()
    worst: dict[str, float] = {"float64": 0.0, "float32": 0.0}
    cases = 0
    for method in ("ring", "allgather"):
        shard = ContextShard(group=dist.group.WORLD, rank=rank, size=world_size, method=method)
        for dtype, shapes in ((torch.float64, SHAPES), (torch.float32, SHAPES[1:2])):
            name = str(dtype).removeprefix("torch.")
            for shape_index, shape in enumerate(shapes):
                for causal, packed in MASKS:
                    error = _one_case(shard, dtype, 100 * shape_index + 10 * causal + packed, shape, causal, packed)
                    worst[name] = max(worst[name], error)
                    cases += 1
    return {"worst": worst, "cases": cases, "seconds": time.perf_counter() - began}


_PP_CP = ["+parallel=pp", "mesh=[2,2]", "parallel.dims=[pp,cp]", "+parallel.context_parallel={dim: cp}"]

# The default run: the attention property check and the layouts of the acceptance (one launch per world size);
# the rest (all-gather, packed documents, chat) in the slow pass, one more launch per world size.
SUITES = {
    "two_rank": [
        ("attention_cp2", attention_check),
        ("cp2_ring", trained("synthetic", ["+parallel=cp", "mesh=[2]"])),
        ("moe_cp2", trained("moe", ["+parallel=cp", "mesh=[2]"])),
    ],
    "four_rank": [
        ("attention_cp4", attention_check),
        ("cp4_ring", trained("synthetic", ["+parallel=cp", "mesh=[4]"])),
        ("fsdp_cp", trained("synthetic", ["+parallel=fsdp_cp", "mesh=[2,2]"])),
        ("moe_fsdp_cp", trained("moe", ["+parallel=fsdp_cp", "mesh=[2,2]"])),
        ("cp_tp_sp", trained("synthetic", ["+parallel=3d_cp", "mesh=[1,2,2]", "parallel.tensor_parallel.sequence_parallel=true"])),
    ],
    "two_rank_slow": [
        ("cp2_allgather", trained("synthetic", ["+parallel=cp", "mesh=[2]", "parallel.context_parallel.method=allgather"])),
        ("cp2_packed", trained("packed", ["+parallel=cp", "mesh=[2]"])),
        ("cp2_chat", trained("chat", ["+parallel=cp", "mesh=[2]"])),
        ("cp2_qwen2", trained("qwen2", ["+parallel=cp", "mesh=[2]"])),
    ],
    "four_rank_slow": [
        ("memory_cp4", trained("synthetic", MEMORY)),  # first: the worker's memory floor is read before any other check
        ("cp4_packed_allgather", trained("packed", ["+parallel=cp", "mesh=[4]", "parallel.context_parallel.method=allgather"])),
        ("fsdp_cp_chat", trained("chat", ["+parallel=fsdp_cp", "mesh=[2,2]"])),
        # pp x cp [2, 2]: every stage holds its cp rank's chunks of each micro-batch's rows.
        ("pp_cp", trained("synthetic", [*_PP_CP, "parallel.pipeline.microbatches=2"])),
        ("pp_cp_packed_interleaved", trained("packed", [*_PP_CP, "parallel.pipeline.microbatches=2",
                                                        "parallel.pipeline.schedule=Interleaved1F1B",
                                                        "parallel.pipeline.stages_per_rank=2"])),
        ("pp_cp_zbv", trained("synthetic", [*_PP_CP, "parallel.pipeline.microbatches=2", "parallel.pipeline.schedule=ZBV",
                                            "parallel.pipeline.stages_per_rank=2"])),
        # ep x cp [2, 2]: the experts split over ep, every other parameter sharded over ep x cp; and with an fsdp axis.
        ("moe_ep_cp", trained("moe", ["+parallel=ep", "mesh=[2,2]", "parallel.dims=[ep,cp]",
                                      "+parallel.context_parallel={dim: cp}"])),
        ("moe_fsdp_ep_cp", trained("moe", ["+parallel=fsdp_ep", "mesh=[1,2,2]", "parallel.dims=[dp,ep,cp]",
                                           "+parallel.context_parallel={dim: cp}"])),
        # cp x tp [2, 2]: Megatron attention and dense parts over tp, the MoE blocks replicated over it.
        ("moe_cp_tp", trained("moe", ["+parallel=3d_cp", "mesh=[1,2,2]"])),
        # pp x cp [2, 2]: each stage's blocks add their balance loss through the stage's output (stage_term).
        ("moe_pp_cp", trained("moe", [*_PP_CP, "parallel.pipeline.microbatches=2"])),
        ("moe_pp_cp_zbv", trained("moe", [*_PP_CP, "parallel.pipeline.microbatches=2", "parallel.pipeline.schedule=ZBV",
                                          "parallel.pipeline.stages_per_rank=2"])),
        # hsdp x cp [2, 1, 2]: replicated over dp_replicate, sharded over dp_shard x cp flattened (2 ranks).
        ("hsdp_cp", trained("synthetic", ["+parallel=hsdp", "mesh=[2,1,2]", "parallel.dims=[dp_replicate,dp_shard,cp]",
                                          "+parallel.context_parallel={dim: cp}"])),
    ],
}
