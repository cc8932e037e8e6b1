"""The mixture-of-experts block on one process: the grouped matmul (``torch._grouped_mm`` and the loop)
equals a plain per-expert loop, forward and backward; the block equals a token-by-token reference;
the balance loss is 1 when balanced and is the mean of its sequences' (so any split of a batch
between whole sequences averages back to it), and the per-sequence statistics of a sequence's cp shares
summed give its loss and gradient; the aux loss joins the training loss with its weight.

    python -m pytest tests/unit/test_moe.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.config.compose import compose_dict
from trainer.config.schema import LlamaConfig, MoEConfig
from trainer.models import build_model, count_parameters, lm_loss
from parallel.pipeline.stage_terms import carry_term
from parallel.context import shard_sequence
from trainer.models.moe import (MoE, balance_from_statistics, balance_loss, expert_parameter_count, grouped_mm,
                                grouped_mm_works, sequence_statistics, with_aux_loss)

GROUPED = pytest.mark.skipif(not grouped_mm_works("cpu", torch.float32, 16, 8),
                             reason="torch._grouped_mm does not run on this CPU build")


def _per_expert(x: torch.Tensor, weights: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The reference: each expert's rows, one plain matmul per expert, written out."""
    rows, start = [], 0
    for e, n in enumerate(counts):
        rows.append(x[start:start + n] @ weights[e].T)
        start += n
    return torch.cat(rows)


@pytest.mark.parametrize("grouped", [pytest.param(True, marks=GROUPED), False])
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 10, 0], [0, 0, 0, 0]])
def test_grouped_mm_equals_a_plain_loop_over_experts(grouped, counts):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 16, generator=g, requires_grad=True)
    w = torch.randn(4, 8, 16, generator=g, requires_grad=True)
    out_grad = torch.randn(sum(counts), 8, generator=g)
    got = grouped_mm(x, w, torch.tensor(counts), grouped=grouped)
    got.backward(out_grad)
    got_x, got_w = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    want = _per_expert(x, w, counts)
    want.backward(out_grad)
    assert got.shape == want.shape == (sum(counts), 8)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_x, x.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_w, w.grad, rtol=1e-6, atol=1e-6)


@GROUPED
def test_grouped_mm_takes_a_broadcast_output_gradient():
    x, w = torch.randn(6, 16, requires_grad=True), torch.randn(2, 8, 16, requires_grad=True)
    grouped_mm(x, w, torch.tensor([2, 4]), grouped=True).sum().backward()  # sum's gradient has stride 0
    torch.testing.assert_close(w.grad[0], x[:2].detach().sum(0).expand(8, 16))


def _block(**moe) -> MoE:
    cfg = LlamaConfig(moe=MoEConfig(num_experts=4, top_k=2, hidden_dim=12, **moe))
    model = build_model(cfg.model_copy(update={"n_layers": 1}), seed=3)
    return model.layers["0"].mlp


def _token_by_token(block: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every token through its chosen experts one by one: sum_k weight_k * SwiGLU_e(x)."""
    w1, w2, w3 = block.experts.w1, block.experts.w2, block.experts.w3
    out = []
    for token in x.reshape(-1, x.shape[-1]):
        logits = block.router.gate.weight @ token
        scores = logits.softmax(-1) if block.cfg.score_func == "softmax" else logits.sigmoid()
        top, ids = scores.topk(block.cfg.top_k)
        if block.cfg.norm_topk_prob:
            top = top / top.sum()
        y = sum(t * (w2[e] @ (F.silu(w1[e] @ token) * (w3[e] @ token))) for t, e in zip(top, ids.tolist()))
        out.append(y + (block.shared(token) if block.shared is not None else 0))
    return torch.stack(out).view_as(x)


@pytest.mark.parametrize("moe", [{}, {"score_func": "sigmoid"}, {"norm_topk_prob": False}, {"num_shared_experts": 1}],
                         ids=["softmax", "sigmoid", "raw-scores", "shared"])
def test_the_block_equals_each_token_through_its_experts(moe):
    block = _block(**moe)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(block(x), _token_by_token(block, x), rtol=1e-5, atol=1e-6)
    assert block.aux_loss.requires_grad and block.aux_loss.ndim == 0


def test_grouped_and_loop_blocks_train_alike(monkeypatch):
    """The whole block's gradients with the grouped kernel and with the loop (where the kernel runs)."""
    block = _block()
    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(2))
    grads = []
    for grouped in (True, False):
        monkeypatch.setattr("trainer.models.moe.grouped_mm_works", lambda *_: grouped)
        block.zero_grad()
        (block(x).square().sum() + block.aux_loss).backward()
        grads.append({n: p.grad.clone() for n, p in block.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-7)


def test_balance_loss_is_one_when_balanced_and_the_mean_of_its_sequences():
    # Two sequences of 2 tokens, 4 experts, top 2: every expert chosen once per sequence, uniform scores.
    probs = torch.full((2, 2, 4), 0.25)
    experts = torch.tensor([[[0, 1], [2, 3]], [[3, 2], [1, 0]]])
    assert float(balance_loss(probs, experts)) == pytest.approx(1.0)
    # All choices on expert 0, which has all the score: the worst case, num_experts.
    skewed = torch.zeros(1, 2, 4)
    skewed[..., 0] = 1.0
    assert float(balance_loss(skewed, torch.zeros(1, 2, 1, dtype=torch.long))) == pytest.approx(4.0)
    # Any split between whole sequences averages back: the loss layouts of data and experts compute.
    g = torch.Generator().manual_seed(4)
    probs = torch.rand(8, 6, 4, generator=g).softmax(-1)
    experts = torch.rand(8, 6, 4, generator=g).argsort(-1)[..., :2]
    halves = [balance_loss(p, e) for p, e in zip(probs.chunk(4), experts.chunk(4))]
    torch.testing.assert_close(balance_loss(probs, experts), torch.stack(halves).mean())


@pytest.mark.parametrize("cp", [2, 4])
def test_the_cp_ranks_statistics_summed_give_the_whole_sequences_balance_loss(cp):
    """What a cp rank computes before the all-reduce: its head and tail chunks' choice counts and score sums; summed
    over the ranks and divided by the whole length, the loss and its gradient are one device's."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 8 * cp, 6, generator=g, requires_grad=True)
    experts = torch.rand(3, 8 * cp, 6, generator=g).argsort(-1)[..., :2]
    whole = balance_loss(logits.softmax(-1), experts)
    (want,) = torch.autograd.grad(whole, logits)
    shares = [sequence_statistics(shard_sequence(logits.softmax(-1), dim=1, cp_rank=r, cp_size=cp),
                                  shard_sequence(experts, dim=1, cp_rank=r, cp_size=cp)) for r in range(cp)]
    counts, score_sums = (torch.stack(s).sum(dim=0) for s in zip(*shares))
    split = balance_from_statistics(counts, score_sums, seq_len=8 * cp, top_k=2)
    (got,) = torch.autograd.grad(split, logits)
    torch.testing.assert_close(split, whole, rtol=1e-6, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)
    assert 0.5 < float(whole) < 2.0 and not counts.requires_grad and float(counts.sum()) == 3 * 8 * cp * 2
    # One rank's statistics alone (as if the sum were skipped) give another loss: the sum is what makes it whole.
    alone = balance_from_statistics(*shares[0], seq_len=8, top_k=2)
    assert abs(float(alone) - float(whole)) > 1e-3


def test_aux_loss_joins_the_training_loss_with_its_weight():
    cfg = LlamaConfig(**compose_dict(["model=gpt_moe"])["model"])
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    loss_fn = with_aux_loss(lm_loss, [model], cfg)
    logits = model(tokens[:, :-1])
    total = loss_fn(logits, tokens[:, 1:])
    aux = torch.stack([model.layers[str(i)].mlp.aux_loss for i in range(cfg.n_layers)]).mean().detach()
    torch.testing.assert_close(total, lm_loss(logits, tokens[:, 1:]) + cfg.moe.aux_loss_weight * aux)
    assert float(loss_fn.aux) == pytest.approx(float(aux)) and 1.0 <= float(aux) < 2.0
    assert with_aux_loss(lm_loss, [model], LlamaConfig()) is lm_loss  # a dense model: the loss as it was


def test_a_pipelined_stage_adds_its_blocks_balance_loss_through_its_output():
    """On a pipeline the loss is the language model's alone, and each stage's output carries its blocks'
    weighted balance loss (parallel.pipeline.stage_terms): the gradients are the one-device loss's, and
    take() gives the balance loss over the micro-batches (two here, of one sequence each)."""
    cfg = LlamaConfig(**compose_dict(["model=gpt_moe", "model.moe.aux_loss_weight=0.5"])["model"])
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    alone = with_aux_loss(lm_loss, [model], cfg)
    alone(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    aux, _ = alone.take()
    model.zero_grad()
    staged = with_aux_loss(lm_loss, [model], cfg, pipelined=True)
    for row in range(2):  # two micro-batches, each scaled by 1 / 2 as the engine does
        out = carry_term(model(tokens[row:row + 1, :-1]), staged.stage_term(model), 0.5)
        (staged(out, tokens[row:row + 1, 1:]) * 0.5).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)
    assert expected["layers.0.mlp.router.gate.weight"].abs().sum() > 0
    staged_aux, load = staged.take()
    torch.testing.assert_close(staged_aux, aux)
    assert float(load.sum()) == 2 * 8 * cfg.moe.top_k and staged.take()[1] is None  # every row's choices; then cleared


def test_gpt_moe_counts_total_and_active_parameters_and_initialises_like_one_device():
    cfg = LlamaConfig(**compose_dict(["model=gpt_moe"])["model"])
    model = build_model(cfg, seed=0)
    experts, active = expert_parameter_count(model)
    assert experts == cfg.n_layers * cfg.moe.num_experts * 3 * cfg.dim * cfg.moe.hidden_dim
    assert active == experts * cfg.moe.top_k // cfg.moe.num_experts
    assert count_parameters(model) > experts
    skeleton = build_model(cfg, device="meta")
    skeleton.to_empty(device="cpu")
    skeleton.init_weights(0)
    for (name, p), (_, q) in zip(model.named_parameters(), skeleton.named_parameters()):
        assert torch.equal(p, q), name
    w2, w1 = model.layers["0"].mlp.experts.w2, model.layers["0"].mlp.experts.w1
    # the residual projection is scaled down, as a dense down projection
    assert float(w2.detach().std()) < float(w1.detach().std())


class _Metrics:
    """A tracker that keeps the metrics the loop logs (the rest: a NullTracker's nothing)."""

    def __init__(self) -> None:
        from trainer.tracking.tracker import NullTracker

        self.null, self.logged = NullTracker(), {}

    def log_metrics(self, metrics, step: int) -> None:
        self.logged[step] = dict(metrics)

    def __getattr__(self, name: str):
        return getattr(self.null, name)


def test_the_loop_trains_on_the_balance_loss_and_logs_it(tmp_path):
    """The training loop's steps: ``loss`` is the language-model loss plus the weighted balance loss, and
    ``aux_loss`` (unweighted) is a metric of its own; evaluation reports the language-model loss alone."""
    from trainer.config.schema import RunConfig
    from trainer.run.loop import train
    from trainer.run.metrics import NullProgress

    cfg = RunConfig.model_validate(compose_dict([
        "model=gpt_moe", "model.n_layers=1", "data=synthetic", "train.steps=2", "train.log_every=1", "tracking=none",
        "train.seq_len=16", "train.global_batch_size=2", "train.checkpoint.save_final=false", "tracking.pictures=false",
        f"train.checkpoint.dir={tmp_path}"]))
    tracker = _Metrics()
    result = train(cfg, tracker=tracker, progress=NullProgress())
    assert len(result.aux_losses) == 2 and all(1.0 <= a < 2.0 for a in result.aux_losses)
    assert [tracker.logged[s]["aux_loss"] for s in (1, 2)] == result.aux_losses
    assert [tracker.logged[s]["loss"] for s in (1, 2)] == result.losses
    # Rows per expert: 2 sequences x 16 tokens x top 2 spread over 8 experts, so a mean of 8 per expert.
    for step in (1, 2):
        low, high, ratio = (tracker.logged[step][k] for k in ("tokens_per_expert_min", "tokens_per_expert_max",
                                                              "expert_imbalance"))
        assert 0 <= low <= 8 <= high <= 64 and ratio == pytest.approx(high / 8)


def test_export_to_hugging_face_refuses_the_moe_model_rather_than_drop_its_experts(tmp_path):
    from trainer.export.hf import export_hf

    cfg = LlamaConfig(**compose_dict(["model=gpt_moe"])["model"])
    with pytest.raises(ValueError, match="no Hugging Face layout here yet"):
        export_hf(build_model(cfg, device="meta").state_dict(), cfg, tmp_path)
