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
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallel.context import ContextShard, context_attention
from trainer.config.schema import LlamaConfig, LoRAConfig
from trainer.models.init import InitKind, canonical_fqn, init_named_parameters
from trainer.models.layers import RMSNorm, apply_rope, document_mask, rope_tables, swiglu
from trainer.models.lora import adapter_init, apply_lora
from trainer.models.moe import GroupedExperts, MoE


class Names(NamedTuple):
    """The module names of one parameter-name layout; the math is the same for every layout."""

    q: str
    k: str
    v: str
    o: str
    gate: str
    up: str
    down: str
    attn_norm: str
    attn: str
    mlp_norm: str
    mlp: str
    rope: Literal["pairs", "halves"]  # which dimensions a rotation pairs: (2i, 2i+1) or (i, i + D/2)


# Meta's original Llama layout (the built-in models) and Hugging Face's (LlamaForCausalLM and kin).
MESHFLOW_NAMES = Names("wq", "wk", "wv", "wo", "w1", "w3", "w2", "attn_norm", "attn", "mlp_norm", "mlp", "pairs")
HF_NAMES = Names("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "input_layernorm",
                 "self_attn", "post_attention_layernorm", "mlp", "halves")


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings.

    Head counts are derived from the projections' output widths at run time (never from the
    config), so a column-sharded ``wq/wk/wv`` simply yields fewer local heads.
    """

    rope_cos: torch.Tensor  # buffers (register_buffer in __init__)
    rope_sin: torch.Tensor

    def __init__(self, cfg: LlamaConfig, names: Names = MESHFLOW_NAMES) -> None:
        super().__init__()
        self.head_dim = cfg.head_width
        self.max_seq_len = cfg.max_seq_len
        self.rope_theta = cfg.rope_theta
        self.rope_scaling = cfg.rope_scaling
        self._names = names
        for name, heads in ((names.q, cfg.n_heads), (names.k, cfg.num_kv_heads), (names.v, cfg.num_kv_heads)):
            self.add_module(name, nn.Linear(cfg.dim, heads * self.head_dim, bias=cfg.qkv_bias))
        self.add_module(names.o, nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False))
        # Qwen3: each head's query and key are RMS-normalised (one weight of head_dim, shared by the heads).
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        # Applied to each head: with the heads split over tp, each rank's gradient is its heads' share
        # (parallel.sharding.head_params sums them).
        self.head_parameters = ("q_norm.weight", "k_norm.weight") if cfg.qk_norm else ()
        # Set by parallel.context.apply_context_parallel when each sequence is split over cp ranks: this
        # rank then holds some of every row's tokens and attends over all of them (exactly).
        self.context_parallel: ContextShard | None = None
        # Set by parallel.sharding.activation_checkpointing (`selective`): the scaled-dot-product attention
        # keeps only its inputs and runs again in backward (Megatron-LM's selective recomputation).
        self.recompute_attention_core = False
        # Non-persistent: derived from the config, so kept out of checkpoints; allocated on the
        # ambient device (meta included) and filled by reset_rope().
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, self.head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, self.head_dim // 2), persistent=False)
        self.reset_rope()

    def reset_rope(self) -> None:
        """(Re)compute the rotary tables in place, e.g. after ``to_empty()`` from meta."""
        cos, sin = rope_tables(self.max_seq_len, self.head_dim, self.rope_theta, self.rope_scaling)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions [B, T]`` (packed documents): rotary angles at each token's own position, and
        attention within its document only (:func:`document_mask`); ``None``: ``0 .. T-1``, causal.
        Under context parallelism ``x`` holds this rank's tokens of each row (:mod:`parallel.context`):
        rotary angles and the mask follow each token's true position in the row."""
        n = self._names
        # The projections' outputs give this rank's sizes: -1 below its share of the heads, and bsz its batch
        # rows (2-D tensor parallelism splits them over a grid axis: parallel.sharding.tp_grid).
        q, k, v = (getattr(self, name)(x) for name in (n.q, n.k, n.v))
        bsz, seqlen = q.shape[0], q.shape[1]
        cp = self.context_parallel
        index = cp.token_index(seqlen, device=x.device) if cp is not None else None  # true positions in the row
        if seqlen * (cp.size if cp is not None else 1) > self.max_seq_len:
            raise ValueError(f"sequence length {seqlen * (cp.size if cp else 1)} exceeds max_seq_len "
                             f"{self.max_seq_len}")
        q, k, v = (t.view(bsz, seqlen, -1, self.head_dim) for t in (q, k, v))
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (model.qk_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        if positions is not None:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        elif index is not None:
            cos, sin = self.rope_cos[index], self.rope_sin[index]
        else:
            cos, sin = self.rope_cos[:seqlen], self.rope_sin[:seqlen]
        q, k = apply_rope(q, cos, sin, n.rope), apply_rope(k, cos, sin, n.rope)
        if cp is not None and index is not None:  # K/V travel with their kv heads; a document: where it starts
            doc = index - positions if positions is not None else None
            out = context_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), shard=cp, q_index=index,
                                    doc=doc)
            return getattr(self, n.o)(out.transpose(1, 2).reshape(bsz, seqlen, -1))
        # Query head i reads kv head i // n_rep (sharding heads contiguously keeps groups whole): the kernel
        # reads the kv heads in place (enable_gqa), so K and V are kept for backward at their own width.
        gqa = q.shape[2] != k.shape[2]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        mask = None if positions is None else document_mask(positions)
        if self.recompute_attention_core:
            out = checkpoint(F.scaled_dot_product_attention, q, k, v, attn_mask=mask, is_causal=mask is None,
                             enable_gqa=gqa, use_reentrant=False)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
        return getattr(self, n.o)(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)`` (``down(silu(gate x) * up x)`` in Hugging Face's names)."""

    def __init__(self, dim: int, hidden_dim: int, names: Names = MESHFLOW_NAMES) -> None:
        super().__init__()
        self._names = names
        self.add_module(names.gate, nn.Linear(dim, hidden_dim, bias=False))
        self.add_module(names.up, nn.Linear(dim, hidden_dim, bias=False))
        self.add_module(names.down, nn.Linear(hidden_dim, dim, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self._names
        return getattr(self, n.down)(swiglu(getattr(self, n.gate)(x), getattr(self, n.up)(x)))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: ``h = x + attn(attn_norm(x)); out = h + mlp(mlp_norm(h))``."""

    def __init__(self, cfg: LlamaConfig, names: Names = MESHFLOW_NAMES) -> None:
        super().__init__()
        self._names = names
        self.add_module(names.attn_norm, RMSNorm(cfg.dim, cfg.norm_eps))
        self.add_module(names.attn, Attention(cfg, names))
        self.add_module(names.mlp_norm, RMSNorm(cfg.dim, cfg.norm_eps))
        if cfg.moe is None:
            self.add_module(names.mlp, FeedForward(cfg.dim, cfg.ffn_hidden_dim, names))
        else:
            hidden = cfg.moe.hidden_dim or cfg.ffn_hidden_dim
            shared = FeedForward(cfg.dim, hidden * cfg.moe.num_shared_experts,
                                 names) if cfg.moe.num_shared_experts else None
            self.add_module(names.mlp, MoE(cfg.dim, cfg.ffn_hidden_dim, cfg.moe, shared=shared))

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        n = self._names
        # positions by keyword: tensor-parallel input styles prepare the positional inputs only.
        h = x + getattr(self, n.attn)(getattr(self, n.attn_norm)(x), positions=positions)
        return h + getattr(self, n.mlp)(getattr(self, n.mlp_norm)(h))


class DecoderBody(nn.Module):
    """Hugging Face's ``model`` level (``embed_tokens``, ``layers``, ``norm``): only a namespace,
    so parameter names match ``LlamaForCausalLM``'s; :class:`Transformer` runs the pieces."""


class Transformer(nn.Module):
    """The decoder: ``tok_embeddings -> layers.0 .. layers.<n-1> -> norm -> output``.

    ``layout="hf"`` names the same pieces as Hugging Face's ``LlamaForCausalLM``
    (``model.embed_tokens``, ``model.layers.<i>.self_attn.q_proj``, ..., ``lm_head``) and rotates
    halves, so its state dict is a Llama-family checkpoint's, key for key and value for value.
    ``lora`` (default: ``cfg.lora``) with a rank gives the targeted projections adapters and freezes
    the rest (:mod:`trainer.models.lora`).
    """

    def __init__(self, cfg: LlamaConfig, *, layout: Literal["meshflow", "hf"] = "meshflow",
                 tie_embeddings: bool = False, lora: LoRAConfig | None = None) -> None:
        super().__init__()
        if cfg.head_dim is None and cfg.dim % cfg.n_heads:
            raise ValueError(f"model.dim {cfg.dim} is not divisible by model.n_heads {cfg.n_heads}")
        if cfg.head_width % 2:
            raise ValueError(f"head_dim {cfg.head_width} must be even for rotary embeddings")
        if cfg.n_heads % cfg.num_kv_heads:
            raise ValueError(f"model.n_heads {cfg.n_heads} is not divisible by model.n_kv_heads {cfg.num_kv_heads}")
        self.cfg = cfg
        self.names = MESHFLOW_NAMES if layout == "meshflow" else HF_NAMES
        embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        layers = nn.ModuleDict({str(i): TransformerBlock(cfg, self.names) for i in range(cfg.n_layers)})
        norm = RMSNorm(cfg.dim, cfg.norm_eps)
        head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if tie_embeddings:
            head.weight = embed.weight
        if layout == "meshflow":
            self.tok_embeddings, self.layers, self.norm, self.output = embed, layers, norm, head
            self.pieces = ("tok_embeddings", "layers", "norm", "output")
        else:
            self.model = DecoderBody()
            self.model.embed_tokens, self.model.layers, self.model.norm = embed, layers, norm
            self.lm_head = head
            self.pieces = ("model.embed_tokens", "model.layers", "model.norm", "lm_head")
        lora = lora if lora is not None else cfg.lora
        if lora.enabled:
            apply_lora(self, lora, default_targets=self.lora_targets())

    def lora_targets(self) -> list[str]:
        """The default LoRA targets: every attention and MLP projection of every block."""
        n, blocks = self.names, self.pieces[1] + ".*"
        return ([f"{blocks}.{n.attn}.{p}" for p in (n.q, n.k, n.v, n.o)]
                + [f"{blocks}.{n.mlp}.{p}" for p in (n.gate, n.up, n.down)])

    def _piece(self, path: str) -> nn.Module | None:
        # A pipeline stage may have set a piece to None or deleted it.
        node: nn.Module | None = self
        for part in path.split("."):
            node = getattr(node, part, None)
            if node is None:
                return None
        return node

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens [B, T]`` -> logits ``[B, T, vocab]``; on a pipeline stage without the
        embedding the input is the previous stage's activations ``[B, T, dim]``. ``positions
        [B, T]``: packed documents (each attends only to itself; see :class:`Attention`)."""
        embed, layers, norm, head = (self._piece(p) for p in self.pieces)
        h = embed(tokens) if embed is not None else tokens
        for layer in layers.values() if isinstance(layers, nn.ModuleDict) else ():
            h = layer(h) if positions is None else layer(h, positions=positions)
        h = norm(h) if norm is not None else h
        return head(h) if head is not None else h

    def parallel_plan(self, name: str, *, axis: str, sequence_parallel: bool = False) -> tuple[dict, dict]:
        """The family's named tensor-parallel plan on mesh axis ``axis``: ``(placements, layouts)``
        as config globs. ``megatron``: q/k/v and gate/up column-parallel (``Shard(0)`` of
        ``[out, in]``), o and down row-parallel (``Shard(1)``); with ``sequence_parallel`` the
        block norms take sequence shards (``Shard(1)``)."""
        if name != "megatron":
            raise ValueError(f"unknown plan {name!r}; this model has: megatron")
        n = self.names
        blocks = self.pieces[1] + ".*"
        col, row = {axis: "Shard(0)"}, {axis: "Shard(1)"}
        if n == MESHFLOW_NAMES:  # the globs the built-in presets always wrote
            placements = {f"{blocks}.attn.w[qkv].weight": col, f"{blocks}.attn.wo.weight": row}
            mlp = {f"{blocks}.mlp.w[13].weight": col, f"{blocks}.mlp.w2.weight": row}
        else:
            placements = {f"{blocks}.{n.attn}.{p}.weight": col for p in (n.q, n.k, n.v)}
            placements[f"{blocks}.{n.attn}.{n.o}.weight"] = row
            mlp = {f"{blocks}.{n.mlp}.{p}.weight": col for p in (n.gate, n.up)}
            mlp[f"{blocks}.{n.mlp}.{n.down}.weight"] = row
        if self.cfg.moe is None:  # experts are no column/row pairs (validation refuses tp of an MoE model)
            placements |= mlp
        if self.cfg.qkv_bias:  # a column-parallel layer's bias is split like its output rows
            placements |= {f"{blocks}.{n.attn}.{p}.bias": col for p in (n.q, n.k, n.v)}
        layouts = {f"{blocks}.{norm}": {"input": {axis: "Shard(1)"}} for norm in (n.attn_norm, n.mlp_norm)}
        return placements, (layouts if sequence_parallel else {})

    def vocab_parallel_plan(self, *, axis: str) -> tuple[dict, dict, int]:
        """Loss parallel on mesh axis ``axis``: ``(placements, layouts, vocabulary size)`` as config globs.
        The head is column-parallel (``Shard(0)`` of ``[vocab, dim]``: each rank its vocabulary rows) and its
        output, the logits ``[B, T, vocab]``, stays a ``Shard(2)`` DTensor for the loss. A tied head is the
        input embedding's weight, placed under the embedding's name (the first a model lists): the embedding
        then looks tokens up in its own vocabulary rows (a masked lookup summed over the axis)."""
        embed, head = self._piece(self.pieces[0]), self._piece(self.pieces[3])
        tied = embed is not None and head is not None and head.weight is embed.weight
        weight = f"{self.pieces[0] if tied else self.pieces[3]}.weight"
        return ({weight: {axis: "Shard(0)"}}, {self.pieces[3]: {"output": {axis: "Shard(2)"}}}, self.cfg.vocab_size)

    def vocab_parallel_embedding(self, *, axis: str) -> dict:
        """The untied input embedding's vocabulary rows over ``axis`` (``Shard(0)`` of ``[vocab, dim]``), as
        Megatron-LM's vocabulary-parallel embedding: each rank looks tokens up in its own rows, the lookups
        summed over the axis. A tied embedding is the head's weight, which :meth:`vocab_parallel_plan` places."""
        embed, head = self._piece(self.pieces[0]), self._piece(self.pieces[3])
        if embed is None or (head is not None and head.weight is embed.weight):
            return {}
        return {f"{self.pieces[0]}.weight": {axis: "Shard(0)"}}

    def expert_modules(self) -> list[str]:
        """The modules of stacked experts (every parameter ``[num_experts, ...]``) an expert-parallel
        axis splits: each block's ``mlp.experts`` with ``model.moe``, none for the dense MLP."""
        if self.cfg.moe is None:
            return []
        n = self.names
        return [name for name, _ in self.named_modules() if name.endswith(f".{n.mlp}.experts")]

    def _init_rule(self, fqn: str) -> tuple[InitKind, float]:
        module_name = fqn.rpartition(".")[0]
        module = self.get_submodule(module_name)
        if (adapter := adapter_init(fqn, module)) is not None:
            return adapter
        if isinstance(module, nn.RMSNorm):
            return "ones", 0.0
        if isinstance(module, GroupedExperts):  # w2 projects back into the residual stream, as a down projection
            return "normal", self.cfg.init_std / (math.sqrt(2 * self.cfg.n_layers) if fqn.endswith(".w2") else 1.0)
        if isinstance(module, nn.Linear) and fqn.endswith(".bias"):
            return "zeros", 0.0
        if isinstance(module, (nn.Linear, nn.Embedding)):
            # Residual-branch output projections are scaled down so the residual stream's
            # variance does not grow with depth (GPT-2 / Llama practice). cfg.n_layers, not
            # len(self.layers): a pipeline stage must use the full model's depth.
            if canonical_fqn(module_name).rsplit(".", 1)[-1] in (self.names.o, self.names.down):
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
