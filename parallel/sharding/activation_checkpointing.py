"""Activation checkpointing: recompute activations in backward instead of storing them.

    apply_ac(model, mode="full", every=2, block_fqns=["layers.0", "layers.1", "layers.2", "layers.3"])
    # wraps layers.1 and layers.3
    apply_ac(model, mode="selective", block_fqns=[...])
    # every block's attention core recomputed: ["layers.0.attn", "layers.1.attn", ...]

``full`` wraps whole blocks: every ``every``-th of them (the 2nd, 4th, ... as torchtitan counts; 1 =
every block). The wrapper is ``checkpoint_wrapper`` (non-reentrant), which replaces the block in its
parent; its state-dict hooks strip the ``_checkpoint_wrapped_module`` segment, so checkpoint keys keep
the model's FQNs; only the block's input is kept, the whole block runs again in backward.

``selective`` is Megatron-LM's selective recomputation (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", sec. 5): only each block's attention core, the
scaled-dot-product attention, is recomputed. Its inputs q, k, v are kept (the projections' backward
needs them anyway); what the kernel saves beyond them (its output and log-sum-exp; with a mask, the
math path's ``[T, T]`` scores) is dropped and recomputed in backward. A module offers this by having an
attribute ``recompute_attention_core`` (the built-in and Hugging Face Llama-family attention do), which
``selective`` sets. ``none`` does nothing. Recomputation is exact: losses and gradients do not change.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from parallel.config import ActivationCheckpointing

RECOMPUTE_CORE = "recompute_attention_core"  # the attribute an attention module offers selective recomputation by


def apply_ac(
    model: nn.Module,
    *,
    mode: ActivationCheckpointing,
    every: int = 1,
    block_fqns: Sequence[str],
) -> list[str]:
    """Checkpoint the blocks of ``model`` named in ``block_fqns`` (those it holds) per ``mode``; returns
    the FQNs wrapped (``full``) or whose attention core is recomputed (``selective``)."""
    if mode == "none":
        return []
    modules = dict(model.named_modules())
    held = [fqn for fqn in block_fqns if fqn in modules]
    if mode == "selective":
        return _recompute_attention_cores(modules, held)
    wrapped = []
    for i, fqn in enumerate(block_fqns):
        if fqn not in modules or (i + 1) % every:
            continue
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        # setattr, not item assignment: works for ModuleDict, ModuleList and plain attributes.
        setattr(parent, child, checkpoint_wrapper(modules[fqn]))
        wrapped.append(fqn)
    return wrapped


def _recompute_attention_cores(modules: dict[str, nn.Module], blocks: Sequence[str]) -> list[str]:
    cores = [name for name, module in modules.items()
             if hasattr(module, RECOMPUTE_CORE) and any(name.startswith(f"{b}.") for b in blocks)]
    if blocks and not cores:
        raise ValueError(f"activation_checkpointing=selective: no module of blocks {list(blocks)[:2]}... offers "
                         f"its attention core for recomputation (an attribute {RECOMPUTE_CORE!r}); use full")
    for name in cores:
        setattr(modules[name], RECOMPUTE_CORE, True)
    return cores
