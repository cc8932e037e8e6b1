"""A Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

The module tree is part of the config contract: placements and pipeline boundaries name
parameters by FQN (``layers.0.attn.wq.weight``, ``layers.1.mlp.w2.weight``, ``norm.weight``).
Three properties matter to the distribution engine:

* ``layers`` is an ``nn.ModuleDict`` keyed ``"0"``..``"n-1"``, so a pipeline stage can delete
  blocks and keep the FQNs ``layers.<i>``; ``tok_embeddings``, ``norm`` and ``output`` may be
  ``None`` (or deleted) on stages that do not hold them.
* Attention infers its local head counts from the actual projection outputs at run time, so it
  works unchanged when ``wq/wk/wv`` are column-sharded and ``wo`` row-sharded over tp ranks.
* :meth:`Transformer.init_weights` gives every parameter a value that depends only on
  ``(seed, FQN, shape)`` (see :mod:`trainer.models.init`), and recomputes the rotary tables,
  so ``build on meta -> to_empty -> init_weights`` equals a direct build on any stage.

Quick check::

    python -c "from trainer.config import LlamaConfig; from trainer.models import build_model; \
import torch; print(build_model(LlamaConfig(n_layers=2))(torch.zeros(1, 8, dtype=torch.long)).shape)"
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import LlamaConfig
from trainer.models.init import InitKind, canonical_fqn, init_named_parameters


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` over the last dim with a learnable ``weight`` (initialised to ones).

    Subclassed only for a stable type the init rule can recognise and a two-argument constructor.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps=eps, elementwise_affine=True)


def rope_tables(max_seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each ``[max_seq_len, head_dim // 2]`` fp32 on CPU.

    Angles are computed in fp64 so long tables do not lose precision at high positions.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs ``(x[2i], x[2i+1])`` of ``x: [B, T, H, D]`` by the angles at each position.

    ``cos``/``sin`` are ``[T, D // 2]``. This is Meta's Llama convention (pairs, not halves),
    written in real arithmetic so it works for any dtype and under DTensor.
    """
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings.

    Head counts are derived from the projections' output widths at run time (never from the
    config), so a column-sharded ``wq/wk/wv`` simply yields fewer local heads.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.max_seq_len = cfg.max_seq_len
        self.rope_theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.num_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.num_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        # Non-persistent: derived from the config, so kept out of checkpoints; allocated on the
        # ambient device (meta included) and filled by reset_rope().
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, self.head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, self.head_dim // 2), persistent=False)
        self.reset_rope()

    def reset_rope(self) -> None:
        """(Re)compute the rotary tables in place, e.g. after ``to_empty()`` from meta."""
        cos, sin = rope_tables(self.max_seq_len, self.head_dim, self.rope_theta)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        if seqlen > self.max_seq_len:
            raise ValueError(f"sequence length {seqlen} exceeds max_seq_len {self.max_seq_len}")
        # -1: the local head count, whatever share of the heads this rank's weights hold.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        cos, sin = self.rope_cos[:seqlen], self.rope_sin[:seqlen]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Query head i reads kv head i // n_rep; sharding heads contiguously keeps groups whole.
        n_rep = q.shape[2] // k.shape[2]
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=2)
            v = v.repeat_interleave(n_rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: ``h = x + attn(attn_norm(x)); out = h + mlp(mlp_norm(h))``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = FeedForward(cfg.dim, cfg.ffn_hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x))
        return h + self.mlp(self.mlp_norm(h))


class Transformer(nn.Module):
    """The decoder: ``tok_embeddings -> layers.0 .. layers.<n-1> -> norm -> output``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.n_heads:
            raise ValueError(f"model.dim {cfg.dim} is not divisible by model.n_heads {cfg.n_heads}")
        if (cfg.dim // cfg.n_heads) % 2:
            raise ValueError(f"head_dim {cfg.dim // cfg.n_heads} must be even for rotary embeddings")
        if cfg.n_heads % cfg.num_kv_heads:
            raise ValueError(f"model.n_heads {cfg.n_heads} is not divisible by model.n_kv_heads {cfg.num_kv_heads}")
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens [B, T]`` -> logits ``[B, T, vocab]``; on a pipeline stage without
        ``tok_embeddings`` the input is the previous stage's activations ``[B, T, dim]``."""
        # getattr: a stage may have deleted a module rather than set it to None.
        tok_embeddings = getattr(self, "tok_embeddings", None)
        layers = getattr(self, "layers", None)
        norm = getattr(self, "norm", None)
        output = getattr(self, "output", None)
        h = tok_embeddings(tokens) if tok_embeddings is not None else tokens
        for layer in layers.values() if layers is not None else ():
            h = layer(h)
        h = norm(h) if norm is not None else h
        return output(h) if output is not None else h

    def _init_rule(self, fqn: str) -> tuple[InitKind, float]:
        module_name = fqn.rpartition(".")[0]
        module = self.get_submodule(module_name)
        if isinstance(module, nn.RMSNorm):
            return "ones", 0.0
        if isinstance(module, (nn.Linear, nn.Embedding)):
            # Residual-branch output projections are scaled down so the residual stream's
            # variance does not grow with depth (GPT-2 / Llama practice). cfg.n_layers, not
            # len(self.layers): a pipeline stage must use the full model's depth.
            if canonical_fqn(module_name).rsplit(".", 1)[-1] in ("wo", "w2"):
                return "normal", self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
            return "normal", self.cfg.init_std
        raise TypeError(f"no init rule for parameter {fqn!r} of {type(module).__name__}")

    def init_weights(self, seed: int | None = None) -> None:
        """Recompute the rotary tables and set every parameter from ``(seed, FQN, shape)``.

        ``seed=None`` means 0. Works on whatever subset of modules this instance still holds
        and on DTensor parameters; call it after ``to_empty()`` when built on meta.
        """
        for module in self.modules():
            if isinstance(module, Attention):
                module.reset_rope()
        init_named_parameters(self.named_parameters(), 0 if seed is None else seed, self._init_rule)
