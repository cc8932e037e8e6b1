"""Activation checkpointing: recompute a block's activations in backward instead of storing them.

    apply_ac(model, mode="selective", every=2, block_fqns=["layers.0", "layers.1", "layers.2", "layers.3"])
    # wraps layers.1 and layers.3

``full`` wraps every block, ``selective`` every ``every``-th (the 2nd, 4th, ... as torchtitan
counts), ``none`` nothing. The wrapper is ``checkpoint_wrapper`` (non-reentrant), which
replaces the block in its parent; its state-dict hooks strip the ``_checkpoint_wrapped_module``
segment, so checkpoint keys keep the model's FQNs. Recomputation is exact: losses and
gradients do not change.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from parallel.config import ActivationCheckpointing


def apply_ac(
    model: nn.Module,
    *,
    mode: ActivationCheckpointing,
    every: int = 2,
    block_fqns: Sequence[str],
) -> list[str]:
    """Wrap the blocks of ``model`` named in ``block_fqns`` (those it holds) per ``mode``;
    returns the FQNs wrapped."""
    if mode == "none":
        return []
    modules = dict(model.named_modules())
    wrapped = []
    for i, fqn in enumerate(block_fqns):
        if fqn not in modules or (mode == "selective" and (i + 1) % every):
            continue
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        # setattr, not item assignment: works for ModuleDict, ModuleList and plain attributes.
        setattr(parent, child, checkpoint_wrapper(modules[fqn]))
        wrapped.append(fqn)
    return wrapped
