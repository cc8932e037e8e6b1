"""``dry_run=true``: describe the plan without starting a worker.

The numbers come from the resolved :class:`~parallel.plan.resolve.ParallelPlan` (the same stage split
and per-parameter placements the engine builds) and the model on the meta device; per rank we
count the parameters it holds after pipeline split, tensor-parallel sharding and data-parallel
sharding, the bytes of parameters,
gradients and AdamW state, the collective bytes per step on each mesh axis (analytic, ring
algorithms), the pipeline bubble, and the predicted peak memory per rank with activations
(:mod:`trainer.planner.memory.predict`) against the budget a run is checked against. Works for any mesh size,
e.g. [64, 8, 8].
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from parallel.pipeline.order import expected_bubble
from parallel.plan.resolve import ParallelPlan
from trainer.config.schema import RunConfig
from trainer.models import decoder_config

BYTES = 4  # fp32 master weights, gradients and AdamW state
PLAN_PICTURES = Path("meshflow-plan")  # the dry run's pictures: in the working directory, beside mlflow.db


def _unit_of(fqn: str, units: list[str]) -> str:
    for unit in units:
        if fqn == unit or fqn.startswith(unit + "."):
            return unit
    raise KeyError(fqn)


def stage_views(cfg: RunConfig, plan: ParallelPlan) -> list[tuple[RunConfig, ParallelPlan]]:
    """Per-stage layouts (``parallel.pipeline.stages``): for each stage, the config and plan in
    which every stage has that stage's layout (mesh ``[stages, *its sub-mesh]``). Stage ``i``'s
    numbers in view ``i`` (parameters held, communication, memory) are the stage's own, so the
    uniform arithmetic serves both forms."""
    from parallel.config import ParallelConfig
    from parallel.plan.resolve import resolve_plan
    from trainer.models import build_model

    model = build_model(cfg.model, device="meta")
    par, pp = cfg.parallel, cfg.parallel.pipeline
    views = []
    for stage in pp.stages:
        view = ParallelConfig(dims=[pp.dim, *stage.dims], data_parallel=stage.data_parallel,
                              tensor_parallel=stage.tensor_parallel, placements=stage.placements, layouts=stage.layouts,
                              pipeline=pp.model_copy(update={"stages": None}),
                              activation_checkpointing=par.activation_checkpointing,
                              activation_checkpointing_every=par.activation_checkpointing_every)
        view_cfg = cfg.model_copy(update={"mesh": [len(pp.stages), *stage.shape], "parallel": view})
        views.append((view_cfg, resolve_plan(view, view_cfg.mesh, model)))
    return views


def plan_numbers(cfg: RunConfig, plan: ParallelPlan, *, model=None) -> dict:
    """The per-rank numbers a dry run prints; also used by tests. ``model``: the config's model on
    the meta device when the caller has it (a planner builds it once), else built here."""
    from trainer.models import build_model

    if plan.pipeline is not None and plan.pipeline.stages:
        return _stage_numbers(cfg, plan)

    model = model if model is not None else build_model(cfg.model, device="meta")
    units = list(plan.units)
    pp = plan.pipeline
    num_stages = pp.num_stages if pp else 1
    groups, owner = (pp.stage_units, pp.stage_ranks) if pp else ([units], [0])
    stage_of = {unit: s for s, group in enumerate(groups) for unit in group}
    bounds = pp.boundaries if pp else []

    # ddp shards over no axis (size 1); fsdp / zero2 over every dp axis, hsdp over its inner one.
    shard_dp = plan.mesh.size(plan.data_parallel.shard_dim_names) if plan.data_parallel else 1
    stage_params = [0] * num_stages
    stage_local = [0.0] * num_stages
    for fqn, p in model.named_parameters():
        axes = plan.placements.get(fqn, {})
        tp_div = math.prod(plan.mesh.size(a) for a, pl in axes.items() if pl.is_shard)
        s = stage_of[_unit_of(fqn, units)]
        stage_params[s] += p.numel()
        stage_local[s] += p.numel() / tp_div

    spr = pp.stages_per_rank if pp else 1
    per_rank = []
    for r in range(cfg.pp_size):
        stages = [s for s in range(num_stages) if owner[s] == r]
        local = sum(stage_local[s] for s in stages)
        sharded = local / shard_dp  # weights, gradients and each AdamW moment
        per_rank.append({"pp_rank": r, "stages": stages, "params": int(local),
                         "param_bytes": sharded * BYTES, "grad_bytes": sharded * BYTES, "optim_bytes": 2 * sharded * BYTES})

    m = cfg.num_microbatches
    # (p-1)/(m+p-1), over v for interleaving; the zero-bubble schedules' own (parallel.pipeline.order).
    bubble = expected_bubble(pp.schedule, pp_size=cfg.pp_size, stages_per_rank=spr, microbatches=m) if pp else 0.0
    comm = _comm_bytes(cfg, plan, per_rank)
    return {"stage_params": stage_params, "boundaries": bounds, "per_pp_rank": per_rank, "bubble": bubble, "comm": comm}


def _stage_numbers(cfg: RunConfig, plan: ParallelPlan) -> dict:
    """:func:`plan_numbers` of per-stage layouts: each stage's row from its own view; the
    communication per axis named ``stage <i> <axis>``."""
    views = [plan_numbers(view_cfg, view_plan) for view_cfg, view_plan in stage_views(cfg, plan)]
    comm = {}
    for index, numbers in enumerate(views):
        comm.update({f"stage {index} {axis}": nbytes for axis, nbytes in numbers["comm"].items()
                     if axis != plan.pipeline.dim})
        comm[plan.pipeline.dim] = numbers["comm"].get(plan.pipeline.dim, 0.0)
    return {**views[0], "per_pp_rank": [numbers["per_pp_rank"][i] for i, numbers in enumerate(views)], "comm": comm}


def _comm_bytes(cfg: RunConfig, plan: ParallelPlan, per_rank: list[dict]) -> dict[str, float]:
    """Bytes each rank sends per optimizer step on each mesh axis (ring collectives)."""
    par = cfg.parallel
    out: dict[str, float] = {}
    if par is None:
        return out
    local = max(r["params"] for r in per_rank) * BYTES
    if dp := par.data_parallel:
        n = cfg.dp_size
        ring = 2 * (n - 1) / n
        # ddp: all-reduce of grads; fsdp: all-gather fwd + all-gather bwd + reduce-scatter;
        # zero2: one all-gather + reduce-scatter; each all-gather/reduce-scatter moves (n-1)/n.
        factor = {"ddp": ring, "fsdp": 3 * (n - 1) / n, "zero2": 2 * (n - 1) / n, "hsdp": 3 * (n - 1) / n}[dp.mode]
        out[",".join(dp.dim_names)] = factor * local * cfg.train.grad_accum ** (dp.mode == "fsdp")
    tokens = cfg.train.global_batch_size // max(1, cfg.dp_size) * cfg.train.seq_len
    if (decoder := decoder_config(cfg.model)) is not None:
        act = tokens * decoder.dim * (2 if cfg.train.precision == "bf16" else BYTES)  # activations in compute precision
        layers_per_rank = decoder.n_layers / cfg.pp_size
        for axis in {a for axes in plan.placements.values() for a in axes}:
            n = cfg.axis_size(axis)
            # Megatron: 2 all-reduces per block forward and 2 backward.
            out[axis] = 4 * layers_per_rank * act * 2 * (n - 1) / n
        if pp := par.pipeline:
            out[pp.dim] = 2 * act * pp.stages_per_rank  # activations forward + gradients backward
    return out


def plan_report(cfg: RunConfig, plan: ParallelPlan) -> dict:
    """:func:`plan_numbers` plus the predicted per-rank peak memory, activations included
    (:mod:`trainer.planner.memory.predict`), and the budget it is checked against: what the dry run prints and
    REST's plan endpoint returns."""
    from trainer.planner.memory.predict import predict_memory
    from trainer.planner.memory.budget import memory_budget

    numbers = plan_numbers(cfg, plan)
    budget, source = memory_budget(cfg)
    try:
        estimates = predict_memory(cfg, plan)
    except Exception as err:  # noqa: BLE001 - e.g. a stage whose tp-local output the meta pass cannot hand on
        numbers["memory_note"] = f"activations not predicted ({type(err).__name__}: {str(err).splitlines()[0][:120]})"
        numbers["memory"] = [{"pp_rank": r["pp_rank"], "param_bytes": r["param_bytes"], "grad_bytes": r["grad_bytes"],
                              "optim_bytes": r["optim_bytes"],
                              "peak_bytes": r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]}
                             for r in numbers["per_pp_rank"]]
    else:
        numbers["memory_note"] = None
        numbers["memory"] = [{"pp_rank": e.pp_rank, "peak_bytes": e.total, "param_bytes": e.params,
                              "grad_bytes": e.grads, "optim_bytes": e.optimizer, "gathered_bytes": e.gathered,
                              "activation_bytes": e.activations, "backward_bytes": e.parts.get("transient", 0.0),
                              "process_bytes": e.parts.get("runtime", 0.0) + e.parts.get("allocator", 0.0),
                              "microbatches_in_flight": e.in_flight} for e in estimates]
    numbers["memory_budget"] = {"bytes": budget, "source": source}
    return numbers


def describe_plan(cfg: RunConfig, plan: ParallelPlan, *, pictures_dir: Path | None = PLAN_PICTURES) -> str:
    """The dry run's text; with ``tracking.pictures`` and a pipeline it also writes the predicted
    timeline (``timeline.json`` + ``timeline.png``) into ``pictures_dir`` and names the files."""
    n = plan_report(cfg, plan)
    mib = 2**20
    lines = [f"plan: {cfg.model.arch} model on mesh {list(cfg.mesh_shape)} ({cfg.world_size} workers), "
             f"dims {cfg.parallel.dims if cfg.parallel else []}"]
    if plan.mesh.rank_ids is not None:
        # Ids as the user wrote them: they name devices; torch's ranks are the row-major positions.
        by_rank = ", ".join(f"{r}->{plan.mesh.rank_id(r)}" for r in range(plan.mesh.world_size))
        lines.append(f"rank ids {plan.mesh.rank_ids}: each worker runs on the device (CPU: the core) its id names; "
                     f"torch rank -> id by row-major position: {by_rank}")
    if n["boundaries"]:
        lines.append(f"pipeline: stages begin at {n['boundaries']}; parameters per stage {n['stage_params']}; "
                     f"bubble {n['bubble']:.1%}")
    lines.append(f"{'pp rank':>8} {'stages':>8} {'params':>12} {'weights MiB':>12} {'grads MiB':>10} {'adam MiB':>9} {'total MiB':>10}")
    for r in n["per_pp_rank"]:
        total = r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]
        lines.append(f"{r['pp_rank']:>8} {str(r['stages']):>8} {r['params']:>12,} {r['param_bytes'] / mib:>12.2f} "
                     f"{r['grad_bytes'] / mib:>10.2f} {r['optim_bytes'] / mib:>9.2f} {total / mib:>10.2f}")
    for axis, nbytes in n["comm"].items():
        lines.append(f"comm per step on {axis}: {nbytes / mib:.2f} MiB sent per rank")
    budget = n["memory_budget"]
    if n["memory_note"]:
        lines.append(f"memory: {n['memory_note']}; weights + grads + AdamW only, a lower bound:")
    lines.append(f"{'pp rank':>8} {'gathered MiB':>13} {'activations MiB':>16} {'in flight':>10} {'backward MiB':>13} "
                 f"{'process MiB':>12} {'peak MiB':>10}")
    for m in n["memory"]:
        lines.append(f"{m['pp_rank']:>8} {m.get('gathered_bytes', 0.0) / mib:>13.2f} {m.get('activation_bytes', 0.0) / mib:>16.2f} "
                     f"{m.get('microbatches_in_flight', 0):>10} {m.get('backward_bytes', 0.0) / mib:>13.2f} "
                     f"{m.get('process_bytes', 0.0) / mib:>12.2f} {m['peak_bytes'] / mib:>10.2f}")
    lines.append(f"(peak, {cfg.train.precision}: weights + grads + AdamW + gathered + the larger of backward's worst moment "
                 "(activations + what backward adds) and the optimizer step's; process: the runtime and, on CPU, "
                 "glibc's heap holes)")
    worst = max(m["peak_bytes"] for m in n["memory"])
    verdict = "fits" if worst <= budget["bytes"] else "does NOT fit (a run is refused: see launch.memory_budget_gb)"
    lines.append(f"memory budget {budget['bytes'] / mib:,.0f} MiB per rank ({budget['source']}): {verdict}")
    if cfg.tracking.pictures and pictures_dir is not None and plan.pipeline is not None:
        from trainer.tracking.pictures.timeline_chart import bubble_text, write_predicted_timeline

        try:
            paths, summary = write_predicted_timeline(plan, pictures_dir)
        except ValueError as err:  # torch's schedule refuses the shape (a dry run despite batch errors)
            lines.append(f"pictures: no predicted timeline ({str(err).splitlines()[0]})")
        else:
            lines.append(f"pictures: predicted timeline {paths['timeline_png']} (Chrome trace {paths['timeline_trace']}); "
                         f"{bubble_text(summary, what='predicted')}")
    return "\n".join(lines)


def plan_pictures(cfg: RunConfig, plan: ParallelPlan) -> dict[str, Any]:
    """The dry run's pictures in memory, as REST's plan endpoint returns them: the placement
    picture (PNG, base64) and its slice table, and with a pipeline the predicted timeline (PNG,
    base64) and its Chrome trace. Drawn into a temporary folder, which is removed."""
    import base64
    import json
    import tempfile

    from trainer.tracking.pictures.placement import write_placement
    from trainer.tracking.pictures.timeline_chart import write_predicted_timeline

    def png(path: Path) -> str:
        return base64.b64encode(path.read_bytes()).decode()

    with tempfile.TemporaryDirectory(prefix="meshflow-plan-") as tmp:
        placement = write_placement(cfg, plan, tmp)
        out: dict[str, Any] = {"placement_png": png(placement["png"]),
                               "placement": json.loads(placement["json"].read_text())}
        try:
            timeline = write_predicted_timeline(plan, Path(tmp))
        except ValueError:  # torch's schedule refuses the shape: the plan says so elsewhere
            timeline = None
        if timeline is not None:
            paths, summary = timeline
            out.update(timeline_png=png(paths["timeline_png"]), timeline=json.loads(paths["timeline_trace"].read_text()),
                       bubble_theory=summary.get("theory"))
    return out
