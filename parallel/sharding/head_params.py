"""Parameters a module applies to each attention head after its column-parallel projections (Qwen3's
per-head q/k norms: one weight of head_dim shared by every head).

Tensor parallelism splits the heads: each rank applies the shared weight to its own heads only, so
its gradient is that rank's heads' share, and the weight's gradient is their sum over the axis.
A module declares such parameters by name (``head_parameters = ("q_norm.weight", "k_norm.weight")``);
for a module that holds a Megatron pair on an axis, :func:`find_head_parameters` records them with
the axis's process group, and :meth:`HeadGradients.sum_grads` all-reduces their gradients once per
optimizer step (the engine calls it before the gradient norm, as Megatron-LM all-reduces its
qk-layernorm gradients over tp). Their values stay replicated: every rank makes the same update.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

HEAD_PARAMETERS = "head_parameters"  # the attribute a module names its per-head parameters in


@dataclass
class HeadGradients:
    """``(module, parameter name, the axis's group)`` of every per-head parameter under tensor parallelism."""

    entries: list[tuple[nn.Module, str, dist.ProcessGroup]] = field(default_factory=list)

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Each per-head parameter's gradient becomes the sum of the ranks' shares (once per step)."""
        for module, name, group in self.entries:
            grad = module.get_parameter(name).grad  # looked up now: data parallelism may have replaced the parameter
            if grad is not None:
                dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=group)


def find_head_parameters(part: nn.Module, col: Mapping[str, str], mesh: DeviceMesh) -> HeadGradients:
    """The per-head parameters of every module of ``part`` that holds column-parallel layers
    (``col``: their FQN -> axis, from :func:`parallel.sharding.tp_styles.classify`)."""
    out = HeadGradients()
    parents = {name.rpartition(".")[0]: axis for name, axis in col.items()}
    for name, axis in parents.items():
        module = part.get_submodule(name)
        for pname in getattr(module, HEAD_PARAMETERS, ()):
            out.entries.append((module, pname, mesh.get_group(axis)))
    return out


def norm_eps(norm: nn.Module, dtype: torch.dtype) -> float:
    """The norm's epsilon: its own ``eps``, or the dtype's machine epsilon when it has none (as torch's RMSNorm)."""
    eps = getattr(norm, "eps", None)
    return float(eps) if eps is not None else torch.finfo(dtype).eps


def rms_on_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A per-head RMSNorm of the heads ``x`` holds (over ``head_dim``, the last axis) with this rank's local
    ``weight``: statistics in fp32 at least, the result cast back, as trainer.models.layers.RMSNorm computes."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.to(xf.dtype)).type_as(x)
