"""The calibration's probes of the framework around the ops (:mod:`trainer.planner.calibration.probe` runs them in
every probe worker, all at once): what an op costs inside a module's forward and backward under
autograd, what a parameter tensor costs in the optimizer step, DTensor's dispatch, and a small
decoder's real forward and backward, against which the raw fits are checked.

    op_s, optimizer_s = probe_framework(device)
    linear_s, optimizer_dtensor_s = probe_dtensor(device, workers)     # inside a process group
    efficiency = probe_reference(device) / reference_prediction(cal)
    seconds = probe_steps(device, workers)          # reference steps: ddp, fsdp, tp, pp, pp_tp
    ratios, (per_action, per_tp_collective) = step_efficiency(cal, seconds), pipeline_costs(cal, seconds)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

import torch

from parallel.plan.resolve import resolve_plan
from trainer.config.schema import RunConfig
from trainer.models import build_model, loss_fn_for
from trainer.planner.calibration.timing import MIN_SECONDS, timed, timed_together
from trainer.planner.cost.calibration import Calibration
from trainer.planner.cost.model import (
    count_calls,  # the cost model counts ops the same way (it imports this module)
    predict_step_time,
    unit_costs,
)
from trainer.planner.cost.reference import pipelined_tp_collectives, schedule_actions
from trainer.run.build import build_parallel_model
from trainer.validate.checks import validate_with_plan

# The framework probe: a stack of tiny blocks whose arithmetic is negligible, so its time per op is
# what every op of a training step pays beyond the op itself (nn.Module calls, autograd's graph and
# engine, the optimizer's per-tensor Python loop), which the raw ops of the compute probe do not see.
FRAMEWORK_WIDTH, FRAMEWORK_DEPTH = 8, 16


def probe_framework(device: torch.device) -> tuple[float, float]:
    """``(seconds per op of forward + backward, seconds per parameter tensor of the optimizer step)``
    of a stack of tiny Linear, SiLU, LayerNorm blocks trained as the trainer does (clip, AdamW with
    torch's default implementation for the device, zero_grad)."""
    from torch import nn

    w = FRAMEWORK_WIDTH
    model = nn.Sequential(*[nn.Sequential(nn.Linear(w, w), nn.SiLU(), nn.LayerNorm(w))
                            for _ in range(FRAMEWORK_DEPTH)]).to(device)
    x = torch.randn(4, w, device=device)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3)

    def passes():
        model(x).sum().backward()

    def optimizer_step():
        # Timed on its own, not as (whole step - passes): the difference of two timings is noise
        # on a loaded host (it came out negative). The gradients stay in place (zeroed, not
        # freed), so every call steps every tensor as training does.
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    calls = count_calls(passes)
    optimizer.zero_grad(set_to_none=True)
    passes_s = timed(passes)
    return passes_s / calls, timed(optimizer_step) / len(params)


# The reference pass: a small decoder's forward and backward as training runs it. The raw fits
# time each kind of op alone, hot in cache and back to back; a model interleaves them over more
# memory. The ratio of this pass's measured time to the fits' prediction for it scales every
# prediction (Calibration.compute_efficiency).
REFERENCE_MODEL = dict(arch="llama", dim=256, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden_dim=688, max_seq_len=128)
REFERENCE_BATCH = 2


def _reference():
    return RunConfig.model_validate({"model": REFERENCE_MODEL, "train": {"global_batch_size": REFERENCE_BATCH,
                                                                          "seq_len": REFERENCE_MODEL["max_seq_len"]}})


def probe_reference(device: torch.device) -> float:
    """Seconds of one forward + backward (with the loss) of the reference decoder, fp32."""
    cfg = _reference()
    model = build_model(cfg.model, device=device)
    loss_fn = loss_fn_for(cfg.model)
    x = torch.randint(0, cfg.model.vocab_size, (REFERENCE_BATCH, cfg.train.seq_len), device=device)
    return timed(lambda: loss_fn(model(x), x).backward())


def reference_prediction(cal: Calibration) -> float:
    """What ``cal``'s fits (before any efficiency) predict for :func:`_probe_reference`'s pass."""
    cfg = _reference()
    model = build_model(cfg.model, device="meta")
    costs = unit_costs(cfg, resolve_plan(None, None, model), REFERENCE_BATCH, model=model)
    raw = replace(cal, compute_efficiency=1.0)
    return sum(c.forward.seconds(raw, "fp32") + c.backward.seconds(raw, "fp32") for c in costs.values())


def probe_dtensor(device: torch.device, workers: int) -> tuple[float, float]:
    """``(extra seconds of a tiny Linear's forward + backward with a DTensor weight, seconds per
    DTensor parameter of the optimizer step)``: DTensor's dispatch, which every tensor-parallel
    matmul and every optimizer op on FSDP's or tp's sharded parameters pays (no communication:
    the weight is sharded by rows over all workers, the input replicated)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(device.type, (workers,))
    w = FRAMEWORK_WIDTH
    x = torch.randn(4, w, device=device)
    plain = nn.Parameter(torch.randn(w * workers, w, device=device))
    sharded = [nn.Parameter(distribute_tensor(torch.randn(w * workers, w, device=device), mesh, [Shard(0)]))
               for _ in range(FRAMEWORK_DEPTH)]
    plain_s = timed(lambda: torch.nn.functional.linear(x, plain).sum().backward())
    dtensor_s = timed_together(lambda: cast(DTensor, torch.nn.functional.linear(  # a linear of DTensors is one
        DTensor.from_local(x, mesh, [Replicate()]), sharded[0])).to_local().sum().backward(), MIN_SECONDS)
    for p in sharded:
        p.grad = torch.zeros_like(p)
    optimizer = torch.optim.AdamW(sharded, lr=1e-3)

    def step():
        torch.nn.utils.clip_grad_norm_(sharded, 1.0)
        optimizer.step()
        for p in sharded:  # zero_grad(set_to_none=False): the gradients must be there for the next call
            p.grad.zero_()

    # clipping all-reduces the norm over the mesh: every rank must run the same number of steps
    return max(0.0, dtensor_s - plain_s), timed_together(step, MIN_SECONDS) / len(sharded)


# The reference steps: a small decoder trained for real by the engine on every probe worker, laid
# out as each family of layouts the planner weighs (dp over all workers as ddp, as fsdp; tp over
# all workers; a pipeline of two stages, without and with tp2, dp over the rest). Measured whole
# (forward + backward with the family's hooks, redistributions and gradient buffers, clipping,
# AdamW, zero_grad, the loss all-reduce), as the training loop runs a step, and compared with what
# the cost model predicts for the same step: the per-step work the model does not itemize
# (FSDP2's and replicate's copies into and out of their buffers, DTensor's redistributions beyond
# the counted all-reduces, the loop's collectives, a schedule's per-action cost). A dp or tp layout
# pays each family's ratio to the share of the reference's degree it uses, a pipeline the fixed costs
# its references leave per schedule action and per tp all-reduce of a stage (:mod:`trainer.planner.cost.reference`).
STEP_MODEL: dict[str, Any] = dict(REFERENCE_MODEL, n_layers=4, n_heads=8, n_kv_heads=8)  # a model config
STEP_SEQUENCES_PER_RANK = 2  # the global batch is 2 sequences per worker, as the bench's 16 over 8
RATIO_FAMILIES = ("ddp", "fsdp", "tp")
PIPELINE_FAMILIES = ("pp", "pp_tp")
STEP_FAMILIES = RATIO_FAMILIES + PIPELINE_FAMILIES
# The pipelined references: two stages (the shortest pipeline, every pp degree's per-action cost
# measured alike), 1F1B, four micro-batches; ddp over the ranks left (pp_tp: the 3-D layout).
STEP_PIPELINE = {"dim": "pp", "schedule": "1F1B", "microbatches": 4}


def _reference_parallel(family: str, workers: int) -> tuple[list[int], dict] | None:
    """``(mesh, parallel)`` of ``family``'s reference step over ``workers``, or ``None``."""
    tp = {"dim": "tp", "plan": "megatron"}
    if family in RATIO_FAMILIES:
        if family == "tp":
            fits = STEP_MODEL["n_heads"] % workers == 0
            return ([workers], {"dims": ["tp"], "tensor_parallel": tp}) if fits else None
        return [workers], {"dims": ["dp"], "data_parallel": {"dim": "dp", "mode": family}}
    tp_size = 2 if family == "pp_tp" else 1
    dp_size, rest = divmod(workers, 2 * tp_size)
    if rest or dp_size < 1:
        return None
    sizes = {"dp": dp_size, "pp": 2, "tp": tp_size}
    dims = [d for d in ("dp", "pp", "tp") if sizes[d] > 1]
    parallel = {"dims": dims, "pipeline": dict(STEP_PIPELINE)}
    if dp_size > 1:
        parallel["data_parallel"] = {"dim": "dp", "mode": "ddp"}
    if tp_size > 1:
        parallel["tensor_parallel"] = tp
    return [sizes[d] for d in dims], parallel


def reference_step(family: str, workers: int):
    """``(config, plan)`` of the reference step of ``family`` on ``workers`` ranks, or ``None``
    when the family cannot lay the step model out over them (tp must divide the heads, a
    pipeline's two stages (and tp2) the workers)."""
    layout = _reference_parallel(family, workers) if workers >= 2 else None
    if layout is None:
        return None
    mesh, parallel = layout
    raw = {"model": dict(STEP_MODEL), "mesh": mesh, "parallel": parallel,
           "train": {"global_batch_size": STEP_SEQUENCES_PER_RANK * workers, "seq_len": STEP_MODEL["max_seq_len"]}}
    return validate_with_plan(raw)


def probe_steps(device: torch.device, workers: int) -> dict[str, float]:
    """Seconds of one reference step per family (inside the probe's process group; every rank
    runs the same steps). Each step is the training loop's: forward and backward over this rank's
    share of the batch, clipping, AdamW, zero_grad, the global loss."""
    out = {}
    for family in STEP_FAMILIES:
        ref = reference_step(family, workers)
        if ref is None:
            continue
        cfg, _ = ref
        pm = build_parallel_model(cfg, device)
        optimizer = torch.optim.AdamW(list(pm.parameters()), lr=1e-4)
        loss_fn = loss_fn_for(cfg.model)
        x = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch_size // pm.dp_size, cfg.train.seq_len),
                          device=device)

        def step():
            loss = pm.forward_backward(x, x, loss_fn)
            pm.clip_grad_norm_(cfg.train.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            pm.reduce_loss(loss)

        out[family] = timed_together(step, MIN_SECONDS)
    return out


def step_efficiency(cal: Calibration, measured: dict[str, float]) -> dict[str, float]:
    """Per dp or tp family: the reference step's measured seconds over what ``cal`` (without any
    step efficiency) predicts for it."""
    raw = replace(cal, step_efficiency={})  # (a ratio family's reference has no pipeline to pay for)
    out = {}
    for family, seconds in measured.items():
        if family in RATIO_FAMILIES:
            cfg, plan = reference_step(family, cal.workers)
            out[family] = seconds / predict_step_time(cfg, plan, raw).total_s
    return out


def pipeline_costs(cal: Calibration, measured: dict[str, float]) -> tuple[float, float]:
    """``(seconds per schedule action, seconds per tp all-reduce of a pipelined stage)`` beyond what
    ``cal`` (with the dp and tp ratios, without these costs) predicts: the ``pp`` reference's residue
    over its actions, then the ``pp_tp`` reference's residue beyond its actions' cost over its tp
    all-reduces (each at least 0; 0 where the probe had no such reference)."""
    raw = replace(cal, schedule_action_s=0.0, pipelined_tp_collective_s=0.0)
    action_s = tp_s = 0.0
    for family in PIPELINE_FAMILIES:  # pp first: pp_tp's residue is taken beyond pp's per-action cost
        if family not in measured:
            continue
        cfg, plan = reference_step(family, cal.workers)
        actions = schedule_actions(plan, cfg.train.grad_accum)
        residue = measured[family] - predict_step_time(cfg, plan, raw).total_s
        if family == "pp":
            action_s = max(0.0, residue) / actions
        else:
            tp_s = max(0.0, residue - actions * action_s) / pipelined_tp_collectives(plan, cfg.train.grad_accum)
    return action_s, tp_s
