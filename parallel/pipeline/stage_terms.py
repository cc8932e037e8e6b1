"""Loss terms that a pipeline stage's own modules add to the objective (an MoE block's balance loss).

Torch's pipelining schedules call the loss on the last stage only, and each other stage runs its
backward from the gradient its successor sends for its output. A term computed on an earlier stage
(its blocks' balance loss) would reach nothing there. So the stage's output carries it: a forward hook
on the stage module returns ``carry_term(output, term, scale)``, the output unchanged, whose backward
also hands ``term`` the gradient ``scale`` (the micro-batch's share of the objective, as the loss gets):
the term's gradient then flows on its own stage, in the same backward pass the schedule runs for that
micro-batch, whichever schedule it is (Megatron-LM's ``MoEAuxLossAutoScaler`` does the same).

Nothing crosses a stage boundary but the activations, so the schedules' shape inference and their
send/receive buffers stay as they are.

    out = carry_term(out, 0.01 * aux, scale=1 / num_microbatches)
"""

from __future__ import annotations

from typing import Any

import torch


class _CarryTerm(torch.autograd.Function):
    """Identity on ``output``; in backward, ``term`` gets ``scale`` (d objective / d term)."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, term: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.term_meta = (term.shape, term.dtype, term.device)
        # A copy, not a view: the zero-bubble schedules detach a stage's outputs in place after their input
        # pass, which a view refuses. The original is freed once it is copied (nothing saves it for backward).
        return output.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        shape, dtype, device = ctx.term_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def carry_term(output: torch.Tensor, term: torch.Tensor, scale: float) -> torch.Tensor:
    """``output`` as it is, whose backward also backpropagates ``term * scale`` (a scalar with its graph)."""
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"a stage that adds a loss term must output one tensor, got {type(output).__name__}")
    return _CarryTerm.apply(output, term, scale)  # type: ignore[no-untyped-call, no-any-return]  # torch: untyped


__all__ = ["carry_term"]
