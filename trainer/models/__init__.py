"""Models by name: ``build_model(cfg)`` dispatches on ``cfg.arch`` through a registry.

A name-keyed registry (not a ``_target_`` import path) because model configs also arrive
over REST, and a remote user must never be able to name arbitrary code.

    from trainer.config.schema import LlamaConfig
    from trainer.models import build_model, loss_fn_for
    model = build_model(LlamaConfig(n_layers=2), seed=0)          # built and initialised
    skeleton = build_model(LlamaConfig(), device="meta")          # shapes only, no memory
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config.schema import CustomModelConfig, HFModelConfig, LlamaConfig, MLPConfig, MoEConfig
from trainer.models.custom import build_custom_model
from trainer.models.init import canonical_fqn, init_named_parameters, init_parameter, stable_seed
from trainer.models.loss import IGNORE_INDEX, cross_entropy_mean, cross_entropy_sum
from trainer.models.llama import Attention, FeedForward, RMSNorm, Transformer, TransformerBlock
from trainer.models.mlp import MatmulMLP

ModelCfg = LlamaConfig | MLPConfig | HFModelConfig | CustomModelConfig
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, *, chunk_tokens: int | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy: ``logits [B, T, V]`` against ``targets [B, T]``, in fp32 (a bf16
    log-softmax over a large vocabulary loses the precision the loss needs); ``chunk_tokens``: that many
    tokens' fp32 at a time (:mod:`trainer.models.loss`)."""
    return cross_entropy_mean(logits, targets, chunk_tokens=chunk_tokens)


class ChunkedLMLoss:
    """:func:`lm_loss` over ``chunk_tokens`` tokens at a time (``train.loss_chunk_tokens``)."""

    def __init__(self, chunk_tokens: int | None) -> None:
        self.chunk_tokens = chunk_tokens

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, targets, chunk_tokens=self.chunk_tokens)


class TargetMeanLoss:
    """Next-token cross-entropy summed over the targets that count (not ``-100``) and divided by
    the global batch's target count: ``sum / (rows * tokens_per_row)``, where ``tokens_per_row`` is
    that count over the global batch's rows, set by the loop before each step.

    Every micro-batch, rank and accumulation batch is one equal slice of rows, and the engine
    averages their losses (and data parallelism their gradients); with this scaling the average is
    the sum over the whole global batch divided by its target count once, whatever slices carry
    how many targets. A per-slice mean would weigh a slice's few targets like another's many.
    """

    def __init__(self, chunk_tokens: int | None = None) -> None:
        self.tokens_per_row = 1.0
        self.chunk_tokens = chunk_tokens  # train.loss_chunk_tokens: the fp32 of that many tokens at a time

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        total = cross_entropy_sum(logits, targets, chunk_tokens=self.chunk_tokens)
        return total / (targets.shape[0] * self.tokens_per_row)


def mse_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error over every element."""
    return F.mse_loss(output.float(), targets.float())


class TargetMeanSquaredError(TargetMeanLoss):
    """:func:`mse_loss` as :class:`TargetMeanLoss` divides: squared errors summed over the targets that count
    (an evaluation's padding rows carry NaN, or ``-100`` for integer targets) over ``rows * tokens_per_row``."""

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        counts = ~targets.isnan() if targets.is_floating_point() else targets != IGNORE_INDEX
        error = torch.where(counts, output.float() - targets.float().nan_to_num(), 0.0)
        return error.square().sum() / (targets.shape[0] * self.tokens_per_row)


_Entry = TypeVar("_Entry")
MODEL_REGISTRY: dict[str, Callable[..., Transformer | MatmulMLP]] = {"llama": Transformer, "mlp": MatmulMLP}
LOSS_REGISTRY: dict[str, LossFn] = {"llama": lm_loss, "mlp": mse_loss, "hf": lm_loss}


def _lookup(registry: dict[str, _Entry], arch: str) -> _Entry:
    if arch not in registry:
        raise ValueError(f"unknown model.arch {arch!r}; known: {sorted(registry)}")
    return registry[arch]


def build_model(cfg: ModelCfg, *, device: str | torch.device = "cpu", seed: int = 0) -> nn.Module:
    """Build the model ``cfg.arch`` names.

    ``device="meta"`` builds names and shapes only (no memory, no init): validation and the
    parallel plan read those. Any other device builds there and calls ``init_weights(seed)``,
    whose values depend only on ``(seed, FQN, shape)``.
    """
    if cfg.arch == "hf":  # a directory, not a class: config.json (+ safetensors) decide
        from trainer.models.hf import build_hf_model  # optional: transformers, the hf extra

        return build_hf_model(cfg, device=device, seed=seed)
    if cfg.arch == "custom":  # the user's builder function

        return build_custom_model(cfg, device=device, seed=seed)
    model_cls = _lookup(MODEL_REGISTRY, cfg.arch)
    with torch.device(device):  # the built-in Llama reads cfg.lora: adapters and frozen weights (trainer.models.lora)
        model = model_cls(cfg)
    if torch.device(device).type != "meta":
        model.init_weights(seed)
    return model


def meta_initializer(model: nn.Module, seed: int) -> Callable[[nn.Module], None] | None:
    """How a part of ``model`` built on ``meta`` (the whole model, a pipeline stage) gets its
    values once allocated: its ``init_weights(seed)``, or for a stage of raw parameters (the
    MLP's ``w0``, ``w1``) the model's rule by FQN. ``None`` when the model has neither (a custom
    module without ``init_weights``): it must be built in full, where its builder initialises it."""
    rule = getattr(model, "_init_rule", None)
    if not callable(getattr(model, "init_weights", None)):
        return None

    def init(part: nn.Module) -> None:
        if callable(init_weights := getattr(part, "init_weights", None)):
            init_weights(seed)
        elif rule is not None:
            init_named_parameters(part.named_parameters(), seed, rule)
        else:
            raise TypeError(f"{type(part).__name__} has no init_weights to initialise it after sharding")

    return init


def decoder_config(cfg: ModelCfg) -> LlamaConfig | None:
    """The decoder's shape: the built-in config, what a Hugging Face directory's config.json says,
    or None (the MLP, a custom module)."""
    if isinstance(cfg, HFModelConfig):
        from trainer.models.hf import read_hf_config  # optional: transformers, the hf extra

        return read_hf_config(cfg.path)[0]
    return cfg if isinstance(cfg, LlamaConfig) else None


def moe_config(cfg: ModelCfg) -> MoEConfig | None:
    """The decoder's mixture of experts: ``model.moe``, or what a Hugging Face directory's config.json
    says (qwen3_moe, mixtral); None for a dense decoder, another model, or a directory whose config.json
    is refused (``model.path``'s check says why)."""
    if isinstance(cfg, HFModelConfig):
        from trainer.models.hf import HFModelError, read_hf_config  # optional: transformers, the hf extra

        try:
            return read_hf_config(cfg.path)[0].moe
        except HFModelError:
            return None
    return cfg.moe if isinstance(cfg, LlamaConfig) else None


def loss_fn_for(cfg: ModelCfg, *, masked: bool = False, chunk_tokens: int | None = None) -> LossFn:
    """The training loss of ``cfg.arch`` (a custom model names its own): ``loss(output, targets) -> scalar`` (mean).
    ``masked``: the data marks targets that do not count (chat): a :class:`TargetMeanLoss`. ``chunk_tokens``
    (``train.loss_chunk_tokens``): a cross-entropy holds the fp32 of that many tokens at a time."""
    if masked:
        return TargetMeanLoss(chunk_tokens)
    custom: dict[str, LossFn] = {"lm": lm_loss, "mse": mse_loss}
    loss = custom[cfg.loss] if cfg.arch == "custom" else _lookup(LOSS_REGISTRY, cfg.arch)
    return ChunkedLMLoss(chunk_tokens) if loss is lm_loss and chunk_tokens else loss


def eval_loss_for(cfg: ModelCfg, *, chunk_tokens: int | None = None) -> TargetMeanLoss:
    """The loss an evaluation sums over a validation split: the model's own, as a sum over the targets that
    count divided by the loop's ``tokens_per_row`` (:class:`TargetMeanLoss`, or its squared-error form), so
    that padding rows count for nothing and every target weighs the same."""
    custom: dict[str, LossFn] = {"lm": lm_loss, "mse": mse_loss}
    loss = custom[cfg.loss] if cfg.arch == "custom" else _lookup(LOSS_REGISTRY, cfg.arch)
    return TargetMeanSquaredError() if loss is mse_loss else TargetMeanLoss(chunk_tokens)


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements; for DTensor parameters the global (unsharded) count."""
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "LOSS_REGISTRY",
    "ChunkedLMLoss",
    "MODEL_REGISTRY",
    "Attention",
    "FeedForward",
    "MatmulMLP",
    "RMSNorm",
    "TargetMeanLoss",
    "TargetMeanSquaredError",
    "Transformer",
    "TransformerBlock",
    "build_model",
    "canonical_fqn",
    "count_parameters",
    "eval_loss_for",
    "decoder_config",
    "init_parameter",
    "lm_loss",
    "loss_fn_for",
    "meta_initializer",
    "moe_config",
    "mse_loss",
    "stable_seed",
]
