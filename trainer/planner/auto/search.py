"""The auto-planner's search (:mod:`trainer.planner.auto.plan`): enumerate, validate, bound, predict, rank.

    search = Search(raw, base_cfg, AutoPlanConfig(), world=8, pricing=HostPricing(cal))
    candidates = search.run()           # ranked; candidates[0] is the choice when one fits

One meta model serves every candidate; the meta passes (the work per unit of
:func:`trainer.planner.cost.model.unit_costs`, the saved activations of :func:`trainer.planner.memory.predict.predict_memory`)
are cached by what they depend on, so a search of thousands of layouts runs a handful of them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from typing import Any

from parallel.config import INTERLEAVED_SCHEDULES, AutoPlanConfig
from parallel.context import supports_context_parallel
from parallel.errors import ConfigError
from parallel.plan.resolve import resolve_plan
from parallel.plan.spec import ParallelPlan
from trainer.config.schema import RunConfig
from trainer.models import build_model, decoder_config
from trainer.planner.auto.ranking import Candidate
from trainer.planner.calibration.probe import bf16_supported
from trainer.planner.cost.comm import unit_params
from trainer.planner.cost.model import unit_costs
from trainer.planner.forecast.pricing import HostPricing, ProfilePricing
from trainer.planner.memory.budget import memory_budget
from trainer.planner.memory.layout import checkpointed, core_recomputed, on_cuda
from trainer.planner.memory.predict import predict_memory
from trainer.planner.numbers import GIB, plan_numbers
from trainer.validate.checks import check_structure
from trainer.validate.model_checks import _check_heads


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class Search:
    def __init__(self, raw: dict, base: RunConfig, knobs: AutoPlanConfig, world: int,
                 pricing: HostPricing | ProfilePricing) -> None:
        self.raw, self.base, self.knobs, self.world, self.pricing = raw, base, knobs, world, pricing
        self.model = build_model(base.model, device="meta")  # the only model this search builds
        self.decoder = decoder_config(base.model)
        self.budget, self.budget_source = memory_budget(base.model_copy(update={"mesh": [world]}))
        self._costs: dict = {}
        self._memory: dict = {}
        self._params: dict = {}
        self._flops: dict = {}
        self._failed: dict[tuple, str] = {}  # a section's failure -> the reason (see validate)
        self._plans: dict[tuple, ParallelPlan] = {}  # a parallel section (less its checkpointing) -> its plan

    # ------------------------------------------------------------------ enumeration

    def layouts(self) -> Iterator[tuple[str, list[int], dict[str, Any], str]]:
        """``(label, mesh, parallel section, precision)`` of every candidate the knobs allow."""
        k, t = self.knobs, self.base.train
        tp_ok = k.tensor_parallel and hasattr(self.model, "parallel_plan")
        precisions = [p for p in (k.precisions or [t.precision]) if p == "fp32" or self._bf16()]
        acs = [a for a in k.activation_checkpointing if a == "none" or self.decoder is not None]
        for tp in (divisors(self.world) if tp_ok else [1]):
            for cp in self._cp_sizes(self.world // tp):
                # A pipeline with cp, and experts with cp, are not searched: cp layouts are dp x cp x tp.
                for pp in (divisors(self.world // tp) if k.pipeline and cp == 1 else [1]):
                    for ep in (self._ep_sizes(self.world // tp // pp) if cp == 1 else [1]):
                        dp = self.world // tp // pp // cp // ep
                        for dp_name, dp_section in self._dp_options(dp, ep):
                            for pp_name, pipeline in self._pipelines(pp, dp * ep):
                                for ac in acs:
                                    for precision in precisions:
                                        yield self._candidate(dp, dp_name, dp_section, pp, pp_name, pipeline, tp, ep,
                                                              ac, precision, cp=cp)

    def _ep_sizes(self, ranks: int) -> list[int]:
        """Expert-parallel sizes: 1, and for a model with experts every divisor of ``ranks`` that splits
        its experts evenly (a dense model: 1 only)."""
        moe = self.decoder.moe if self.decoder is not None else None
        if moe is None or not self.knobs.expert_parallel or not hasattr(self.model, "expert_modules"):
            return [1]
        return [e for e in divisors(ranks) if moe.num_experts % e == 0]

    def _cp_sizes(self, ranks: int) -> list[int]:
        """The cp sizes to consider: 1, and from ``knobs.context_parallel_from`` tokens on every divisor of
        ``ranks`` that cuts the rows into ``2 x cp`` chunks, for a model whose attention takes a split sequence."""
        start, seq_len = self.knobs.context_parallel_from, self.base.train.seq_len
        if start is None or seq_len < start or not supports_context_parallel(self.model):
            return [1]
        return [cp for cp in divisors(ranks) if seq_len % (2 * cp) == 0]

    def _bf16(self) -> bool:
        if isinstance(self.pricing, ProfilePricing):
            return "bf16" in self.pricing.profile.peak_tflops
        return bf16_supported(_device(self.base))

    def _dp_options(self, dp: int, ep: int = 1) -> Iterator[tuple[str, dict | None]]:
        if dp == 1:
            yield "", None
            return
        for mode in self.knobs.data_parallel_modes:
            if ep > 1 and mode not in ("fsdp", "zero2"):  # experts over ep compose with sharded data parallelism
                continue
            if mode == "hsdp":
                for replicate in divisors(dp)[1:-1]:
                    yield f"dp{replicate}x{dp // replicate}(hsdp)", {"dim": ["dp_replicate", "dp_shard"], "mode": "hsdp"}
            else:
                yield f"dp{dp}({mode})", {"dim": "dp", "mode": mode}

    def _pipelines(self, pp: int, dp: int) -> Iterator[tuple[str, dict | None]]:
        if pp == 1:
            yield "", None
            return
        t = self.base.train
        per_rank = t.global_batch_size // dp // t.grad_accum if t.global_batch_size % (dp * t.grad_accum) == 0 else 0
        counts = self.knobs.microbatches or [m for m in divisors(per_rank) if m <= self.knobs.max_microbatches] or [pp]
        for schedule in self.knobs.schedules:
            spr_options = self.knobs.stages_per_rank if schedule in INTERLEAVED_SCHEDULES else \
                [2] if schedule == "ZBV" else [1]
            for spr in spr_options:
                for m in counts:
                    name = f"pp{pp}({schedule}{f' v{spr}' if spr > 1 else ''}, m{m})"
                    yield name, {"dim": "pp", "schedule": schedule, "microbatches": m, "stages_per_rank": spr,
                                 "boundaries": "auto"}

    def _candidate(self, dp, dp_name, dp_section, pp, pp_name, pipeline, tp, ep, ac, precision, cp=1) -> Candidate:
        dims, mesh = [], []
        if dp_section is not None:
            sizes = [(a, s) for a, s in (zip(dp_section["dim"], _hsdp_sizes(dp_name)) if dp_section["mode"] == "hsdp"
                                         else [("dp", dp)])]
            dims += [a for a, _ in sizes]
            mesh += [s for _, s in sizes]
        if cp > 1:
            dims.append("cp"), mesh.append(cp)
        if pipeline is not None:
            dims.append("pp"), mesh.append(pp)
        if ep > 1:
            dims.append("ep"), mesh.append(ep)
        if tp > 1:
            dims.append("tp"), mesh.append(tp)
        parallel: dict[str, Any] = {"dims": dims or ["dp"], "activation_checkpointing": ac}
        if dp_section is not None:
            parallel["data_parallel"] = dp_section
        elif not dims:  # one rank: a dp axis of size 1 keeps the section ordinary
            parallel["data_parallel"] = {"dim": "dp", "mode": "ddp"}
        if pipeline is not None:
            parallel["pipeline"] = pipeline
        if ep > 1:
            parallel["expert_parallel"] = {"dim": "ep"}
        if tp > 1:
            parallel["tensor_parallel"] = {"dim": "tp", "plan": "megatron"}
        if cp > 1:
            parallel["context_parallel"] = {"dim": "cp", "method": "ring"}
        label = " x ".join(p for p in (dp_name, f"cp{cp}" if cp > 1 else "", pp_name, f"ep{ep}" if ep > 1 else "",
                                       f"tp{tp}" if tp > 1 else "")
                           if p) or "one rank"
        label += (f", AC {ac}" if ac != "none" else "") + (", bf16" if precision == "bf16" else "")
        return Candidate(label=label, mesh=mesh or [1], parallel=parallel, precision=precision)

    # ------------------------------------------------------------------ validation

    def validate(self, c: Candidate) -> tuple[RunConfig, ParallelPlan] | None:
        """The candidate's config and plan, or None with ``c.reason`` saying why it is invalid: the
        structural checks every config meets, then the placements and boundaries on the model."""
        keys = _section_keys(c)
        if self._known_failure(c, "structure", keys):
            return None
        raw = {**self.raw, "mesh": c.mesh, "parallel": c.parallel,
               "train": {**(self.raw.get("train") or {}), "precision": c.precision}}
        cfg = RunConfig.model_validate(raw)
        stage, issues = "structure", check_structure(cfg)
        if not issues:
            if self._known_failure(c, "plan", keys):
                return None
            try:
                return cfg, self._resolve(cfg, c)
            except ConfigError as err:
                stage, issues = "plan", err.issues
        c.status, c.reason = "invalid", f"invalid: {issues[0].path}: {issues[0].reason}"
        section = next((name for name in keys if issues[0].path.startswith(f"parallel.{name}")), None)
        if section is not None:
            self._failed[stage, keys[section]] = c.reason
        return None

    def _resolve(self, cfg: RunConfig, c: Candidate) -> ParallelPlan:
        """The candidate's plan; candidates that differ only in activation checkpointing (or precision)
        share one resolution, the checkpointing set on a copy."""
        section = {k: v for k, v in c.parallel.items() if k != "activation_checkpointing"}
        key = (json.dumps(section, sort_keys=True), tuple(c.mesh))
        if key not in self._plans:
            self._plans[key] = resolve_plan(cfg.parallel, cfg.mesh, self.model,
                                            check_glob=lambda *glob: _check_heads(self.decoder, *glob))
        return dataclasses.replace(self._plans[key], activation_checkpointing=cfg.parallel.activation_checkpointing,
                                   activation_checkpointing_every=cfg.parallel.activation_checkpointing_every)

    def _known_failure(self, c: Candidate, stage: str, keys: dict[str, tuple]) -> bool:
        """``c`` shares a section that failed ``stage`` (structure / plan) of the validation before:
        the same first issue, so the same reason, without validating again."""
        order = ("pipeline", "tensor_parallel") if stage == "structure" else ("tensor_parallel", "pipeline")
        known = next((self._failed[stage, keys[s]] for s in order if (stage, keys[s]) in self._failed), None)
        if known is not None:
            c.status, c.reason = "invalid", known
        return known is not None

    # ------------------------------------------------------------------ prediction

    def params(self, plan: ParallelPlan) -> dict:
        key = (self.params_key(plan), plan.mesh.size(plan.expert_parallel.dim) if plan.expert_parallel else 1)
        if key not in self._params:
            self._params[key] = unit_params(plan, self.model)
        return self._params[key]

    def flops_per_sequence(self, cfg: RunConfig, plan: ParallelPlan) -> float:
        """Matmul FLOPs of one whole sequence, forward, backward and any recompute (a tp=1 pass)."""
        key = (cfg.train.precision, plan.activation_checkpointing)
        if key not in self._flops:
            one = ParallelPlan(units=plan.units, blocks=plan.blocks)
            costs = unit_costs(cfg, one, 1, model=self.model)
            # A checkpointed block's forward runs again; under selective only its attention kernel's.
            recompute = {b: costs[b].forward for b in checkpointed(plan) if b in costs}
            recompute.update({b: costs[b].core for b in core_recomputed(plan) if b in costs})
            self._flops[key] = sum(c.forward.matmul_flops + c.backward.matmul_flops for c in costs.values()) + sum(
                w.matmul_flops for w in recompute.values())
        return self._flops[key]

    def overflows(self, c: Candidate, cfg: RunConfig, plan: ParallelPlan) -> bool:
        """Weights, gradients and optimizer state are a floor of any rank's memory and need no trace:
        a layout they alone overflow is refused before its passes are traced or priced (a 175B model
        on 8 ranks: every layout in seconds rather than minutes)."""
        floor = max(r.state_bytes for r in plan_numbers(cfg, plan, model=self.model).per_pp_rank)
        if floor <= self.budget:
            return False
        c.peak_bytes, c.status = floor, "does not fit"
        c.reason = (f"does not fit: {floor / GIB:.2f} GiB of weights, gradients and optimizer state alone "
                    f"> {self.budget / GIB:.2f} GiB budget")
        return True

    def predict(self, c: Candidate, cfg: RunConfig, plan: ParallelPlan) -> None:
        micro = cfg.micro_batch_size
        key = (self.params_key(plan), micro, cfg.train.precision, plan.cp_size)
        if key not in self._costs:
            self._costs[key] = self.pricing.unit_costs(cfg, plan, micro, self.model)
        step = self.pricing.step(cfg, plan, self._costs[key], self.model, self.params(plan))
        c.step_s, c.tokens_per_s, c.traffic = step.total_s, step.tokens_per_s, step.traffic
        c.parts_s = {"compute": step.compute_s, "bubble": step.bubble_s, "optimizer": step.optimizer_s,
                     "unitemized": step.overhead_s,
                     **{f"comm {axis}": s for axis, s in step.comm_s.items()}}
        c.peak_bytes = max(e.total for e in predict_memory(cfg, plan, model=self.model, cache=self._memory))
        if c.peak_bytes > self.budget:
            c.status = "does not fit"
            c.reason = f"does not fit: {c.peak_bytes / GIB:.2f} GiB > {self.budget / GIB:.2f} GiB budget"
        else:
            c.status = "slower"

    @staticmethod
    def params_key(plan: ParallelPlan) -> int:
        return plan.mesh.size([a for axes in plan.placements.values() for a in axes])

    # ------------------------------------------------------------------ the search

    def run(self) -> list[Candidate]:
        valid: list[tuple[float, Candidate, RunConfig, ParallelPlan]] = []
        invalid: list[Candidate] = []
        overflowing: list[Candidate] = []
        for c in self.layouts():
            checked = self.validate(c)
            if checked is None:
                invalid.append(c)
                continue
            cfg, plan = checked
            if self.overflows(c, cfg, plan):
                overflowing.append(c)
                continue
            c.lower_bound_s = self.pricing.lower_bound(cfg, plan, self.params(plan), self.flops_per_sequence(cfg, plan))
            valid.append((c.lower_bound_s, c, cfg, plan))
        valid.sort(key=lambda v: v[0])
        best = math.inf
        for bound, c, cfg, plan in valid:
            if bound > best and self.knobs.prune:
                c.status, c.reason = "pruned", f"pruned: lower bound {bound * 1e3:.1f} ms > best {best * 1e3:.1f} ms"
                continue
            self.predict(c, cfg, plan)
            if c.status == "slower":
                best = min(best, c.step_s)
        predicted = sorted((c for _, c, _, _ in valid if c.status == "slower"), key=lambda c: c.step_s)
        if predicted:
            predicted[0].status, predicted[0].reason = "chosen", "chosen: fastest predicted to fit"
            for c in predicted[1:]:
                c.reason = slower_reason(c, predicted[0])
        rest = [c for _, c, _, _ in valid if c.status in ("does not fit", "pruned")] + overflowing
        rest.sort(key=lambda c: (c.status != "does not fit", c.step_s or c.lower_bound_s or 0.0, c.peak_bytes or 0.0))
        return predicted + rest + invalid


def slower_reason(c: Candidate, winner: Candidate) -> str:
    """``slower: +23% (+4.1 ms comm tp)``: how much, and the part that grew most against the winner."""
    diffs = {part: c.parts_s.get(part, 0.0) - winner.parts_s.get(part, 0.0) for part in {*c.parts_s, *winner.parts_s}}
    part, extra = max(diffs.items(), key=lambda kv: kv[1])
    return f"slower: +{(c.step_s / winner.step_s - 1):.0%} (+{extra * 1e3:.1f} ms {part})"


def _section_keys(c: Candidate) -> dict[str, tuple]:
    """What each section's own checks depend on, so that one failure rejects every candidate that
    shares it without validating again (symmetry: of 21,206 layouts of 4096 ranks, 17,714 fail
    for a tp degree that does not split the heads or a pipeline the batch or model cannot fill).
    tensor_parallel: its degree (heads, shapes) and the ep and cp sizes beside it (cp: tp of a row's share);
    pipeline: its section and the dp, pp, ep, tp sizes."""
    sizes = dict(zip(c.parallel["dims"], c.mesh))
    dp = math.prod(s for a, s in sizes.items() if a.startswith("dp"))
    pipeline = c.parallel.get("pipeline")
    return {"tensor_parallel": ("tensor_parallel", sizes.get("tp", 1), sizes.get("ep", 1), sizes.get("cp", 1)),
            "pipeline": ("pipeline", dp, sizes.get("pp", 1), sizes.get("ep", 1), sizes.get("tp", 1),
                         tuple(sorted(pipeline.items())) if pipeline else None)}


def _hsdp_sizes(label: str) -> list[int]:
    replicate, shard = label.removeprefix("dp").split("(")[0].split("x")
    return [int(replicate), int(shard)]


def _device(cfg: RunConfig):
    import torch

    return torch.device("cuda" if on_cuda(cfg) else "cpu")
