"""A mixture of experts in place of a block's MLP (``model.moe``; the built-in ``model=gpt_moe``).

``layers.<i>.mlp`` becomes :class:`MoE`: a :class:`Router` (``router.gate``: logits over the experts,
softmax or sigmoid scores, each token's ``top_k`` best), :class:`GroupedExperts` (``experts.w1``,
``w3``: ``[num_experts, hidden, dim]``, ``w2``: ``[num_experts, dim, hidden]``, stacked so that a
placement can shard dim 0 over an expert-parallel axis) and optional shared experts (``shared``, a
SwiGLU every token goes through). Routing is token choice and dropless: every choice is computed.

The experts' inputs arrive sorted by expert with a count per expert, and the experts compute them
in one grouped matmul (``torch._grouped_mm`` where it exists and works on the device and dtype,
else a loop over the experts): that is the interface the expert-parallel dispatch
(:mod:`parallel.sharding.expert_parallel`) wraps, sending each expert's rows to the rank holding it.

The load-balancing loss is computed **per sequence** and averaged over the batch's sequences
(DeepSeek-V3's sequence-wise balance loss): every statistic it reads belongs to one sequence, and
every layout (data, expert or pipeline micro-batch splits) cuts a batch between whole sequences
into equal parts, so the mean over ranks of their means is one device's value, with no collective.
Context parallelism cuts every sequence instead: a cp rank holds ``1 / cp`` of each row's tokens, so
the block (which declares ``context_parallel``, set to the cp group's :class:`ContextShard` by
:func:`parallel.context.apply_context_parallel`, as the attention is) sums each row's choice counts
and score sums over the cp ranks (:func:`parallel.context.sum_over_context`, the sums with their
gradient) and every cp rank holds the whole rows' balance loss.

    python -m pytest tests/unit/test_moe.py -q
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from parallel.context import ContextShard, sum_over_context
from trainer.config.schema import MoEConfig
from trainer.models.layers import swiglu


class Router(nn.Module):
    """Scores of every token against every expert: ``gate`` (a Linear without bias) gives the
    logits, ``score_func`` the scores (in fp32), and each token keeps its ``top_k`` best."""

    def __init__(self, dim: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(dim, cfg.num_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [N, dim]`` -> ``(probs [N, E], experts [N, k], weights [N, k])``: ``probs`` the scores
        normalised to sum to 1 per token (for the balance loss), ``experts`` the chosen ids, best
        first, ``weights`` their scores (rescaled to sum to 1 with ``norm_topk_prob``)."""
        logits = self.gate(x).float()
        scores = logits.softmax(dim=-1) if self.cfg.score_func == "softmax" else logits.sigmoid()
        weights, experts = scores.topk(self.cfg.top_k, dim=-1)
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        probs = scores if self.cfg.score_func == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        return probs, experts, weights


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU MLPs as three stacked weights, each expert's like ``nn.Linear``'s
    (``[out, in]``). ``forward(x, counts)`` takes rows sorted by expert, ``counts[e]`` of them for
    expert ``e``. Sharded over an expert-parallel axis, the parameters are DTensors ``Shard(0)``
    and this rank computes its own experts (``counts`` then covers those only)."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        if w1.shape[0] != counts.shape[0]:
            raise ValueError(f"{counts.shape[0]} expert counts for {w1.shape[0]} experts held here")
        hidden = swiglu(grouped_mm(x, w1, counts), grouped_mm(x, w3, counts))
        return grouped_mm(hidden, w2, counts)


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts: an expert-parallel DTensor's local shard (its gradient flows back to
    the DTensor), a plain tensor as it is."""
    to_local = getattr(weight, "to_local", None)
    return to_local() if to_local is not None else weight


def grouped_mm(x: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor, *,
               grouped: bool | None = None) -> torch.Tensor:
    """Rows of ``x [M, in]`` sorted by expert, ``counts[e]`` rows for expert ``e``, each times its
    expert's ``weights[e].T`` (``weights [E, out, in]``) -> ``[M, out]``. ``grouped``: force
    ``torch._grouped_mm`` (True) or the loop (False); None = the grouped kernel where it works for
    this device, dtype and shape (:func:`grouped_mm_works`) and autocast is off, else the loop."""
    if grouped is None:
        grouped = (x.device.type != "meta" and not torch.is_autocast_enabled(x.device.type) and x.dtype == weights.dtype
                   and grouped_mm_works(x.device.type, x.dtype, weights.shape[2], weights.shape[1]))
    if grouped:
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        # contiguous: the CPU kernel's backward refuses a broadcast (stride-0) output gradient.
        return _ContiguousGrad.apply(torch._grouped_mm(x, weights.transpose(-2, -1), offs=offsets))
    pieces = x.split(counts.tolist())
    return torch.cat([piece @ weights[e].T for e, piece in enumerate(pieces)])


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ARG004 - autograd's signature
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return grad.contiguous()


@functools.cache
def grouped_mm_works(device_type: str, dtype: torch.dtype, in_dim: int, out_dim: int) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward for these weights on this device and
    dtype and agrees with a plain matmul (probed once on a tiny problem: CPU kernels exist from torch
    2.9 and want 16-byte-aligned rows; CUDA's want bf16 on recent GPUs)."""
    if device_type == "meta" or not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.randn(3, in_dim, device=device_type, dtype=dtype, requires_grad=True)
        w = torch.randn(2, out_dim, in_dim, device=device_type, dtype=dtype, requires_grad=True)
        counts = torch.tensor([1, 2], device=device_type)
        y = grouped_mm(x, w, counts, grouped=True)
        y.sum().backward()
        want = grouped_mm(x.detach(), w.detach(), counts, grouped=False)
        return bool(torch.allclose(y.detach().float(), want.float(), rtol=2e-2, atol=2e-2)) and w.grad is not None
    except (RuntimeError, NotImplementedError, TypeError):
        return False


class MoE(nn.Module):
    """Router, routed experts, optional shared experts. ``forward(x [B, T, dim])`` also leaves this
    call's balance loss in ``aux_loss`` (a scalar with its graph), which the training loss adds
    (:class:`WithAuxLoss`), and its rows per expert in ``tokens_per_expert`` (this rank's tokens'
    choices, before any dispatch)."""

    def __init__(self, dim: int, hidden_dim: int, cfg: MoEConfig, shared: nn.Module | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = Router(dim, cfg)
        self.experts = GroupedExperts(cfg.num_experts, dim, cfg.hidden_dim or hidden_dim)
        self.shared = shared
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        # Set by parallel.context.apply_context_parallel when each sequence is split over cp ranks: the
        # balance loss then sums its per-sequence statistics over them.
        self.context_parallel: ContextShard | None = None

    def last_forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(aux_loss, tokens_per_expert)`` of the last forward."""
        if self.aux_loss is None or self.tokens_per_expert is None:
            raise RuntimeError("an MoE block's balance loss is read before the block ran forward")
        return self.aux_loss, self.tokens_per_expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, dim = x.shape
        flat = x.reshape(-1, dim)
        probs, experts, weights = self.router(flat)
        self.aux_loss = balance_loss(probs.view(bsz, seqlen, -1), experts.view(bsz, seqlen, -1),
                                     context=self.context_parallel)
        choices = experts.flatten()
        # Stable: an expert's rows keep token order, so one device and every layout see the same order.
        order = choices.argsort(stable=True)
        counts = _balanced_counts(choices.numel(), self.cfg.num_experts) if choices.is_meta \
            else torch.bincount(choices, minlength=self.cfg.num_experts)
        self.tokens_per_expert = counts.detach()
        out_sorted = self.experts(flat[order // self.cfg.top_k], counts)
        # Back to (token, choice) order: each token sums its choices in one fixed order on every layout.
        out = out_sorted[order.argsort()]
        out = (out.view(-1, self.cfg.top_k, dim) * weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view(bsz, seqlen, dim)


def _balanced_counts(rows: int, num_experts: int) -> torch.Tensor:
    """Rows per expert when ``rows`` choices spread evenly: the shapes a planner's pass on the meta
    device (which has no values to route by) gives the experts."""
    counts = torch.full((num_experts,), rows // num_experts)
    counts[: rows % num_experts] += 1
    return counts


def balance_loss(probs: torch.Tensor, experts: torch.Tensor, *, context: ContextShard | None = None) -> torch.Tensor:
    """The sequence-wise load-balancing loss: ``probs [B, T, E]`` (normalised scores), ``experts
    [B, T, k]`` (the choices). Per sequence, ``E * sum_e f_e * P_e`` with ``f_e`` the share of its
    ``T * k`` choices that went to ``e`` (no gradient) and ``P_e`` the mean score of ``e`` over its
    tokens; the mean over sequences. 1 when every sequence spreads its choices and scores evenly.

    ``context``: the rows are this cp rank's ``T`` tokens of sequences of ``T * cp``; the statistics are
    summed over the cp ranks first (a collective), so every cp rank returns the whole sequences' loss."""
    counts, score_sums = sequence_statistics(probs, experts)
    seqlen = probs.shape[1]
    if context is not None and context.size > 1:
        counts, score_sums = sum_over_context(counts, context), sum_over_context(score_sums, context)
        seqlen *= context.size
    return balance_from_statistics(counts, score_sums, seq_len=seqlen, top_k=experts.shape[-1])


def sequence_statistics(probs: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`balance_loss` reads of each sequence, as sums over its tokens (so the shares of a split
    sequence add up): ``(counts [B, E]`` its choices per expert, no gradient; ``score_sums [B, E])`` its
    tokens' scores summed per expert."""
    bsz, _, num_experts = probs.shape
    chosen = experts.reshape(bsz, -1)
    counts = torch.zeros(bsz, num_experts, dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(1, chosen, torch.ones_like(chosen, dtype=probs.dtype))
    return counts, probs.sum(dim=1)


def balance_from_statistics(counts: torch.Tensor, score_sums: torch.Tensor, *, seq_len: int,
                            top_k: int) -> torch.Tensor:
    """The balance loss of sequences of ``seq_len`` tokens, ``top_k`` choices each, from their
    :func:`sequence_statistics` (whole sequences' sums)."""
    num_experts = counts.shape[-1]
    share = counts / (seq_len * top_k)
    return (num_experts * (share * (score_sums / seq_len)).sum(dim=-1)).mean()


def expert_parameter_count(model: nn.Module) -> tuple[int, int]:
    """``(routed expert parameters, of which each token uses)`` over the model's MoE blocks (0, 0 without
    any): a token goes through ``top_k`` of each block's ``num_experts`` experts."""
    total = active = 0
    for module in model.modules():
        if isinstance(module, MoE):
            n = sum(p.numel() for p in module.experts.parameters())
            total += n
            active += n * module.cfg.top_k // module.cfg.num_experts
    return total, active


class WithAuxLoss:
    """The training loss of an MoE model: ``loss(output, targets) + aux_loss_weight * aux``, ``aux``
    the mean of the balance losses its MoE blocks left in this forward (:class:`MoE`) over the model's
    ``num_blocks`` blocks; ``base`` is the loss without it (evaluation).

    The blocks are those of ``model_parts`` (this rank's parts), whose forward ran just before the
    loss. On a pipeline (``pipelined``) the loss is ``base`` alone, on the last stage, and each stage's
    blocks add their share through :meth:`stage_term`, which the engine calls after every stage
    forward and whose gradient flows on that stage (:mod:`parallel.pipeline.stage_terms`).

    :meth:`take` gives the figures of the forwards since the last call and starts afresh: this rank's
    share of the balance loss (detached, unweighted; the mean over ranks of the ranks' shares summed over
    stages is one device's value) and of the rows each expert got, per block.
    """

    def __init__(self, base, model_parts: list[nn.Module], weight: float, *, num_blocks: int | None = None,
                 pipelined: bool = False) -> None:
        self.base, self.weight, self.pipelined = base, weight, pipelined
        self.blocks = [m for part in model_parts for m in part.modules() if isinstance(m, MoE)]
        self.num_blocks = num_blocks or len(self.blocks)
        # Parts holding blocks: each runs once per micro-batch, so their forwards count the micro-batches.
        self._parts = sum(any(isinstance(m, MoE) for m in part.modules()) for part in model_parts)
        self._aux_sum: torch.Tensor | None = None  # the blocks' balance losses, summed over blocks and forwards
        self._load_sum: torch.Tensor | None = None
        self._forwards = 0

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.base(output, targets)
        if self.pipelined:
            return loss
        if not self.blocks:
            raise ValueError("no MoE block ran on this rank: its parts hold none")
        aux = self._record(self.blocks) / self.num_blocks
        return loss + self.weight * aux if self.weight else loss

    def stage_term(self, part: nn.Module) -> torch.Tensor | None:
        """The weighted balance loss of ``part``'s blocks after its forward (a pipeline stage's share of the
        objective's term), or ``None`` when it holds none."""
        blocks = [m for m in part.modules() if isinstance(m, MoE)]
        if not blocks:
            return None
        return self.weight * self._record(blocks) / self.num_blocks

    def _record(self, blocks: list[MoE]) -> torch.Tensor:
        """The sum of ``blocks``' balance losses (with its graph), its value and their loads kept for :meth:`take`."""
        recorded = [block.last_forward() for block in blocks]
        aux = torch.stack([block_aux for block_aux, _ in recorded]).sum()
        load = torch.stack([block_load for _, block_load in recorded]).double().sum(dim=0)
        self._aux_sum = aux.detach() if self._aux_sum is None else self._aux_sum + aux.detach()
        self._load_sum = load if self._load_sum is None else self._load_sum + load
        self._forwards += 1
        return aux

    @property
    def aux(self) -> torch.Tensor | None:
        """This rank's share of the balance loss over the forwards since :meth:`take` (their mean over
        micro-batches)."""
        if self._aux_sum is None:
            return None
        return self._aux_sum / (self.num_blocks * self._microbatches)

    @property
    def _microbatches(self) -> int:
        return max(1, self._forwards // max(1, self._parts))

    def take(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(aux, load)`` since the last call, then cleared: this rank's share of the balance loss (0 for a
        rank whose stages hold no block) and of the rows per expert, per block (``None`` without blocks)."""
        aux = self.aux
        if aux is None:
            aux = torch.zeros((), dtype=torch.float64)
        load = None if self._load_sum is None else self._load_sum / self.num_blocks
        self._aux_sum = self._load_sum = None
        self._forwards = 0
        return aux, load


def with_aux_loss(loss_fn, model_parts: list[nn.Module], model_cfg, *, pipelined: bool = False) -> object:
    """``loss_fn`` with the model's balance loss added when it has MoE blocks (one per layer), else ``loss_fn``.
    ``pipelined``: the parts are pipeline stages, whose terms reach the objective through ``stage_term``."""
    moe = getattr(model_cfg, "moe", None)
    if moe is None:
        return loss_fn
    return WithAuxLoss(loss_fn, model_parts, moe.aux_loss_weight, num_blocks=model_cfg.n_layers, pipelined=pipelined)
