"""The dry run's predicted step, as ``meshflow-plan/plan.json`` and as console lines.

    text, summary = dry_run_report(cfg, plan)        # the plan's text and the prediction's JSON
    print(text)                                      # plan.json is in meshflow-plan/

Keys (the interface scripts and tests read): ``step_time_s``, ``tokens_per_s_per_device``,
``model_flops_utilization`` (the step's model FLOPs, recomputation excluded, over the devices'
datasheet peak; null on this host, whose peak no datasheet states), ``peak_memory_gib_per_device``
(the max over ranks, runtime included), ``memory_budget_gib``, ``fits`` (the peak within the budget),
``memory_terms_gib`` (the worst rank's peak by named term, adding up to the peak: see
:meth:`trainer.planner.memory.predict.MemoryEstimate.terms`, and ``peak_phase``, the moment it is at),
``memory_verdict`` (``fits``, ``may not fit``: above the budget within the prediction's measured error on
the published rows, a warning; ``does not fit``: a refusal), ``memory_margin`` (that error, the rows it
was measured on, the peak above which a layout is refused, and the warning's text), ``axes`` (per mesh axis:
the link it rides, its group, the bytes a rank sends per step, the seconds its collectives take and
the seconds left on the critical path), ``hardware``, ``nnodes``, ``devices``, ``parts_s``, a ``note``
when there is no step time to give (this host not calibrated yet) and ``errors``: each prediction that
failed, with its reason (the dry run prints the report and exits 1). A failed memory prediction leaves
``peak_memory_gib_per_device`` null and ``fits`` null (false when even ``memory_lower_bound_gib``,
weights + gradients + AdamW, exceeds the budget): never a peak nor a verdict it did not compute.

On a hardware profile the step comes from :func:`trainer.planner.cost.device.predict_on_profile`;
on this host from its cached calibration (``python -m trainer.calibrate mesh=[N]`` or a first
``+parallel=auto`` run probes it), never probed by a dry run, which stays quick.
"""

from __future__ import annotations

import json
from pathlib import Path

from parallel.plan.spec import ParallelPlan
from trainer.config.schema import RunConfig
from trainer.models.skeleton import meta_model
from trainer.planner.cost.calibration import Calibration
from trainer.planner.cost.device import ProfileStep
from trainer.planner.cost.links import group_link
from trainer.planner.forecast.pricing import HostPricing, ProfilePricing
from trainer.planner.memory.budget import PUBLISHED_MEMORY_ROWS, memory_verdict
from trainer.planner.memory.layout import on_cuda
from trainer.planner.numbers import GIB, MIB
from trainer.planner.report import PLAN_PICTURES, describe_plan, failure, plan_report

PLAN_JSON = "plan.json"


def _host_calibration(cfg: RunConfig):
    """This host's cached calibration for the run's workers, or None (a dry run never probes)."""
    # start-up: the probe's module brings the training loop; only a dry run on this host reads its cache
    from trainer.planner.calibration.probe import SCHEMA_VERSION, cache_path

    workers = max(1, cfg.world_size // cfg.launch.nnodes)
    path = cache_path(min(workers, 16), "cuda" if on_cuda(cfg) else "cpu")
    try:
        cal = Calibration.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return cal if cal.schema == SCHEMA_VERSION else None


def plan_summary(cfg: RunConfig, plan: ParallelPlan, report: dict) -> dict:
    """The prediction's JSON (see the module docstring); ``report``: the memory of ``plan_report``."""
    hw = cfg.hardware
    worst = max(report["memory"], key=lambda m: m["peak_bytes"])
    peak = worst["peak_bytes"]
    budget = report["memory_budget"]["bytes"]
    errors = [f"memory: {report['memory_note']}"] if report.get("memory_note") else []
    verdict = memory_verdict(cfg, peak)
    # Not predicted: no peak and no verdict, only the lower bound (weights, gradients, AdamW); one beyond
    # the budget does not fit whatever the activations are (beyond the measured error: refused).
    out: dict = {"hardware": hw.name, "nnodes": cfg.launch.nnodes, "devices": cfg.world_size,
                 "devices_per_node": max(1, cfg.world_size // cfg.launch.nnodes),  # the ranks one node runs
                 "step_time_s": None, "tokens_per_s": None, "tokens_per_s_per_device": None,
                 "model_flops_utilization": None, "peak_memory_gib_per_device": None if errors else peak / GIB,
                 "memory_lower_bound_gib": peak / GIB if errors else None,
                 "memory_budget_gib": budget / GIB, "fits": (False if peak > budget else None) if errors
                 else peak <= budget,
                 "memory_verdict": None if errors and verdict.status == "fits" else verdict.status,
                 "memory_margin": {"measured_error": verdict.error,
                                   "published_rows": PUBLISHED_MEMORY_ROWS if verdict.error
                                   else 0, "refused_above_gib": verdict.limit / GIB, "warning": verdict.warning()},
                 "memory_terms_gib": None, "parts_s": {}, "axes": {}, "note": None, "errors": errors}
    if "terms_bytes" in worst and not errors:
        out["memory_terms_gib"] = {"pp_rank": worst["pp_rank"], "peak_phase": worst["peak_phase"],
                                   **{k: v / GIB for k, v in worst["terms_bytes"].items()}}
    if hw.is_host:
        calibration = _host_calibration(cfg)
        if calibration is None:
            out["note"] = ("no step time: this host is not calibrated for these workers yet (python -m "
                           f"trainer.calibrate mesh=[{cfg.world_size}] probes it once, about a minute)")
            return out
        pricing: HostPricing | ProfilePricing = HostPricing(calibration)
    else:
        pricing = ProfilePricing(hw)
    model = meta_model(cfg.model)
    try:
        step = pricing.step(cfg, plan, pricing.unit_costs(cfg, plan, cfg.micro_batch_size, model), model)
    except Exception as err:  # noqa: BLE001 - recorded as an error: the dry run prints the rest and exits 1
        out["errors"].append(f"step time: not predicted ({failure(err)})")
        return out
    out.update(step_time_s=step.total_s, tokens_per_s=step.tokens_per_s,
               tokens_per_s_per_device=step.tokens_per_s / cfg.world_size,
               parts_s={"compute": step.compute_s, "bubble": step.bubble_s, "optimizer": step.optimizer_s,
                        "unitemized": step.overhead_s})
    if isinstance(step, ProfileStep):  # a GPU profile's (a host's step has no peak to measure against)
        out["model_flops_utilization"] = step.model_flops_utilization
        out["model_flops_per_step"] = step.model_flops
    exposed = getattr(step, "exposed_s", None) or step.comm_s
    for axis, seconds in step.comm_s.items():
        entry = {"sent_bytes_per_step": step.traffic.get(axis, 0.0), "seconds": seconds,
                 "exposed_s": exposed.get(axis, 0.0)}
        if not hw.is_host:
            link = group_link(plan.mesh.shape, plan.mesh.dim_names, axis.split(","), out["devices_per_node"])
            entry.update(link=link.kind, group_size=link.group_size, local=link.local, nodes=link.nodes)
        out["axes"][axis] = entry
    return out


def dry_run_report(cfg: RunConfig, plan: ParallelPlan, *, pictures_dir: Path | None = PLAN_PICTURES
                   ) -> tuple[str, dict]:
    """The dry run's text with the predicted step, and that prediction's JSON, also written as
    ``plan.json`` into ``pictures_dir`` (when not None)."""
    report = plan_report(cfg, plan)
    text = describe_plan(cfg, plan, pictures_dir=pictures_dir, report=report)
    summary = plan_summary(cfg, plan, report)
    lines = summary_lines(summary)
    if pictures_dir is not None:
        lines.append(f"plan: {write_plan_json(summary, pictures_dir)}")
    return text + "\n" + "\n".join(lines), summary


def write_plan_json(summary: dict, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / PLAN_JSON
    path.write_text(json.dumps(summary, indent=1))
    return path


def summary_lines(summary: dict) -> list[str]:
    """What the console prints of the prediction: the same numbers as plan.json."""
    where = (f"hardware {summary['hardware']}, {summary['nnodes']} node(s) x {summary['devices_per_node']} devices"
             if summary["hardware"] != "this_host" else "this host")
    lines = [f"predicted on {where}:"]
    if summary["step_time_s"] is None:  # not predicted: the note (an uncalibrated host) or the errors say why
        lines += [f"  {text}" for text in ([summary["note"]] if summary["note"] else summary["errors"])]
    else:
        mfu = summary["model_flops_utilization"]
        parts = ", ".join(f"{k} {v:.3g} s" for k, v in summary["parts_s"].items() if v)
        lines.append(f"  step {summary['step_time_s']:.3g} s ({parts}); {summary['tokens_per_s_per_device']:,.0f} "
                     f"tokens/s per device" + (f"; model FLOPs utilization {mfu:.1%}" if mfu is not None else ""))
        for axis, a in summary["axes"].items():
            link = f" over {a['link']} links ({a['group_size']} ranks: {a['local']} per node x {a['nodes']} nodes)" \
                if "link" in a else ""
            lines.append(f"  {axis}{link}: {a['sent_bytes_per_step'] / MIB:,.1f} MiB sent per step, "
                         f"{a['seconds']:.3g} s of collectives, {a['exposed_s']:.3g} s exposed")
    if summary["peak_memory_gib_per_device"] is None:
        verdict = "does NOT fit even that" if summary["fits"] is False else "not checked"
        lines.append(f"  peak memory NOT predicted (the lower bound, weights + grads + AdamW: "
                     f"{summary['memory_lower_bound_gib']:.2f} GiB per device of "
                     f"{summary['memory_budget_gib']:.2f} GiB: "
                     f"{verdict})")
    else:
        verdict = {"fits": "fits", "may not fit": "may not fit (within the prediction's measured error: goes on)",
                   "does not fit": "does NOT fit"}[summary["memory_verdict"]]
        lines.append(f"  peak memory {summary['peak_memory_gib_per_device']:.2f} GiB per device (max over ranks) of "
                     f"{summary['memory_budget_gib']:.2f} GiB: {verdict}")
    if summary["memory_margin"]["warning"]:
        lines.append(f"  {summary['memory_margin']['warning']}")
    lines += [f"  prediction FAILED: {error}" for error in summary["errors"]]
    return lines
