"""``dry_run=true``: describe the plan without starting a worker.

The numbers come from the resolved :class:`~parallel.plan.spec.ParallelPlan` (the same stage split
and per-parameter placements the engine builds) and the model on the meta device; per rank we
count the parameters it holds after pipeline split, tensor-parallel sharding and data-parallel
sharding, the bytes of parameters,
gradients and AdamW state, the collective bytes per step on each mesh axis (analytic, ring
algorithms), the pipeline bubble, and the predicted peak memory per rank with activations
(:mod:`trainer.planner.memory.predict`) against the budget a run is checked against. Works for any mesh size,
e.g. [64, 8, 8].
"""

from __future__ import annotations

import base64
import json
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from parallel.plan.spec import ParallelPlan
from trainer.config.schema import RunConfig
from trainer.models import count_parameters, moe_config
from trainer.models.moe import expert_parameter_count
from trainer.models.skeleton import meta_model
from trainer.pictures.placement import write_placement
from trainer.pictures.timeline_chart import bubble_text, write_predicted_timeline
from trainer.planner.memory.budget import memory_budget, memory_verdict
from trainer.planner.memory.predict import predict_memory
from trainer.planner.numbers import GIB, plan_numbers

PLAN_PICTURES = Path("meshflow-plan")  # the dry run's pictures: in the working directory, beside mlflow.db


def plan_report(cfg: RunConfig, plan: ParallelPlan) -> dict:
    """:func:`~trainer.planner.numbers.plan_numbers` plus the predicted per-rank peak memory,
    activations included (:mod:`trainer.planner.memory.predict`), and the budget it is checked
    against, as plain JSON values: what the dry run prints and REST's plan endpoint returns."""
    numbers = plan_numbers(cfg, plan)
    report = asdict(numbers)
    model = meta_model(cfg.model)
    total, (experts, active_experts) = count_parameters(model), expert_parameter_count(model)
    # A token goes through top_k of each block's experts: the parameters a token's forward uses.
    report["parameters"] = {"total": total, "active": total - experts + active_experts, "experts": experts}
    report["experts"] = expert_report(cfg, plan, numbers) if experts and moe_config(cfg.model) else None
    budget, source = memory_budget(cfg)
    try:
        estimates = predict_memory(cfg, plan)
    except Exception as err:  # noqa: BLE001 - REST's plan still describes the rest; every reader says it failed
        # e.g. a stage whose tp-local output the meta pass cannot hand on: the peak is unknown, and the
        # dry run (trainer.cli.job) and plan.json say so rather than check a lower bound against the budget.
        report["memory_note"] = f"activations not predicted ({failure(err)})"
        report["memory"] = [{"pp_rank": r.pp_rank, "param_bytes": r.param_bytes, "grad_bytes": r.grad_bytes,
                             "optim_bytes": r.optim_bytes, "peak_bytes": r.state_bytes} for r in numbers.per_pp_rank]
    else:
        report["memory_note"] = None
        report["memory"] = [{"pp_rank": e.pp_rank, "peak_bytes": e.total, "param_bytes": e.params,
                             "grad_bytes": e.grads, "optim_bytes": e.optimizer, "gathered_bytes": e.gathered,
                             "activation_bytes": e.activations, "backward_bytes": e.parts.transient,
                             "process_bytes": e.process, "reserved_bytes": e.reserved,
                             "microbatches_in_flight": e.in_flight, "peak_phase": e.phase,
                             "terms_bytes": e.terms()} for e in estimates]
    report["memory_budget"] = {"bytes": budget, "source": source}
    return report


def failure(err: BaseException) -> str:
    """What a failed prediction says: the exception's kind and its first line."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:160] if lines else 'no message'}"


def expert_report(cfg: RunConfig, plan: ParallelPlan, numbers) -> dict:
    """A mixture of experts' lines of the plan: the balance loss's weight, the experts' bytes per pp rank
    (weights + grads + AdamW, after ep and dp sharding) and the bytes each rank's dispatch and combine
    all-to-alls send per step on the ep axis (0 without ep)."""
    moe = moe_config(cfg.model)
    assert moe is not None, "asked of a mixture of experts only"
    ep = plan.expert_parallel
    return {"num_experts": moe.num_experts, "top_k": moe.top_k, "aux_loss_weight": moe.aux_loss_weight,
            "ep_axis": ep.dim if ep else None, "ep_size": plan.mesh.size(ep.dim) if ep else 1,
            "all_to_all_bytes": numbers.comm.get(f"{ep.dim} all-to-all", 0.0) if ep else 0.0,
            "expert_bytes_per_pp_rank": [r.expert_bytes for r in numbers.per_pp_rank]}


def _expert_lines(e: dict) -> list[str]:
    mib = 2**20
    where = (f"split over {e['ep_axis']} ({e['ep_size']} ranks, {e['num_experts'] // e['ep_size']} experts each)"
             if e["ep_axis"] else "no ep axis: every rank runs every expert")
    lines = [f"experts: {e['num_experts']} per block, top_k {e['top_k']}, {where}; router balance loss weight "
             f"(model.moe.aux_loss_weight) {e['aux_loss_weight']:g}"]
    if e["ep_axis"]:
        per_rank = ", ".join(f"{b / mib:.2f}" for b in e["expert_bytes_per_pp_rank"])
        lines.append(f"experts per rank (weights + grads + AdamW): {per_rank} MiB by pp rank; all-to-all on "
                     f"{e['ep_axis']}: {e['all_to_all_bytes'] / mib:.2f} MiB sent per rank and step (dispatch + "
                     "combine, forward + backward, balanced routing)")
    return lines


def describe_plan(cfg: RunConfig, plan: ParallelPlan, *, pictures_dir: Path | None = PLAN_PICTURES,
                  report: dict | None = None) -> str:
    """The plan's text (memory, traffic, budget); with ``tracking.pictures`` and a pipeline it also
    writes the predicted timeline (``timeline.json`` + ``timeline.png``) into ``pictures_dir`` and
    names the files. ``report``: :func:`plan_report`'s, when the caller has it."""
    n = report if report is not None else plan_report(cfg, plan)
    mib = 2**20
    lines = [f"plan: {cfg.model.arch} model on mesh {list(cfg.mesh_shape)} ({cfg.world_size} workers), "
             f"dims {cfg.parallel.dims if cfg.parallel else []}"]
    if plan.mesh.rank_ids is not None:
        # Ids as the user wrote them: they name devices; torch's ranks are the row-major positions.
        by_rank = ", ".join(f"{r}->{plan.mesh.rank_id(r)}" for r in range(plan.mesh.world_size))
        lines.append(f"rank ids {plan.mesh.rank_ids}: each worker runs on the device (CPU: the core) its id names; "
                     f"torch rank -> id by row-major position: {by_rank}")
    params = n["parameters"]
    if params["experts"]:
        lines.append(f"parameters: {params['total']:,} in all, {params['active']:,} active per token "
                     f"(experts: {params['experts']:,}, of which each token uses top_k of num_experts)")
    else:
        lines.append(f"parameters: {params['total']:,}")
    if n.get("experts"):
        lines += _expert_lines(n["experts"])
    if n["boundaries"]:
        lines.append(f"pipeline: stages begin at {n['boundaries']}; parameters per stage {n['stage_params']}; "
                     f"bubble {n['bubble']:.1%}")
    lines.append(f"{'pp rank':>8} {'stages':>8} {'params':>12} {'weights MiB':>12} {'grads MiB':>10} {'adam MiB':>9} "
                 f"{'total MiB':>10}")
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
        lines.append(f"{m['pp_rank']:>8} {m.get('gathered_bytes', 0.0) / mib:>13.2f} "
                     f"{m.get('activation_bytes', 0.0) / mib:>16.2f} "
                     f"{m.get('microbatches_in_flight', 0):>10} {m.get('backward_bytes', 0.0) / mib:>13.2f} "
                     f"{m.get('process_bytes', 0.0) / mib:>12.2f} {m['peak_bytes'] / mib:>10.2f}")
    lines.append(f"(peak, {cfg.train.precision}: weights + grads + AdamW + gathered + the larger of backward's "
                 "worst moment "
                 "(activations + what backward adds) and the optimizer step's; process: the runtime and, on CPU, "
                 "glibc's heap holes)")
    worst = max(n["memory"], key=lambda m: m["peak_bytes"])
    if "terms_bytes" in worst and not n["memory_note"]:
        terms = ", ".join(f"{k.replace('_', ' ')} {v / GIB:.2f}" for k, v in worst["terms_bytes"].items() if v)
        lines.append(f"peak of pp rank {worst['pp_rank']} by term (GiB, at {worst['peak_phase']}): {terms}")
    verdict = memory_verdict(cfg, worst["peak_bytes"])
    said = {"fits": "fits", "may not fit": f"may not fit, within the prediction's measured error ({verdict.margin()})",
            "does not fit": "does NOT fit (a run is refused: see launch.memory_budget_gb)"}[verdict.status]
    if n["memory_note"]:  # a lower bound that fits says nothing of the peak
        said = ("NOT checked: the peak is not predicted" if verdict.status == "fits" else
                f"{said}, even the lower bound")
    lines.append(f"memory budget {budget['bytes'] / mib:,.0f} MiB per rank ({budget['source']}): {said}")
    if cfg.tracking.pictures and pictures_dir is not None and plan.pipeline is not None:
        try:
            written = write_predicted_timeline(plan, pictures_dir)
        except ValueError as err:  # torch's schedule refuses the shape (a dry run despite batch errors)
            lines.append(f"pictures: no predicted timeline ({str(err).splitlines()[0]})")
        else:
            if written is not None:  # None only without a pipeline
                paths, summary = written
                lines.append(f"pictures: predicted timeline {paths['timeline_png']} (Chrome trace "
                             f"{paths['timeline_trace']}); {bubble_text(summary, what='predicted')}")
    return "\n".join(lines)


def plan_pictures(cfg: RunConfig, plan: ParallelPlan) -> dict[str, Any]:
    """The dry run's pictures in memory, as REST's plan endpoint returns them: the placement
    picture (PNG, base64) and its slice table, and with a pipeline the predicted timeline (PNG,
    base64) and its Chrome trace. Drawn into a temporary folder, which is removed."""
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
            out.update(timeline_png=png(paths["timeline_png"]),
                       timeline=json.loads(paths["timeline_trace"].read_text()),
                       bubble_theory=summary.get("theory"))
    return out
