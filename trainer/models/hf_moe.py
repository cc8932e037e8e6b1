"""Hugging Face mixture-of-experts checkpoints (``model_type`` qwen3_moe, mixtral) as the built-in MoE block.

The files name each expert apart (Qwen3-MoE: ``model.layers.<i>.mlp.experts.<e>.gate_proj.weight``,
``up_proj``, ``down_proj``, the router ``mlp.gate.weight``; Mixtral: ``block_sparse_moe.experts.<e>.w1``,
``w3``, ``w2`` and ``block_sparse_moe.gate.weight``), as every transformers version writes them; the
trainer's block (:class:`trainer.models.moe.MoE`) stacks them, ``mlp.experts.w1 [num_experts, hidden,
dim]``, so an expert-parallel axis can shard dim 0, and names its gate ``mlp.router.gate.weight``.
:func:`file_keys` is the one mapping between the two, used to read weights in (a rank reads only its
experts' slices), to export them back (:func:`hf_state`) and to check what was loaded
(:func:`stacked_fingerprint`).

The router's math is both families' own: softmax over the experts in fp32, the ``num_experts_per_tok``
best, rescaled to sum to 1 when ``norm_topk_prob`` (Qwen3-MoE's config says; Mixtral always does).

    keys = file_keys("model.layers.0.mlp.experts.w1", "mixtral", 8)  # [...block_sparse_moe.experts.0.w1.weight, ...]
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import torch

from trainer.models.fingerprint import Fingerprint, as_fingerprint, fingerprint
from trainer.models.init import local_box

MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")


class HFModelError(ValueError):
    """The directory is not a model this source can build: ``reason`` and ``fix`` for the validator."""

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(f"{reason} ({fix})")
        self.reason, self.fix = reason, fix


class _Family(NamedTuple):
    block: str  # the MoE block's module name in the files
    projections: dict[str, str]  # the trainer's stacked weight -> one expert's Linear in the files


_FAMILIES = {
    "qwen3_moe": _Family("mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}),
    "mixtral": _Family("block_sparse_moe", {"w1": "w1", "w3": "w3", "w2": "w2"}),
}
_ROUTER = re.compile(r"^(?P<layer>model\.layers\.\d+)\.mlp\.router\.gate\.weight$")
_EXPERTS = re.compile(r"^(?P<layer>model\.layers\.\d+)\.mlp\.experts\.(?P<weight>w[123])$")


def moe_fields(hf: dict, kind: str, where: str) -> dict:
    """The :class:`~trainer.config.schema.MoEConfig` fields of a qwen3_moe or mixtral ``config.json``
    (``hf``, read from ``where``); raises :class:`HFModelError` for what the trainer's block does not
    compute the family's way."""
    experts = hf.get("num_experts", hf.get("num_local_experts"))  # transformers 5 writes num_local_experts
    if kind == "qwen3_moe":
        sparse_step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
        if sparse_step != 1 or dense:
            raise HFModelError(f"{where!r} mixes dense and mixture-of-experts layers (decoder_sparse_step "
                               f"{sparse_step}, mlp_only_layers {dense}); every layer here is a mixture of experts",
                               "use a checkpoint whose config.json has decoder_sparse_step 1 and no mlp_only_layers")
        hidden, norm = hf.get("moe_intermediate_size"), bool(hf.get("norm_topk_prob", False))
    else:
        if hf.get("router_jitter_noise"):
            raise HFModelError(f"router_jitter_noise {hf['router_jitter_noise']} in {where!r}: the router here "
                               "multiplies no random noise into its input",
                               "use a checkpoint whose config.json has router_jitter_noise 0")
        hidden, norm = hf.get("intermediate_size"), True  # Mixtral always rescales its top-k weights
    if not isinstance(experts, int) or not isinstance(hidden, int):
        raise HFModelError(f"{where!r} lacks the experts' count or width (num_experts / num_local_experts, "
                           f"{'moe_intermediate_size' if kind == 'qwen3_moe' else 'intermediate_size'})",
                           "give a complete config.json")
    # transformers adds router_aux_loss_coef * its balance loss only when output_router_logits; its loss sums
    # over the top_k choices (top_k * ours, which is 1 when balanced): docs/experts.md.
    weight = float(hf.get("router_aux_loss_coef", 0.0)) * hf.get("num_experts_per_tok", 2) \
        if hf.get("output_router_logits") else 0.0
    return {"num_experts": experts, "top_k": hf.get("num_experts_per_tok", 2), "hidden_dim": hidden,
            "score_func": "softmax", "norm_topk_prob": norm, "aux_loss_weight": weight}


def file_keys(name: str, kind: str | None, num_experts: int) -> list[str]:
    """The keys in the files that make up the model's parameter ``name``: one (its own name, or the
    router's name there), or ``num_experts`` for a stacked expert weight (expert ``e`` is row ``e``)."""
    family = _FAMILIES.get(kind or "")
    if family is None:
        return [name]
    if match := _ROUTER.match(name):
        return [f"{match['layer']}.{family.block}.gate.weight"]
    if match := _EXPERTS.match(name):
        proj = family.projections[match["weight"]]
        return [f"{match['layer']}.{family.block}.experts.{e}.{proj}.weight" for e in range(num_experts)]
    return [name]


def is_stacked(name: str) -> bool:
    """Whether ``name`` is a stacked expert weight (``[num_experts, ...]``, one file key per expert)."""
    return bool(_EXPERTS.match(name))


def hf_state(state: dict[str, torch.Tensor], kind: str | None, num_experts: int) -> dict[str, torch.Tensor]:
    """The model's (full) ``state`` under the files' names: stacked experts split into one tensor each."""
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        keys = file_keys(name, kind, num_experts)
        out.update(zip(keys, value.unbind(0) if is_stacked(name) else [value]))
    return out


def key_files(files: list[Path]) -> dict[str, Path]:
    """Which of the safetensors ``files`` holds each key (headers only)."""
    from safetensors import safe_open

    where = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), file))
    return where


def read_stacked(targets: dict[str, tuple[list[str], torch.Tensor]], where: dict[str, Path]) -> None:
    """Fill each stacked expert weight (``name -> (its file keys, the tensor)``; a DTensor shard or a
    plain tensor) with the block this rank holds: for each of its experts, only that expert's slice of
    the file is read."""
    from safetensors import safe_open

    with ExitStack() as opened, torch.no_grad():
        handles: dict[Path, safe_open] = {}
        for keys, tensor in targets.values():
            (first, *rest), (count, *shape) = local_box(tensor)
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            box = tuple(slice(o, o + n) for o, n in zip(rest, shape))
            for row, key in enumerate(keys[first:first + count]):
                if where[key] not in handles:
                    handles[where[key]] = opened.enter_context(safe_open(str(where[key]), framework="pt"))
                local[row].copy_(handles[where[key]].get_slice(key)[box])


def stacked_fingerprint(keys: list[str], where: dict[str, Path]) -> Fingerprint:
    """The fingerprint (:mod:`trainer.models.fingerprint`) of the stacked tensor the per-expert ``keys``
    make, computed one expert at a time (each its row's share), never holding the stack."""
    from safetensors import safe_open

    total = [0.0] * 4
    for e, key in enumerate(keys):
        with safe_open(str(where[key]), framework="pt") as f:
            row = f.get_tensor(key).unsqueeze(0)
        total = [a + b for a, b in zip(total, fingerprint(row, (e, 0, 0)))]
    return as_fingerprint(total)
