"""The chunked cross-entropy and Megatron's selective recomputation on one device (no process group), and
what the planner makes of them and of loss parallel: same losses and gradients as the plain forms (fp32,
rel 1e-5), at most one chunk's fp32 log-probabilities alive, the attention kernel run twice per block, and
the predicted activations and step time that follow.

    pytest tests/unit/test_loss_and_recompute.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from parallel.sharding.activation_checkpointing import apply_ac
from trainer.config.compose import compose_dict
from trainer.config.schema import LlamaConfig
from trainer.models import TargetMeanLoss, build_model, loss_fn_for
from trainer.models.loss import cross_entropy_mean, cross_entropy_sum
from trainer.planner.memory.meta_pass import saved_activations
from trainer.planner.memory.predict import predict_memory
from trainer.validate.checks import validate_with_plan

REL = 1e-5
CFG = LlamaConfig(n_layers=2, vocab_size=320)
BLOCKS = ["layers.0", "layers.1"]


def _batch(rows: int = 3, seq: int = 40, masked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, CFG.vocab_size, (rows, seq + 1), generator=g)
    targets = tokens[:, 1:].clone()
    if masked:
        targets[:, ::4] = -100  # a chat row's prompt tokens
    return tokens[:, :-1], targets


def _step(model: torch.nn.Module, loss_fn, inputs, targets) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad()
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def _assert_same(a: tuple[float, list], b: tuple[float, list]) -> None:
    assert a[0] == pytest.approx(b[0], rel=REL)
    for x, y in zip(a[1], b[1], strict=True):
        assert float((x - y).abs().max()) <= REL * float(y.abs().max())


# ------------------------------------------------------------------------- chunked cross-entropy


@pytest.mark.parametrize("chunk", [7, 40, 119])  # uneven last chunk, one row per chunk, most of the batch
def test_chunked_lm_loss_equals_the_whole(chunk):
    model, (inputs, targets) = build_model(CFG, seed=0), _batch()
    _assert_same(_step(model, loss_fn_for(CFG, chunk_tokens=chunk), inputs, targets),
                 _step(model, loss_fn_for(CFG), inputs, targets))


def test_chunked_masked_loss_equals_the_whole():
    """The chat data's masked loss (TargetMeanLoss: a sum over the targets that count, over the global count)."""
    model, (inputs, targets) = build_model(CFG, seed=0), _batch(masked=True)
    whole, chunked = TargetMeanLoss(), TargetMeanLoss(chunk_tokens=16)
    whole.tokens_per_row = chunked.tokens_per_row = 30.0  # 40 tokens, every 4th masked
    _assert_same(_step(model, chunked, inputs, targets), _step(model, whole, inputs, targets))
    # and the values themselves: the sum equals F.cross_entropy's over the kept targets
    logits = torch.randn(3, 40, CFG.vocab_size, generator=torch.Generator().manual_seed(1))
    expected = F.cross_entropy(logits.reshape(-1, CFG.vocab_size), targets.reshape(-1), reduction="sum")
    assert float(cross_entropy_sum(logits, targets, chunk_tokens=16)) == pytest.approx(float(expected), rel=REL)
    mean = F.cross_entropy(logits.reshape(-1, CFG.vocab_size), targets.reshape(-1))
    assert float(cross_entropy_mean(logits, targets, chunk_tokens=16)) == pytest.approx(float(mean), rel=REL)


class _LargestFloat(TorchDispatchMode):
    """The most elements of any fp32 tensor an op makes with ``width`` columns (the vocabulary's)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width, self.largest = width, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 2 and t.shape[-1] == self.width:
                self.largest = max(self.largest, t.numel())
        return out


def test_chunking_holds_one_chunks_fp32_at_a_time():
    """bf16 logits of 120 tokens: unchunked, forward and backward make [120, V] fp32 tensors (the upcast,
    its log-softmax, their gradients); chunked by 16, never more than [16, V], forward or backward."""
    logits = torch.randn(3, 40, CFG.vocab_size, dtype=torch.bfloat16, requires_grad=True)
    targets = _batch()[1]
    for chunk, most in ((None, 120), (16, 16)):
        with _LargestFloat(CFG.vocab_size) as seen:
            cross_entropy_mean(logits, targets, chunk_tokens=chunk).backward()
        assert seen.largest == most * CFG.vocab_size, (chunk, seen.largest)


# ------------------------------------------------------------------- selective recomputation


class _AttentionCalls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode, every, calls", [("none", 1, 2), ("selective", 1, 4), ("full", 1, 4), ("full", 2, 3)])
def test_recomputation_keeps_losses_and_gradients(mode, every, calls):
    """Every mode gives no checkpointing's loss and gradients; the attention kernel runs once per block
    forward, and again in backward for each block whose core (selective) or whole self (full) is recomputed."""
    inputs, targets = _batch()
    reference = _step(build_model(CFG, seed=0), loss_fn_for(CFG), inputs, targets)
    model = build_model(CFG, seed=0)
    touched = apply_ac(model, mode=mode, every=every, block_fqns=BLOCKS)
    with _AttentionCalls() as seen:
        result = _step(model, loss_fn_for(CFG), inputs, targets)
    _assert_same(result, reference)
    assert seen.count == calls
    assert touched == {"none": [], "selective": ["layers.0.attn", "layers.1.attn"]}.get(
        mode, BLOCKS if every == 1 else ["layers.1"])


def test_selective_with_packed_documents_equals_the_plain_model():
    """A mask (packed documents) takes the math path; its [T, T] scores are what selective drops."""
    inputs, targets = _batch()
    positions = torch.cat([torch.arange(15), torch.arange(25)]).repeat(3, 1)
    plain = build_model(CFG, seed=0)
    model = build_model(CFG, seed=0)
    apply_ac(model, mode="selective", block_fqns=BLOCKS)

    def step(m):
        m.zero_grad()
        loss = loss_fn_for(CFG)(m(inputs, positions=positions), targets)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in m.parameters()]

    _assert_same(step(model), step(plain))


# ------------------------------------------------------------------------------ the planner


def _plan(*overrides: str):
    return validate_with_plan(compose_dict(["model=gpt_small", "tracking=none", "train.global_batch_size=2",
                                            "train.seq_len=512", *overrides]))


def test_memory_counts_the_attention_core_selective_drops():
    """Per block, what the attention kernel saves beyond q, k, v (CPU flash: its output [b, h, s, d] fp32 and
    a log-sum-exp [b, h, s]) is the saving of selective; full keeps only each block's input."""
    cfg, plan = _plan("+parallel=fsdp", "mesh=[2]")
    saved = saved_activations(cfg, plan, cfg.micro_batch_size)
    decoder = cfg.model
    b, s, h, d = cfg.micro_batch_size, cfg.train.seq_len, decoder.n_heads, decoder.head_width
    assert saved["cores"]["layers.0"] == pytest.approx(b * h * s * d * 4 + b * h * s * 4)
    none, = predict_memory(cfg, plan)
    selective, = predict_memory(*_plan("+parallel=fsdp", "mesh=[2]", "parallel.activation_checkpointing=selective"))
    full, = predict_memory(*_plan("+parallel=fsdp", "mesh=[2]", "parallel.activation_checkpointing=full"))
    blocks = len(plan.blocks)
    core = saved["cores"]["layers.0"]
    # all blocks' cores dropped; one block's recomputed in backward, counted only beyond what the head
    # (norm, output, loss) saved, which backward frees before it reaches the blocks
    assert selective.parts.recompute == pytest.approx(max(0.0, core - selective.parts.head), rel=1e-6)
    assert none.activations - selective.activations == pytest.approx(blocks * core - selective.parts.recompute,
                                                                     rel=1e-6)
    assert full.activations < selective.activations


def test_loss_parallel_and_chunks_shrink_the_logits_in_the_memory_pass():
    """tp [2], an 8192-token vocabulary, 1024 tokens: the head's vocabulary shard halves the saved fp32
    log-softmax on each rank. Chunked, what backward keeps is the logits' gradient in their own dtype
    (bf16: half of the fp32 log-softmax it replaces), and backward makes no [tokens, vocab] fp32 gradients
    beside it (fp32: 32.5 -> 24.1 MiB beyond the saved tensors at the worst moment)."""
    common = ("+parallel=tp", "mesh=[2]", "model.vocab_size=8192")
    runs = {(lp, chunk, prec): _plan(*common, f"parallel.tensor_parallel.loss_parallel={lp}",
                                     f"train.loss_chunk_tokens={chunk}", f"train.precision={prec}")
            for lp, chunk, prec in (("true", 0, "fp32"), ("false", 0, "fp32"), ("true", 256, "fp32"),
                                    ("true", 0, "bf16"), ("true", 256, "bf16"))}
    assert runs["true", 0, "fp32"][1].loss_parallel and not runs["false", 0, "fp32"][1].loss_parallel
    head = {key: saved_activations(cfg, plan, cfg.micro_batch_size)["units"]["output"] for key,
            (cfg, plan) in runs.items()}
    transient = {key: predict_memory(*run)[0].parts.transient for key, run in runs.items()}
    shard = 2 * 512 * 8192 // 2  # tokens x this rank's vocabulary columns
    assert head["false", 0, "fp32"] - head["true", 0, "fp32"] == pytest.approx(shard * 4, rel=1e-3)
    assert head["true", 0, "bf16"] - head["true", 256, "bf16"] == pytest.approx(shard * 2, rel=1e-3)
    # fp32: the chunked loss's forward holds the logits beside the gradient it makes (the worst moment there),
    # the whole loss's backward the log-softmax's gradient and the logits' beside the saved log-softmax.
    assert transient["true", 0, "fp32"] - transient["true", 256, "fp32"] >= shard * 4 / 2 * 0.99
    assert transient["true", 0, "bf16"] - transient["true", 256, "bf16"] >= shard * 4 * 0.99


def test_selective_costs_the_attention_kernels_forward_again():
    """On a GPU profile a selective block's forward is its own plus its attention kernel's; full, twice."""
    from trainer.planner.cost.device import device_unit_costs, predict_on_profile
    from trainer.planner.cost.speed import DeviceSpeed

    runs = {mode: _plan("hardware=h100_sxm", "dry_run=true", "+parallel=fsdp", "mesh=[2]",
                        f"parallel.activation_checkpointing={mode}") for mode in ("none", "selective", "full")}
    cfg, plan = runs["none"]
    speed = DeviceSpeed.of(cfg.hardware, cfg.train.precision)
    costs = device_unit_costs(cfg, plan, cfg.micro_batch_size, speed)
    core = sum(costs[b].core_forward_s for b in plan.blocks)
    forward = sum(costs[b].forward_s for b in plan.blocks)
    assert 0 < core < forward
    steps = {mode: predict_on_profile(cfg, plan, cfg.hardware).compute_s for mode, (cfg, plan) in runs.items()}
    passes = 1  # 2 sequences over 2 ranks, one micro-batch each
    assert steps["selective"] - steps["none"] == pytest.approx(core * passes, rel=1e-6)
    assert steps["full"] - steps["none"] == pytest.approx(forward * passes, rel=1e-6)


def test_a_vocabulary_tp_does_not_divide_keeps_the_head_whole_with_a_warning():
    """Loss parallel is on by default: tp [3] on gpt_small's 256 tokens falls back to the whole head (as
    before loss parallel existed) and says so; tp [2] splits it, and false keeps it whole silently."""
    import warnings

    with pytest.warns(UserWarning, match=r"vocabulary \(256 tokens\) is not divisible by the tp size 3"):
        cfg, plan = _plan("+parallel=tp", "mesh=[3]", "model.n_heads=6", "model.n_kv_heads=3", "model.dim=384",
              "model.ffn_hidden_dim=1032")
    assert not plan.loss_parallel and "output.weight" not in plan.placements
    cfg, plan = _plan("+parallel=tp", "mesh=[2]")
    assert plan.loss_parallel and repr(plan.placements["output.weight"]["tp"]) == "Shard(0)"
    assert repr(plan.layouts["output"].output["tp"]) == "Shard(2)"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg, plan = _plan("+parallel=tp", "mesh=[3]", "model.n_heads=6", "model.n_kv_heads=3", "model.dim=384",
                          "model.ffn_hidden_dim=1032", "parallel.tensor_parallel.loss_parallel=false")
    assert not plan.loss_parallel


def test_selective_with_every_n_is_refused_naming_full():
    from parallel.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        _plan("+parallel=fsdp", "mesh=[2]", "parallel.activation_checkpointing=selective",
              "parallel.activation_checkpointing_every=2")
    (issue,) = err.value.issues
    assert issue.path == "parallel.activation_checkpointing_every"
    assert issue.fix == "parallel.activation_checkpointing=full"
    cfg, plan = _plan("+parallel=fsdp", "mesh=[2]", "parallel.activation_checkpointing=full",
                      "parallel.activation_checkpointing_every=2")
    assert plan.activation_checkpointing == "full" and plan.activation_checkpointing_every == 2


def test_the_memory_pass_splits_a_tied_head_with_its_embedding(tmp_path):
    """A Hugging Face model with tied embeddings (258 tokens, tp [3]): the pass's embedding and head are one
    parameter of 86 rows, and the head's saved log-softmax is a third of the unsplit one's."""
    from tests.hf_assets import write_tied_llama
    from trainer.planner.memory.meta_pass import _local_shapes

    write_tied_llama(tmp_path, vocab_size=258)
    heads = {}
    for lp in ("true", "false"):
        cfg, plan = validate_with_plan(compose_dict(["model=hf", f"model.path={tmp_path}", "data=synthetic",
                                                     "+parallel=tp",
                                                     "mesh=[3]", "dry_run=true", "train.loss_chunk_tokens=0",
                                                     f"parallel.tensor_parallel.loss_parallel={lp}"]))
        model = build_model(cfg.model, device="meta")
        _local_shapes(model, plan)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert model.lm_head.weight.shape[0] == (86 if lp == "true" else 258)
        heads[lp] = saved_activations(cfg, plan, cfg.micro_batch_size)["units"]["lm_head"]
    tokens = cfg.micro_batch_size * cfg.train.seq_len
    assert heads["false"] - heads["true"] == pytest.approx(tokens * (258 - 86) * 4, rel=1e-6)
