"""One training step and one evaluation, as the loop (:func:`trainer.run.loop.train`) calls them.

    stats = train_step(pm, loader, loss_fn, optimizer, scheduler, cfg=cfg, device=device,
                       recorder=recorder, step=step, record=True)
    stats.loss, stats.grad_norm, stats.lr, stats.seconds, stats.figures()   # the step's global numbers
    val_loss = evaluate(pm, val_source, cfg, device)            # each validation row once

A step is ``train.grad_accum`` forward-backward passes over one global batch (each an accumulation
batch), the gradient clipped, one optimizer and one schedule step; its loss (and an MoE model's
balance loss and expert load) reduced over the ranks, so every rank holds the global figures.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from parallel.engine import ParallelModel
from parallel.pipeline.timeline import TimelineRecorder
from trainer.config.schema import RunConfig, TrainConfig
from trainer.data import Source
from trainer.data.loader import GlobalBatchLoader, ValidationRows
from trainer.models import TargetMeanLoss, eval_loss_for, moe_config
from trainer.models.moe import WithAuxLoss


@dataclass
class StepStats:
    """What one optimizer step measured, the same on every rank (reduced over them)."""

    loss: float
    grad_norm: float
    lr: float  # the rate this step used (the schedule's before its own step)
    seconds: float
    aux_loss: float | None = None  # an MoE model's balance loss, unweighted
    expert_load: dict[str, float] = field(default_factory=dict)  # tokens per expert: min, max, imbalance

    def figures(self) -> dict[str, float]:
        """The step's metrics as the log window averages them (``lr`` is logged as the window's last)."""
        figures = {"loss": self.loss, "grad_norm": self.grad_norm, "step_time_s": self.seconds}
        if self.aux_loss is not None:  # the balance loss, unweighted: its own metric (the loss includes it, weighted)
            figures["aux_loss"] = self.aux_loss
            figures.update(self.expert_load)
        return figures


def train_step(pm: ParallelModel, loader: GlobalBatchLoader, loss_fn, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, *, cfg: RunConfig, device: torch.device,
               recorder: TimelineRecorder, step: int, record: bool) -> StepStats:
    """One optimizer step over the loader's next global batch; ``record``: into the timeline."""
    train = cfg.train
    began = time.perf_counter()
    with recorder.step(step, record=record):
        local_loss, local_aux, load = _accumulate(pm, loader, loss_fn, train=train, device=device)
        with recorder.mark("optimizer"):
            grad_norm = pm.clip_grad_norm_(train.grad_clip)
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    loss = pm.reduce_loss(local_loss)
    stats = StepStats(loss=loss, grad_norm=float(grad_norm), lr=float(lr), seconds=time.perf_counter() - began)
    if local_aux is not None:  # every rank has a share of the balance loss
        stats.aux_loss = pm.reduce_loss(local_aux)
        if load is None and (moe := moe_config(cfg.model)) is not None:
            # a pipeline rank whose stages hold no MoE block still joins the sum
            load = torch.zeros(moe.num_experts, dtype=torch.float64, device=device)
        stats.expert_load = expert_load(_summed(load, pm))
    return stats


def _accumulate(pm: ParallelModel, loader: GlobalBatchLoader, loss_fn, *, train: TrainConfig,
                device: torch.device) -> tuple:
    """Forward and backward over the step's ``train.grad_accum`` accumulation batches: this rank's
    mean loss (None on a pipeline rank without the last stage), its balance loss and its expert load."""
    local_loss = local_aux = load = None
    _count_targets(getattr(loss_fn, "base", loss_fn), loader, train.global_batch_size)  # every accumulation batch's
    for index in range(train.grad_accum):
        inputs, targets, positions = _on(device, loader.next_batch())
        loss = pm.forward_backward(inputs, targets, loss_fn, loss_scale=1.0 / train.grad_accum, positions=positions,
                                   reduce_grads=index == train.grad_accum - 1)
        if loss is not None:
            local_loss = loss / train.grad_accum if local_loss is None else local_loss + loss / train.grad_accum
        if isinstance(loss_fn, WithAuxLoss):  # this rank's share of the balance loss (every rank has one)
            aux, rows = loss_fn.take()
            local_aux = aux / train.grad_accum if local_aux is None else local_aux + aux / train.grad_accum
            if rows is not None:
                load = rows if load is None else load + rows
    return local_loss, local_aux, load


def evaluate(pm: ParallelModel, val_source: Source, cfg: RunConfig, device: torch.device) -> float:
    """The validation loss: the model's loss over the validation split's targets, each row counted once
    (:class:`ValidationRows`: the first ``train.eval_batches`` batches of ``global_batch_size / grad_accum``
    rows, the whole split when it is smaller), split over the ranks as training batches are. Every target
    weighs the same, as in a training step: the sum over the targets divided once by their count."""
    t = cfg.train
    rows = ValidationRows(val_source, global_batch_size=t.global_batch_size // t.grad_accum,
                          max_batches=t.eval_batches, dp_rank=pm.dp_rank, dp_size=pm.dp_size, seed=t.seed,
                          cp_rank=pm.cp_rank, cp_size=pm.cp_size)
    loss_fn = eval_loss_for(cfg.model, chunk_tokens=t.loss_chunk_tokens)
    total = count = 0.0
    pm.train(False)
    try:
        for batch in range(len(rows)):
            targets_in_batch = rows.target_count(batch)
            # The batch's mean over its targets (as _count_targets sets it for a step), weighed by their count.
            loss_fn.tokens_per_row = max(1, targets_in_batch) / rows.global_batch_size / rows.cp_size
            inputs, targets, positions = _on(device, rows.batch(batch))
            total += pm.reduce_loss(pm.evaluate(inputs, targets, loss_fn, positions)) * targets_in_batch
            count += targets_in_batch
    finally:
        pm.train(True)
    return total / count if count else math.nan


def _count_targets(loss_fn, loader: GlobalBatchLoader, samples: int) -> None:
    """Give a :class:`TargetMeanLoss` the mean target count per row of the next ``samples`` global
    samples (a no-op for other losses: every target counts). With context parallelism a rank holds
    1 / cp of each row: the count per rank's share of a row, so that the mean of the ranks' losses
    is the sum over every target of the full rows divided once by their count."""
    if isinstance(loss_fn, TargetMeanLoss):
        loss_fn.tokens_per_row = max(1, loader.target_tokens(samples)) / samples / loader.cp_size


def _on(device: torch.device,
        batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(inputs, targets, positions or None)`` of a loader batch, on ``device``."""
    inputs, targets, *rest = (x.to(device) for x in batch)
    return inputs, targets, (rest[0] if rest else None)


def expert_load(tokens_per_expert: torch.Tensor) -> dict[str, float]:
    """The step's rows per expert (summed over the batch, averaged over the MoE blocks) as metrics: the
    least and most loaded expert's, and the imbalance max / mean (1 = balanced)."""
    mean = float(tokens_per_expert.mean())
    return {"tokens_per_expert_min": float(tokens_per_expert.min()),
            "tokens_per_expert_max": float(tokens_per_expert.max()),
            "expert_imbalance": float(tokens_per_expert.max()) / mean if mean else 1.0}


def _summed(value: torch.Tensor, pm: ParallelModel) -> torch.Tensor:
    """``value`` summed over every rank (a collective): each rank routes its own rows of the batch through
    its own stages' blocks; the ranks that repeat them (tensor parallelism) count once."""
    if pm.mesh is None:
        return value
    import torch.distributed as dist  # start-up: only a mesh of several ranks sums

    total = value.clone()
    dist.all_reduce(total)
    return total / pm.repeats
