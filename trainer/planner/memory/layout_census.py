"""The meta pass's view of a 2-D / 2.5-D grid or a 3-D cube (:mod:`parallel.plan.split`): the pass runs the
blocks whole, and this tells it which share of each op's bytes one rank makes and keeps.

    layout = LayoutCensus.of(plan, model, params)   # None without a grid or cube
    hooks += layout.hooks(model)
    layout.share()            # inside a block, forward or backward: the block's share (else None)
    layout.linear_saved(t)    # inside a block's Linear: the bytes its saved ``t`` counts (else None)

Forward hooks say when a block, and within it a Linear or norm, runs; full backward hooks say when backward
is inside a block, so backward's temporaries and the weights' gradients count at the rank's share too.
"""

from __future__ import annotations

import torch
from torch import nn

from parallel.plan.spec import ParallelPlan
from parallel.plan.split import LayoutShares, layout_shares


class LayoutCensus:
    """Shares of a grid's or cube's blocks in one meta pass (module docstring); ``params``: the storages
    (``_cdata``) of the model's parameters, which a Linear saves as its gathered weight block."""

    def __init__(self, shares: LayoutShares, params: set[int]) -> None:
        self.shares, self.params = shares, params
        self.scope: list[str] = []  # the Linear or norm of a block running (forward)
        self.depth = 0  # > 0: inside a block (forward, or backward between its output's and input's gradients)
        self._saved: set[tuple[str, int]] = set()  # (Linear, storage) already counted: one gathered copy each

    @classmethod
    def of(cls, plan: ParallelPlan, model: nn.Module, params: set[int]) -> LayoutCensus | None:
        shares = layout_shares(plan, model)
        return cls(shares, params) if shares is not None else None

    def hooks(self, model: nn.Module) -> list:
        handles = []
        for name, module in model.named_modules():
            if name in self.shares.blocks:
                handles += [module.register_forward_pre_hook(lambda *_: self._step(1)),
                            module.register_forward_hook(lambda *_: self._step(-1)),
                            module.register_full_backward_pre_hook(lambda *_: self._step(1)),
                            module.register_full_backward_hook(lambda *_: self._step(-1))]
            elif name in self.shares.linears or name in self.shares.norms:
                handles += [module.register_forward_pre_hook(lambda _m, _a, name=name: self.scope.append(name)),
                            module.register_forward_hook(lambda *_: self.scope.pop() and None)]
        return handles

    def _step(self, by: int) -> None:
        self.depth += by

    def share(self, t: torch.Tensor | None = None, *, core: bool = False) -> float | None:
        """The share of a new or saved tensor ``t`` one rank holds, inside a block (None outside): a norm's
        per-row scale at the rows a rank holds, the attention kernel's (``core``) at its own share."""
        if self.depth <= 0:
            return None
        if t is not None and self.scope and self.scope[-1] in self.shares.norms and t.dim() and t.shape[-1] == 1:
            return self.shares.row_stats
        return self.shares.core if core else self.shares.block

    def linear_saved(self, t: torch.Tensor) -> float | None:
        """Bytes ``t``, saved for backward inside a block's Linear, counts: its gathered input or weight block,
        once per Linear (each Linear gathers its own, where the whole block's Linears share one input); 0 when
        this Linear's copy is counted already; None outside a Linear (the caller counts ``t`` as usual)."""
        if not self.scope or (name := self.scope[-1]) not in self.shares.linears:
            return None
        storage = t.untyped_storage()
        key = (name, storage._cdata)
        if key in self._saved:
            return 0.0
        self._saved.add(key)
        data, weight = self.shares.linears[name]
        return storage.nbytes() * (weight if storage._cdata in self.params else data)

    def normalised(self, out: torch.Tensor) -> float:
        """Bytes of a norm's normalised input, which the layout's norm keeps beside its input (torch's fused
        ``rms_norm`` keeps only the input and the scales): its output's size at the block's share."""
        return out.untyped_storage().nbytes() * self.shares.block


__all__ = ["LayoutCensus"]
