"""Pipeline parallelism: FQN-preserving stage split and torch.distributed.pipelining schedules.

A model is cut between its *units*, the top-level pieces in forward order (``pipeline_units``:
``tok_embeddings, layers.0, .., layers.<n-1>, norm, output``; for the seeds' MLP the raw
parameters ``w0, w1``). Each stage is a copy of the full model with the other units removed
(modules set to ``None``, blocks deleted from their ``ModuleDict``), so a parameter keeps its
FQN on every stage and checkpoints load across pipeline sizes.

    stages = split_stages(model, plan.pipeline, units=plan.units, pp_rank=r)   # [(index, module)]
    schedule = build_schedule(stages, schedule="1F1B", microbatches=4, loss_fn=loss_fn,
                              num_stages=2, pp_group=mesh["pp"].get_group(), device="cpu")

Stages go to ranks loop-style (stage ``s`` on pp rank ``s % pp_size``) for GPipe, 1F1B and
the interleaved schedules, V-style for ZBV (rank ``r`` holds ``r`` and ``2 * pp_size - 1 - r``).
The schedule calls ``loss_fn`` once per micro-batch. The schedules' own ``scale_grads=True``
divides the *accumulated* ``.grad`` by the number of micro-batches after every ``step``, which
also rescales gradients left by an earlier accumulation step; so ``build_schedule`` turns it
off and the caller's ``loss_fn`` divides by the number of micro-batches itself (the engine
does), which gives the gradients of the mean loss over the batch under accumulation too. Tensor shapes between stages
are inferred at run time by ``PipelineStage`` (torch >= 2.13), so no example inputs are needed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from parallel.config import MULTI_STAGE_SCHEDULES, ScheduleName
from parallel.plan.spec import PipelineSpec

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineSchedule


class RawParameterStage(nn.Module):
    """A stage made of raw top-level parameters of a matmul-chain model (the seeds' MLP,
    ``act(x @ w0) @ w1``): holds each parameter under its original name and applies
    ``x = x @ p``, then the model's ``activation`` after every parameter but the model's last.

    The model-specific part is only that convention: a raw top-level parameter is one matmul
    of a chain, and ``model.activation`` (identity if absent) sits between the matmuls.
    """

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        super().__init__()
        chain = [n for n, _ in model.named_parameters(recurse=False)]
        self._names = list(names)
        self._activate = [chain.index(n) < len(chain) - 1 for n in self._names]
        self.activation = getattr(model, "activation", None)
        for name in self._names:
            self.register_parameter(name, nn.Parameter(model.get_parameter(name).detach().clone()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name, activate in zip(self._names, self._activate):
            x = torch.matmul(x, getattr(self, name))
            if activate and self.activation is not None:
                x = self.activation(x)
        return x


def build_stage_module(model: nn.Module, units: Sequence[str], all_units: Sequence[str]) -> nn.Module:
    """A copy of ``model`` that keeps only ``units`` (FQNs unchanged)."""
    raw = {n for n, _ in model.named_parameters(recurse=False)}
    if raw & set(all_units):
        if not set(units) <= raw or any(True for _ in model.children()):
            raise ValueError("a model mixing raw top-level parameters and submodules cannot be split into stages")
        return RawParameterStage(model, units)
    stage = copy.deepcopy(model)
    keep = set(units)
    for unit in all_units:
        if unit in keep:
            continue
        parent_name, _, child = unit.rpartition(".")
        parent = stage.get_submodule(parent_name)
        if isinstance(parent, nn.ModuleList):
            # Deleting from a list renumbers the blocks after it, which renames their parameters.
            raise ValueError(f"{parent_name or 'the model'} holds its blocks in an nn.ModuleList, which a pipeline "
                             "cannot split without renaming them: hold them in an nn.ModuleDict keyed '0'..'n-1' "
                             "(as the built-in decoder does), or train without parallel.pipeline")
        if isinstance(parent, nn.ModuleDict):
            del parent[child]
        else:
            # None, not delattr: the model's forward skips a missing piece (`getattr(..., None)`).
            setattr(parent, child, None)
    return stage


def split_stages(model: nn.Module, pipeline: PipelineSpec, *, units: Sequence[str],
                 pp_rank: int) -> list[tuple[int, nn.Module]]:
    """``[(stage_index, stage_module), ...]`` for the stages pp rank ``pp_rank`` holds (as the
    plan's resolved split says), in increasing stage order."""
    return [(s, build_stage_module(model, pipeline.stage_units[s], units)) for s in pipeline.stages_of(pp_rank)]


def build_schedule(
    stages: Sequence[tuple[int, nn.Module]],
    *,
    schedule: ScheduleName,
    microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    num_stages: int,
    pp_group: torch.distributed.ProcessGroup | None,
    device: torch.device | str,
    stage_to_group_rank: dict[int, int] | None = None,
) -> _PipelineSchedule:
    """A torch pipelining schedule over this rank's ``stages``; ``step(inputs, target=...,
    losses=[])`` then runs forward and backward of all micro-batches.

    ``scale_grads=False``: ``loss_fn`` must already be divided by ``microbatches`` for the
    gradients to be those of the batch mean (see the module docstring for why).
    ``stage_to_group_rank``: stage index -> ``pp_group`` rank of its holder, when that is not
    the stage's position (per-stage layouts: a lane's ranks need not increase with the stage).
    """
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    classes: dict[str, Callable[..., _PipelineSchedule]] = {
        "GPipe": ScheduleGPipe,
        "1F1B": Schedule1F1B,
        "Interleaved1F1B": ScheduleInterleaved1F1B,
        "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
        "ZBV": ScheduleZBVZeroBubble,
    }
    if schedule not in classes:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {sorted(classes)}")
    device = torch.device(device)
    pipeline_stages = [
        PipelineStage(module, index, num_stages, device, group=pp_group) for index, module in stages
    ]
    if schedule in MULTI_STAGE_SCHEDULES:
        return classes[schedule](pipeline_stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    if len(pipeline_stages) != 1:
        raise ValueError(f"{schedule} runs one stage per rank, got {len(pipeline_stages)}; use an interleaved schedule")
    built = classes[schedule](pipeline_stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    if stage_to_group_rank is not None:  # after the schedule: a one-stage schedule keeps the stage's own mapping
        pipeline_stages[0].stage_index_to_group_rank = dict(stage_to_group_rank)
    return built
