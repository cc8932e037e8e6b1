"""Where a meta pass's op belongs, for :func:`trainer.planner.cost.model.unit_pass`: :class:`_Enter`
marks a unit's output so its backward says where that unit's backward begins; :class:`_Where` tells a
pricer the ``(unit, phase)`` of the op being dispatched and, with sequence parallelism, the share of
its work this rank does (:func:`sequence_share`: ``1 / tp`` inside a block's norms and residual adds,
which run on the rank's sequence shard, tracked forward and backward by :func:`_mark_sequence_shards`).
"""

from __future__ import annotations

import torch

from parallel.plan.spec import ParallelPlan
from parallel.plan.split import LayoutShares
from trainer.planner.cost.comm import sequence_parallel_axes


class _Enter(torch.autograd.Function):
    """Identity at a unit's output; its backward marks where that unit's backward begins."""

    @staticmethod
    def forward(ctx, x, mark):
        ctx.mark = mark
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.mark()
        return grad, None


class _Where:
    """``where()``: the ``(unit, phase)`` the op being dispatched belongs to; ``share()``: the share of
    its work this rank does (``1 / tp`` inside a sequence-parallel block's norms and residual adds, which
    run on the rank's sequence shard; 1 elsewhere); ``split()``: a grid's or cube's share of a block's op
    (``layout``, :mod:`parallel.plan.split`: the pass runs those blocks whole; 1 elsewhere)."""

    def __init__(self, state: dict, shard: float, layout: LayoutShares | None = None) -> None:
        self.state, self.shard, self.layout = state, shard, layout

    def __call__(self) -> tuple[str, str]:
        return self.state["unit"], self.state["phase"]

    def share(self) -> float:
        return self.shard if self.state["sharded"] else 1.0

    def split(self, *, core: bool = False) -> float:
        """The share of the op being dispatched one rank of a grid or cube does (``core``: the attention kernel)."""
        if self.layout is None or self.state["unit"] not in self.layout.blocks:
            return 1.0
        return self.layout.core if core else self.layout.block


def sequence_share(plan: ParallelPlan) -> float:
    """``1 / tp`` of the axes a sequence-parallel plan shards the blocks' norms' inputs over; 1 without."""
    axes = sequence_parallel_axes(plan)
    return 1.0 / plan.mesh.size(sorted(axes)) if axes else 1.0


def _mark_sequence_shards(plan: ParallelPlan, modules: dict, state: dict) -> list:
    """Hooks that set ``state["sharded"]`` while a sequence-parallel block runs on sequence shards, in
    forward and (through identity autograd functions at the same boundaries) in backward: inside the
    block, but outside its children other than the norms (attention and the MLP run on the gathered
    sequence; the row-parallel outputs are reduce-scattered before the residual add)."""
    if sequence_share(plan) == 1.0:
        return []
    norms = {name for name, layout in plan.layouts.items() if any(pl.is_shard for pl in layout.input.values())}
    blocks = [b for b in plan.blocks if b in modules and any(n.startswith(f"{b}.") for n in norms)]

    def mark(on: bool):
        # backward leaves (enters) the region where forward entered (left) it
        def forward_pre(_m, args):
            state["sharded"] = on
            return _marked(args, lambda: state.update(sharded=not on))

        def forward(_m, _a, out):
            state["sharded"] = not on
            return _marked(out, lambda: state.update(sharded=on))
        return forward_pre, forward

    hooks = []
    for block in blocks:
        for module, on in [(modules[block], True)] + [(m, False) for name, m in modules[block].named_children()
                                                      if f"{block}.{name}" not in norms]:
            pre, post = mark(on)
            hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return hooks


def _marked(value, setter):
    """``value`` (a tensor, or a tuple whose first item is one) through :class:`_Enter`, whose
    backward calls ``setter``; ``None`` (leave it as it is) when there is no tensor that needs a gradient."""
    if isinstance(value, torch.Tensor):
        return _Enter.apply(value, setter) if value.requires_grad else None
    if isinstance(value, tuple) and value and isinstance(value[0], torch.Tensor) and value[0].requires_grad:
        return (_Enter.apply(value[0], setter), *value[1:])
    return None
