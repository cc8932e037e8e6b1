"""Low-rank adapters (LoRA) on chosen Linears of a model, with every other weight frozen.

A targeted ``nn.Linear`` becomes a :class:`LoRALinear`: the same module (an ``nn.Linear``, same
``weight`` and ``bias``, so placements, checkpoints and Hugging Face files name it as before) with
two children ``lora_A`` (``[rank, in]``) and ``lora_B`` (``[out, rank]``), PEFT's names and shapes:

    y = W x + b + scaling * B (A dropout(x)),        scaling = alpha / rank

Only the adapters train (``requires_grad``); the base weights keep ``requires_grad=False``, so they
get no gradient and the optimizer never sees them. Adapters start as PEFT starts them (A
kaiming-uniform, B zeros: the model's output is the base model's at step 0), with values drawn
from ``(seed, FQN)`` like every other parameter (:mod:`trainer.models.init`), so every layout,
a model built on the meta device and initialised shard by shard included, starts from one device's.

    apply_lora(model, LoRAConfig(rank=16), default_targets=["layers.*.attn.w[qkvo]"])
    [n for n, p in model.named_parameters() if p.requires_grad]   # ['layers.0.attn.wq.lora_A.weight', ...]
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config.schema import LoRAConfig
from trainer.models.init import InitKind, canonical_fqn

ADAPTER_NAMES = ("lora_A", "lora_B")


class LoRAError(ValueError):
    """A LoRA setting that does not fit the model: ``path``, ``reason`` and ``fix`` for the validator."""

    def __init__(self, path: str, reason: str, fix: str) -> None:
        super().__init__(f"{path}: {reason} ({fix})")
        self.path, self.reason, self.fix = path, reason, fix


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a low-rank update: ``lora_A`` (in -> rank) then ``lora_B`` (rank -> out),
    scaled by ``scaling``; ``lora_dropout`` on the adapters' input (``nn.Identity`` when 0).

    Built from an existing Linear (:meth:`from_linear`) whose ``weight`` and ``bias`` it takes over.
    Under tensor parallelism the adapters are sharded with their base
    (:mod:`parallel.sharding.adapters`): the sum is computed on DTensors and stays exact."""

    def __init__(self, in_features: int, out_features: int, *, rank: int, scaling: float, dropout: float = 0.0,
                 bias: bool = True, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.rank, self.scaling = rank, scaling
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, out_features, bias=False, device=device, dtype=dtype)

    @classmethod
    def from_linear(cls, base: nn.Linear, *, rank: int, scaling: float, dropout: float) -> LoRALinear:
        device = base.weight.device
        with torch.device("meta"):  # the base's tensors are taken over; only the adapters are new
            lora = cls(base.in_features, base.out_features, rank=rank, scaling=scaling, dropout=dropout,
                       bias=base.bias is not None)
        lora.weight, lora.bias = base.weight, base.bias
        for child in (lora.lora_A, lora.lora_B):  # allocated; the model's init_weights gives their values
            child.to_empty(device=device)
        return lora

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """``scaling * B @ A`` (``[out, in]``, plain tensors): what merging adds to ``weight``."""
        a, b = (_full(m.weight).float() for m in (self.lora_A, self.lora_B))
        return (b @ a) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scaling={self.scaling:g}"


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def apply_lora(model: nn.Module, cfg: LoRAConfig, *, default_targets: Sequence[str]) -> list[str]:
    """Give the Linears of ``model`` that ``cfg.targets`` (else ``default_targets``) match adapters,
    and freeze every other parameter; returns the adapted modules' names. Works on any device,
    ``meta`` included (values come later, from :func:`adapter_init`). Raises :class:`LoRAError` for a
    glob matching no Linear, or a rank above a target's ``min(in, out)``."""
    targets = list(cfg.targets) if cfg.targets is not None else list(default_targets)
    if not targets:
        raise LoRAError("model.lora.targets", "is empty: no Linear would get adapters, so nothing would train",
                        "give globs of the Linears to adapt, or model.lora.targets=null for every projection")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and name}
    chosen: list[str] = []
    for i, glob in enumerate(targets):
        matched = [name for name in linears if fnmatchcase(canonical_fqn(name), glob)]
        if not matched:
            path = f"model.lora.targets[{i}]" if cfg.targets is not None else "model.lora.targets"
            sample = ", ".join(list(linears)[:4])
            raise LoRAError(path, f"{glob!r} matches no Linear of the model (its Linears are named like {sample})",
                            f"give globs over those names, e.g. model.lora.targets=[{_suggest(linears)}]")
        chosen += [name for name in matched if name not in chosen]
    for name in chosen:
        base = linears[name]
        if cfg.rank > min(base.in_features, base.out_features):
            limit = min(min(linears[n].in_features, linears[n].out_features) for n in chosen)
            raise LoRAError("model.lora.rank", f"rank {cfg.rank} exceeds min(in, out) = "
                            f"{min(base.in_features, base.out_features)} of {name}",
                            f"use model.lora.rank={limit} or lower")
    for param in model.parameters():
        param.requires_grad_(False)
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear.from_linear(linears[name], rank=cfg.rank, scaling=cfg.scaling,
                                                      dropout=cfg.dropout))
    return chosen


def _suggest(linears: Mapping[str, nn.Module]) -> str:
    """A glob over the first block's projections, with the block index starred."""
    first = next(iter(linears))
    parts = first.split(".")
    return ".".join("*" if p.isdigit() else p for p in parts[:-1] + ["*"])


def is_adapter(fqn: str) -> bool:
    """Whether the parameter (or module) ``fqn`` belongs to a LoRA adapter."""
    return any(part in ADAPTER_NAMES for part in canonical_fqn(fqn).split("."))


def adapter_init(fqn: str, module: nn.Module) -> tuple[InitKind, float] | None:
    """How adapter parameter ``fqn`` (of ``module``, its Linear) starts, as PEFT starts it: ``lora_A``
    kaiming-uniform with ``a = sqrt(5)`` (uniform in +-1/sqrt(in)), ``lora_B`` zeros; None when
    ``fqn`` is not an adapter's."""
    owner = canonical_fqn(fqn).rsplit(".", 2)
    if len(owner) < 2 or owner[-2] not in ADAPTER_NAMES:
        return None
    if owner[-2] == "lora_B":
        return "zeros", 0.0
    assert isinstance(module, nn.Linear), "an adapter is a Linear"
    return "uniform", 1.0 / math.sqrt(module.in_features)


def trainable_names(module: nn.Module) -> set[str]:
    """The canonical FQNs of ``module``'s parameters that train (all of them without LoRA)."""
    return {canonical_fqn(n) for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}


def merged_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (``model``'s, plain tensors) with every adapter merged into its base weight
    (``W + scaling * B @ A``) and the adapter entries dropped: the weights of the model without LoRA."""
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            key = f"{canonical_fqn(name)}.weight"
            out[key] = (out[key].float() + module.delta_weight()).to(out[key].dtype)
    return out


__all__ = ["ADAPTER_NAMES", "LoRAError", "LoRALinear", "adapter_init", "apply_lora", "is_adapter", "merged_state",
           "trainable_names"]
