"""The ``model`` sections of the run configuration (a tagged union on ``arch``), beside
:mod:`trainer.config.schema`, which re-exports them; the same rules hold here: every default once,
every field described (``python -m trainer --help`` and the REST API's schema show them).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import Field, ValidationInfo, field_validator

from parallel.config import Section as _Section
from trainer.config.path_text import PathText


class RopeScaling(_Section):
    """Llama 3's rotary frequency adjustment (Llama 3.1 / 3.2 checkpoints): a long-context model
    trained at ``original_max_position_embeddings`` keeps its short wavelengths, stretches its long
    ones by ``factor``, and blends the two in between."""

    type: Literal["llama3"] = Field("llama3", description="The scaling rule; only Llama 3's (`llama3`) is built in.")
    factor: float = Field(8.0, ge=1, description="Wavelengths longer than original_max_position_embeddings / "
                          "low_freq_factor are multiplied by this (their frequencies divided).")
    low_freq_factor: float = Field(1.0, gt=0, description="original_max_position_embeddings / low_freq_factor is the "
                                   "wavelength above which the full factor applies.")
    high_freq_factor: float = Field(4.0, gt=0, description="original_max_position_embeddings / high_freq_factor is "
                                    "the wavelength below which frequencies are kept; between the two they "
                                    "are blended.")
    original_max_position_embeddings: int = Field(8192, ge=1, description="The context length the model was "
                                                  "pre-trained at, before the context was extended.")

    @field_validator("high_freq_factor")
    @classmethod
    def _above_low_freq_factor(cls, value: float, info: ValidationInfo) -> float:
        low = info.data.get("low_freq_factor")  # absent when it failed its own check
        if low is not None and value <= low:
            raise ValueError(f"must be greater than low_freq_factor {low} (the two bound the band of blended "
                             "wavelengths; Llama 3.1 uses 1 and 4)")
        return value


class LoRAConfig(_Section):
    """Low-rank adapters (LoRA, as PEFT defines them): each targeted Linear computes
    ``W x + (alpha / rank) * B A dropout(x)``, with ``A [rank, in]`` (kaiming-uniform) and ``B [out, rank]``
    (zeros) trained and every other weight of the model frozen (no gradient, no optimizer state)."""

    rank: int = Field(0, ge=0, description="Rank r of the adapters; 0 = no LoRA (full fine-tuning). Must be at most "
                      "min(in, out) of every targeted Linear.")
    alpha: float | None = Field(None, gt=0, description="LoRA alpha: the update is scaled by alpha / rank (PEFT's "
                                "lora_alpha). null = 2 * rank (a scaling of 2).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input (PEFT's "
                                                        "lora_dropout); 0 = none. A run with dropout draws other "
                                                        "random numbers on every layout, so its losses are not "
                                                        "one device's.")
    targets: list[str] | None = Field(
        None, description="Globs over the model's module names choosing the Linears that get adapters (`*` crosses "
        "dots, as in parallel.placements), e.g. `[\"layers.*.attn.w[qv]\"]` or "
        "`[\"model.layers.*.self_attn.*_proj\"]`. null = every attention and MLP projection (q, k, v, o, gate, up, "
        "down). A glob matching no Linear is refused.")
    save_base: bool = Field(
        False, description="Checkpoints also hold the frozen base weights. false = adapters (and their optimizer "
        "state) only; the base comes again from model.path, train.init_from or train.seed on resume and export.")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        """alpha / rank: the factor of the adapters' update."""
        return (self.alpha if self.alpha is not None else 2.0 * self.rank) / self.rank


class MoEConfig(_Section):
    """A mixture of experts in place of each block's MLP: a router scores every token against
    ``num_experts`` SwiGLU experts and sends it to its ``top_k`` best (token choice, dropless: no
    capacity limit, no token dropped), the experts' outputs weighted by the scores and summed."""

    num_experts: int = Field(8, ge=1, le=4096, description="Routed experts per block, stored stacked "
                             "(`layers.<i>.mlp.experts.w1` is `[num_experts, hidden, dim]`), so a placement can shard "
                             "dim 0 (`parallel.expert_parallel`); at most 4096.")
    top_k: int = Field(2, ge=1, description="Experts each token is sent to; at most num_experts.")
    hidden_dim: int | None = Field(None, ge=1, description="Hidden width of one expert's SwiGLU; null = "
                                   "model.ffn_hidden_dim.")
    score_func: Literal["softmax", "sigmoid"] = Field(
        "softmax", description="Router scores from the gate's logits: softmax over the experts (Mixtral, Qwen3-MoE) "
        "or an independent sigmoid per expert (DeepSeek-V3).")
    norm_topk_prob: bool = Field(True, description="Rescale each token's top_k scores to sum to 1 before weighting "
                                 "the experts' outputs; false = the raw scores.")
    aux_loss_weight: float = Field(
        0.01, ge=0, description="Weight of the load-balancing loss added to the training loss (logged as aux_loss, "
        "unweighted). It is computed per sequence and averaged over sequences and blocks: "
        "num_experts * sum_e f_e * P_e, f_e the share of the sequence's top_k choices that went to expert e and P_e "
        "its mean normalised score over the sequence; 1 when balanced. 0 = not added (still logged).")
    num_shared_experts: int = Field(0, ge=0, le=64, description="Experts every token goes through besides the routed "
                                    "ones (one SwiGLU of num_shared_experts x hidden_dim, `mlp.shared`); 0 = none.")


class LlamaConfig(_Section):
    """A Llama-style decoder; the defaults are the tiny `gpt_debug` preset (trains in minutes on a CPU)."""

    arch: Literal["llama"] = Field("llama", description="Decoder-only transformer (RMSNorm, RoPE, GQA, SwiGLU).")
    # No ceilings on widths here: the memory prediction refuses a model that does not fit
    # (launch.memory_budget_gb) and the validator refuses more than MAX_LAYERS blocks before building.
    dim: int = Field(64, ge=1, description="Model (embedding) width.")
    n_layers: int = Field(4, ge=1, description="Number of transformer blocks, `layers.0` .. `layers.<n-1>`.")
    n_heads: int = Field(4, ge=1, description="Attention heads; `dim` must divide by it.")
    n_kv_heads: int | None = Field(2, ge=1, description="Key/value heads (grouped-query attention); null = n_heads.")
    vocab_size: int = Field(256, ge=2, description="Vocabulary size; 256 for the byte-level tokenizer.")
    ffn_hidden_dim: int = Field(172, ge=1, description="Hidden width of the SwiGLU MLP (w1, w3: dim -> "
                                                       "hidden; w2: back).")
    # CPU and memory: the rotary table and the activation prediction grow with it (1e10 took the validator
    # 23 s); 2**24 is above the longest published context (10M tokens).
    max_seq_len: int = Field(256, ge=1, le=2**24, description="Longest sequence the rotary table covers; at most "
                             "16777216.")
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency.")
    init_std: float = Field(0.02, gt=0, description="Std of the normal initialisation of linear and embedding weights.")
    head_dim: int | None = Field(None, ge=2, description="Width of one attention head; null = dim / n_heads.")
    qkv_bias: bool = Field(False, description="Biases on the q/k/v projections (Qwen2).")
    qk_norm: bool = Field(False, description="RMSNorm of each query and key head before RoPE (Qwen3).")
    rope_scaling: RopeScaling | None = Field(
        None, description="Llama 3.x rotary frequency scaling (type, factor, low_freq_factor, high_freq_factor, "
        "original_max_position_embeddings); null = plain RoPE.")
    lora: LoRAConfig = Field(default_factory=LoRAConfig, description="Low-rank adapters (`model.lora.rank=16` turns "
                             "them on); rank 0 = full fine-tuning.")
    moe: MoEConfig | None = Field(None, description="A mixture of experts in place of every block's MLP "
                                  "(num_experts, top_k, ...; `model=gpt_moe`); null = the dense SwiGLU MLP.")

    @property
    def num_kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_width(self) -> int:
        """One attention head's width: ``head_dim``, or ``dim // n_heads`` when that is null."""
        return self.head_dim or self.dim // self.n_heads


class MLPConfig(_Section):
    arch: Literal["mlp"] = Field("mlp", description="Two raw matmuls, y = (x @ w0) @ w1, weights stored [in, out].")
    in_features: int = Field(1024, ge=1, description="Rows of w0 (input width).")
    hidden_features: int = Field(4096, ge=1, description="Columns of w0 and rows of w1.")
    out_features: int = Field(1024, ge=1, description="Columns of w1 (output width).")
    activation: Literal["none", "relu", "gelu"] = Field(
        "relu", description="Applied between the two matmuls; `none` gives the seeds' plain matmul chain."
    )
    init_std: float = Field(0.02, gt=0, description="Std of the normal initialisation of w0 and w1.")


class HFModelConfig(_Section):
    arch: Literal["hf"] = Field("hf", description="A Hugging Face causal LM from a local directory (Llama family: "
                                "Llama, Mistral, Qwen2, Qwen3; Qwen3-MoE, Mixtral).")
    path: PathText | None = Field(
        None,
        description="Directory with the model's config.json (model_type llama, mistral, qwen2, qwen3, or "
                    "with a mixture of experts qwen3_moe or mixtral), plus *.safetensors weights "
        "when present (random init from the config when absent). Nothing is downloaded.",
    )
    lora: LoRAConfig = Field(default_factory=LoRAConfig, description="Low-rank adapters (`model.lora.rank=16` turns "
                             "them on); rank 0 = full fine-tuning.")


class CustomModelConfig(_Section):
    arch: Literal["custom"] = Field("custom", description="Your own nn.Module, from a builder function.")
    builder: str | None = Field(
        None, description="module:function returning the nn.Module (CLI only: REST refuses import paths).")
    name: str | None = Field(
        None, description="A model an installed package registers under the `meshflow.models` entry points "
        "(usable from the CLI and REST).")
    # None, not {}: Hydra replaces a null node by `model.kwargs={...}`, but will not add keys to an empty one.
    kwargs: dict[str, Any] | None = Field(None, description="Keyword arguments of the builder (null = none).")
    loss: Literal["lm", "mse"] = Field(
        "lm", description="lm: cross-entropy of logits [B, T, vocab] (text, synthetic data); mse: regression.")


# The members of each tagged union, once: Hydra's `<tag>_defaults` and `--help` list them from here.
ModelConfig = Annotated[LlamaConfig | MLPConfig | HFModelConfig | CustomModelConfig, Field(discriminator="arch")]
MODEL_SECTIONS = get_args(get_args(ModelConfig)[0])
