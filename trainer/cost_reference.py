"""What a layout's real step takes beyond the cost model's itemized prediction, from the
calibration's reference steps (:mod:`trainer.calibrate_work` trains a small decoder for real,
laid out as each family of layouts the planner weighs, and compares with the prediction).

    total = unitemized(itemized_s, plan, calibration)
    = itemized_s * layout_efficiency(plan, calibration)                       # dp and tp: a ratio
      + schedule_actions(plan) * action_seconds(plan, calibration)            # pp: per action

* Data and tensor parallelism: their unitemized work (FSDP2's and replicate's copies into and out
  of their buffers, DTensor's redistributions, the loop's collectives) grows with the step's work,
  so the reference's measured-over-predicted ratio scales the whole prediction.
* A pipeline: each schedule action (a stage's forward, backward, or zero-bubble's input and
  weight backward, of one micro-batch) pays a fixed cost the model does not itemize. Measured
  here (a 3M decoder, 8 workers on 2 cores): 5-9 ms per action whatever the pp degree, micro-batches
  or stages per rank (dp x pp2 m4, dp x pp4 m4 and m8, Interleaved v2), 12-26 ms with tp in the
  stage (pp x tp2, pp2 x tp4, dp2 x pp2 x tp2): the stage's tp peers must all be scheduled for
  each of its collectives while the other stages' ranks hold the cores. A fixed cost, not a ratio:
  the 3M sweep's pipelines ran 17-34% over their prediction, the 25M ones within 5%.
"""

from __future__ import annotations

import math

from parallel.plan import ParallelPlan
from trainer.calibrate import Calibration

# Schedules whose backward is split in two actions per micro-batch: input (I) and weight (W) gradients.
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBV")


def layout_degrees(plan: ParallelPlan) -> dict[str, int]:
    """The layout's degree in each family the calibration measures a reference step of: its dp
    size under its dp mode's family (``ddp``; ``fsdp`` for fsdp, zero2 and hsdp: FSDP2's
    sharded parameters) and its tp size (the product of the axes its placements shard)."""
    out: dict[str, int] = {}
    if (dp := plan.data_parallel) is not None and (size := plan.mesh.size(dp.dim_names)) > 1:
        out["ddp" if dp.mode == "ddp" else "fsdp"] = size
    if (tp := tp_degree(plan)) > 1:
        out["tp"] = tp
    return out


def tp_degree(plan: ParallelPlan) -> int:
    """The product of the mesh axes the plan's placements shard a parameter over."""
    axes = {a for by_axis in plan.placements.values() for a, pl in by_axis.items() if pl.is_shard}
    return math.prod(plan.mesh.size(a) for a in axes)


def layout_efficiency(plan: ParallelPlan, calibration: Calibration) -> float:
    """What a real step of this layout takes over the itemized prediction: the product, over the
    families it uses, of the calibration's measured reference-step ratio (taken over all the probe's
    workers) raised to the share of that degree the layout uses, ``log(degree) / log(workers)``
    (at most 1): dp4 x tp2 on 8 workers pays 2/3 of ddp's ratio in the log and 1/3 of tp's, a
    pipeline axis none (its schedule pays per action: :func:`action_seconds`)."""
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


def action_family(plan: ParallelPlan) -> str:
    """The calibration's pipeline reference this layout's actions are priced by: ``pp_tp`` for
    stages whose parameters tp shards, else ``pp``."""
    return "pp_tp" if tp_degree(plan) > 1 else "pp"


def action_seconds(plan: ParallelPlan, calibration: Calibration) -> float:
    """Seconds each schedule action pays beyond the itemized prediction (0 without a pipeline, or
    from a calibration that measured none; a missing ``pp_tp`` reference falls back to ``pp``)."""
    if plan.pipeline is None:
        return 0.0
    measured = calibration.schedule_action_s
    return measured.get(action_family(plan), measured.get("pp", 0.0))


def unitemized(itemized_s: float, plan: ParallelPlan, calibration: Calibration, grad_accum: int = 1) -> float:
    """The step time of a layout whose itemized prediction is ``itemized_s``: scaled by its
    families' reference ratios, plus its schedule actions' fixed cost."""
    return (itemized_s * layout_efficiency(plan, calibration)
            + schedule_actions(plan, grad_accum) * action_seconds(plan, calibration))
