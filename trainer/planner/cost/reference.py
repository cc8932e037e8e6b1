"""What a layout's real step takes beyond the cost model's itemized prediction, from the
calibration's reference steps (:mod:`trainer.planner.calibration.framework` trains a small decoder for real,
laid out as each family of layouts the planner weighs, and compares with the prediction).

    total = with_reference_costs(itemized_s, plan, calibration)
    # = itemized_s * layout_efficiency(plan, calibration)                     # dp and tp: a ratio
    #   + schedule_actions(plan) * calibration.schedule_action_s              # pp: per action
    #   + pipelined_tp_collectives(plan) * calibration.pipelined_tp_collective_s   # and per tp all-reduce

* Data and tensor parallelism: their unitemized work (FSDP2's and replicate's copies into and out
  of their buffers, DTensor's redistributions, the loop's collectives) grows with the step's work,
  so the reference's measured-over-predicted ratio scales the whole prediction.
* A pipeline: each schedule action (a stage's forward, backward, or zero-bubble's input and
  weight backward, of one micro-batch) pays a fixed cost the model does not itemize, and with tp in
  its stages each tp all-reduce pays one more: the stage's tp peers must all be scheduled for it
  while the other stages' ranks hold the cores. Measured here (a 3M decoder, 8 workers on 2
  cores): 5-9 ms per action whatever the pp degree, micro-batches or stages per rank (dp x pp2 m4,
  dp x pp4 m4 and m8, Interleaved v2); with tp2 or tp4, 12-26 ms per action, growing with the
  blocks (and so the all-reduces) a stage holds: two blocks of dp2 x pp2 x tp2 the most, one of
  pp4 x tp2 or of Interleaved v2 about half as much more. Fixed costs, not a ratio: the 3M sweep's
  pipelines ran 17-34% over their prediction, the 25M ones within 5%.
"""

from __future__ import annotations

import math

from parallel.config import SPLIT_BACKWARD_SCHEDULES
from parallel.plan.spec import ParallelPlan
from trainer.planner.cost.calibration import Calibration
from trainer.planner.cost.comm import tp_all_reduces_per_block

# Schedules whose backward is split in two actions per micro-batch: input (I) and weight (W) gradients.


def layout_degrees(plan: ParallelPlan) -> dict[str, int]:
    """The layout's degree in each family the calibration measures a reference step of: its dp
    size under its dp mode's family (``ddp`` for ddp and zero1, whose parameters are replicated; ``fsdp`` for
    fsdp, zero2 and hsdp: FSDP2's sharded parameters) and its tp size (the product of the axes its placements shard)."""
    out: dict[str, int] = {}
    if (dp := plan.data_parallel) is not None and (size := plan.mesh.size(dp.dim_names)) > 1:
        out["ddp" if dp.mode in ("ddp", "zero1") else "fsdp"] = size
    if (tp := tp_degree(plan)) > 1:
        out["tp"] = tp
    return out


def tp_degree(plan: ParallelPlan) -> int:
    """The product of the mesh axes the plan's placements shard a parameter over."""
    return plan.topology.tp_size


def layout_efficiency(plan: ParallelPlan, calibration: Calibration) -> float:
    """What a real step of this layout takes over the itemized prediction: the product, over the
    families it uses, of the calibration's measured reference-step ratio (taken over all the probe's
    workers) raised to the share of that degree the layout uses, ``log(degree) / log(workers)``
    (at most 1): dp4 x tp2 on 8 workers pays 2/3 of ddp's ratio in the log and 1/3 of tp's, a
    pipeline axis none (its schedule pays per action: :func:`pipeline_overhead_s`)."""
    reference = calibration.workers
    if reference < 2 or not calibration.step_efficiency:
        return 1.0
    eff = 1.0
    for family, degree in layout_degrees(plan).items():
        if (ratio := calibration.step_efficiency.get(family)) is not None:
            eff *= ratio ** min(1.0, math.log(degree) / math.log(reference))
    return eff


def schedule_actions(plan: ParallelPlan, grad_accum: int = 1) -> int:
    """The compute actions one pp rank runs per optimizer step: per micro-batch and stage it
    holds, a forward and a backward (three with a split backward); 0 without a pipeline."""
    pp = plan.pipeline
    if pp is None:
        return 0
    per_microbatch = 3 if pp.schedule in SPLIT_BACKWARD_SCHEDULES else 2
    return grad_accum * pp.num_microbatches * pp.stages_per_rank * per_microbatch


def rank_units(plan: ParallelPlan) -> list[list[str]]:
    """The units each pp rank holds (one list without a pipeline)."""
    pp = plan.pipeline
    if pp is None:
        return [list(plan.units)]
    return [[u for s in pp.stages_of(r) for u in pp.stage_units[s]] for r in range(plan.pp_size)]


def pipelined_tp_collectives(plan: ParallelPlan, grad_accum: int = 1) -> int:
    """The tp all-reduces of activations the pp rank holding the most blocks runs per step (Megatron:
    four per block and micro-batch, six when checkpointed: :func:`trainer.planner.cost.comm.tp_all_reduces_per_block`);
    0 without a pipeline or without tp."""
    pp = plan.pipeline
    if pp is None or tp_degree(plan) < 2:
        return 0
    blocks = max(sum(u in plan.blocks for u in held) for held in rank_units(plan))
    return tp_all_reduces_per_block(plan) * blocks * pp.num_microbatches * grad_accum


def pipeline_overhead_s(plan: ParallelPlan, calibration: Calibration, grad_accum: int = 1) -> float:
    """Seconds a pipelined step pays beyond the itemized prediction: its schedule actions' and its
    tp all-reduces' fixed costs (0 without a pipeline, or from a calibration that measured none)."""
    return (schedule_actions(plan, grad_accum) * calibration.schedule_action_s
            + pipelined_tp_collectives(plan, grad_accum) * calibration.pipelined_tp_collective_s)


def with_reference_costs(itemized_s: float, plan: ParallelPlan, calibration: Calibration,
                         grad_accum: int = 1) -> float:
    """The step time of a layout whose itemized prediction is ``itemized_s``: scaled by its
    families' reference ratios, plus its pipeline's fixed costs."""
    return itemized_s * layout_efficiency(plan, calibration) + pipeline_overhead_s(plan, calibration, grad_accum)
