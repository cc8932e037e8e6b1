"""The auto-planner's search (:mod:`trainer.planner.auto.plan`): enumerate (:mod:`trainer.planner.auto.layouts`),
validate, bound, predict best first and rank (:mod:`trainer.planner.auto.order`).

    search = Search(raw, base_cfg, AutoPlanConfig(), world=8, pricing=HostPricing(cal))
    candidates = search.run()           # ranked; candidates[0] is the choice when one fits

One meta model serves every candidate; the meta passes (the work per unit of
:func:`trainer.planner.cost.model.unit_costs`, the saved activations of
:func:`trainer.planner.memory.predict.predict_memory`) are cached by what they depend on, so a search of thousands of
layouts runs a handful of them.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable

from torch import nn

from parallel.config import AutoPlanConfig, ParallelConfig
from parallel.errors import ConfigError
from parallel.plan.resolve import resolve_plan
from parallel.plan.spec import DataParallelSpec, ParallelPlan
from parallel.plan.split import split_key
from parallel.topology import MeshSpec
from parallel.plan.units import stage_ranks
from trainer.config.schema import RunConfig
from trainer.models import decoder_config
from trainer.models.skeleton import meta_model
from trainer.planner.auto.layouts import Layouts
from trainer.planner.auto.order import price_all, price_best_first, priced_step, ranked
from trainer.planner.auto.ranking import Candidate
from trainer.planner.auto.shallow import Given, cut_plan, expand, memory_floor, shallow_model
from trainer.planner.cost.comm import unit_params
from trainer.planner.cost.model import unit_costs
from trainer.planner.forecast.pricing import HostPricing, ProfilePricing
from trainer.planner.memory.budget import memory_budget, memory_margin
from trainer.planner.memory.layout import checkpointed, core_recomputed
from trainer.planner.memory.meta_pass import flash_attention_for_cpu, saved_activations
from trainer.planner.memory.pass_cache import PASSES, pass_key
from trainer.planner.memory.predict import predict_memory
from trainer.planner.numbers import GIB, plan_numbers
from trainer.validate.checks import check_structure
from trainer.validate.model_checks import check_heads


class Progress:
    """What the search has done so far, said through ``say`` (the CLI: a console line) at the end of each
    phase and at most every ``every_s`` seconds within one: layouts considered, valid, over the memory
    floor, priced, pruned, the meta passes run and the best so far. ``clock``: seconds, monotonic."""

    def __init__(self, say: Callable[[str], None] | None, *, every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.say, self.every_s, self.clock = say, every_s, clock
        self.began = self.last = clock()
        self.counts = dict.fromkeys(("considered", "invalid", "over the floor", "bounded", "priced", "pruned",
                                     "meta passes"), 0)
        self.best: Candidate | None = None
        self.floor: float | None = None  # the lowest bound of a step left to look at (the search goes best first)

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] += n

    def tick(self, phase: str, *, force: bool = False) -> None:
        now = self.clock()
        if self.say is None or (not force and now - self.last < self.every_s):
            return
        self.last = now
        done = ", ".join(f"{n} {what}" for what, n in self.counts.items() if n)
        best = (f"; best so far {self.best.label}: {priced_step(self.best) * 1e3:,.1f} ms a step"
                if self.best is not None else "")
        if self.floor is not None and self.best is None:  # until a layout fits: how far the search has come
            best = f"; none left faster than {self.floor * 1e3:,.1f} ms a step"
        self.say(f"auto plan [{now - self.began:,.0f} s] {phase}: {done or 'starting'}{best}")


class Search(Layouts):
    def __init__(self, raw: dict, base: RunConfig, knobs: AutoPlanConfig, world: int,
                 pricing: HostPricing | ProfilePricing, *, progress: Progress | None = None,
                 rank_below: float = 0.0) -> None:
        self.raw, self.base, self.knobs, self.world, self.pricing = raw, base, knobs, world, pricing
        # Every layout predicted to take at most this long is priced in full, time and memory, whatever the best
        # (a bench ranking a given layout exactly: tests/bench/bench_profiles.py --planner).
        self.rank_below = rank_below
        self.progress = progress or Progress(None)
        self.model = meta_model(base.model)  # the only model this search builds (validation's after it, too)
        self.decoder = decoder_config(base.model)
        self.budget, self.budget_source = memory_budget(base.model_copy(update={"mesh": [world]}))
        # As the validator: a GPU profile's layout is dropped only beyond the prediction's measured error
        # (trainer.planner.memory.budget); within it, it is kept and ranked, its margin in its reason.
        self.margin = memory_margin(base)
        self.limit = self.budget * (1 + self.margin)
        self._costs: dict = {}
        self._memory: dict = {}
        self._params: dict = {}
        self._flops: dict = {}
        self._floors: dict = {}
        self._axes: dict[int, tuple] = {}  # id(placements) -> (placements, the axes they name): see params_key
        self._shallow_model: nn.Module | None = None  # see _shallow
        self._shallow_known = False  # _shallow_model looked at yet
        self._floor_passes: dict = {}  # two-block memory passes (memory_floor)
        self._failed: dict[tuple, str] = {}  # a section's failure -> the reason (see validate)
        self._plans: dict[tuple, ParallelPlan] = {}  # a parallel section (less its checkpointing) -> its plan
        self._layouts: dict = {}  # the placements and layouts those plans share (resolve_plan's layout_cache)

    # ------------------------------------------------------------------ validation

    def validate(self, c: Candidate) -> tuple[RunConfig, ParallelPlan] | None:
        """The candidate's config and plan, or None with ``c.reason`` saying why it is invalid: the
        structural checks every config meets, then the placements and boundaries on the model."""
        keys = _section_keys(c)
        if self._known_failure(c, "structure", keys):
            return None
        # The base config with the candidate's mesh, parallel section, precision and accumulation: what validating
        # the whole raw config again gives (its sections have no cross-field validators), for a twentieth of the time.
        train = self.base.train.model_copy(update={"precision": c.precision, "grad_accum": c.grad_accum})
        cfg = self.base.model_copy(update={"mesh": list(c.mesh), "parallel": ParallelConfig.model_validate(c.parallel),
                                           "train": train})
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
        """The candidate's plan. Resolving (matching the placement globs, cutting the pipeline) depends
        only on the tp, pp, cp and ep sizes and the stages per rank: candidates that differ in the dp
        size and mode, the schedule, the micro-batches, checkpointing or precision share one resolution,
        their own mesh and those specs set on a copy (a 175B model on 512 ranks: 10,200 candidates,
        about 100 resolutions of 0.1 s each instead of 5,100)."""
        sizes = dict(zip(c.parallel["dims"], c.mesh))
        pipeline = c.parallel.get("pipeline")
        key = (sizes.get("tp", 1), sizes.get("pp", 1), sizes.get("cp", 1), sizes.get("ep", 1),
               json.dumps({k: v for k, v in (pipeline or {}).items() if k not in ("schedule", "microbatches")},
                          sort_keys=True), json.dumps(c.parallel.get("tensor_parallel"), sort_keys=True),
               # a 2-D grid or 3-D cube (trainer.planner.auto.layouts._grids): its section and side
               json.dumps([c.parallel.get("grid_parallel"), c.parallel.get("tensor_parallel_3d")], sort_keys=True),
               sizes.get("row", 1), sizes.get("ca", 1))
        if key not in self._plans:
            self._plans[key] = resolve_plan(cfg.parallel, cfg.mesh, self.model, layout_cache=self._layouts,
                                            check_glob=lambda *glob: check_heads(self.decoder, *glob))
        template, par = self._plans[key], cfg.parallel
        assert par is not None, "a candidate's config has its parallel section"
        dp = par.data_parallel
        pp = template.pipeline
        if pp is not None:
            assert par.pipeline is not None, "a plan's pipeline is its section's"
            pp = dataclasses.replace(pp, schedule=par.pipeline.schedule, num_microbatches=par.pipeline.microbatches,
                                     stage_ranks=tuple(stage_ranks(pp.num_stages, sizes["pp"],
                                                                   schedule=par.pipeline.schedule)))
        return dataclasses.replace(template, mesh=MeshSpec(tuple(c.mesh), tuple(par.dims)), pipeline=pp,
                                   data_parallel=DataParallelSpec(dp.mode, tuple(dp.dim_names)) if dp else None,
                                   activation_checkpointing=par.activation_checkpointing,
                                   activation_checkpointing_every=par.activation_checkpointing_every)

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
        key = (self.params_key(plan), plan.mesh.size(plan.expert_parallel.dim) if plan.expert_parallel else 1,
               plan.grid, plan.cube, plan.topology.tp_size)  # a grid's or cube's blocks: held as they split them
        if key not in self._params:
            self._params[key] = unit_params(plan, self.model)
        return self._params[key]

    def flops_per_sequence(self, cfg: RunConfig, plan: ParallelPlan) -> float:
        """Matmul FLOPs of one whole sequence, forward, backward and any recompute (a tp=1 pass)."""
        if cfg.train.precision not in self._flops:  # one pass: the recompute is the blocks' forward again
            one = ParallelPlan(units=plan.units, blocks=plan.blocks)
            self._flops[cfg.train.precision] = self.unit_costs(
                cfg, one, 1, lambda cfg, plan, micro, model: unit_costs(cfg, plan, micro, model=model))
            self.progress.count("meta passes")
        costs = self._flops[cfg.train.precision]
        # A checkpointed block's forward runs again; under selective only its attention kernel's.
        recompute = {b: costs[b].forward for b in checkpointed(plan) if b in costs}
        recompute.update({b: costs[b].core for b in core_recomputed(plan) if b in costs})
        return sum(c.forward.matmul_flops + c.backward.matmul_flops for c in costs.values()) + sum(
            w.matmul_flops for w in recompute.values())

    def overflows(self, c: Candidate, cfg: RunConfig, plan: ParallelPlan) -> bool:
        """Weights, gradients and optimizer state are a floor of any rank's memory and need no trace:
        a layout they alone overflow is refused before its passes are traced or priced (a 175B model
        on 8 ranks: every layout in seconds rather than minutes)."""
        # What it depends on: the per-rank split (tp, pp, the stages' ranks, ep) and the dp sharding.
        dp = plan.param_data_parallel
        key = (self.params_key(plan), plan.pipeline.stage_units if plan.pipeline else None,
               plan.pipeline.stage_ranks if plan.pipeline else None, plan.mesh.size(plan.expert_parallel.dim)
               if plan.expert_parallel else 1, dp.mode if dp else None, plan.mesh.size(dp.shard_dim_names) if dp else 1,
               plan.mesh.size(dp.dim_names) if dp else 1)
        if key not in self._floors:
            self._floors[key] = max(r.state_bytes for r in plan_numbers(cfg, plan, model=self.model).per_pp_rank)
        floor = self._floors[key]
        if floor <= self.limit:
            return False
        c.peak_bytes, c.status = floor, "does not fit"
        c.reason = (f"does not fit: {floor / GIB:.2f} GiB of weights, gradients and optimizer state alone "
                    f"> {self.budget / GIB:.2f} GiB budget{self._beyond()}")
        return True

    def _shallow(self) -> nn.Module | None:
        """The model cut to two blocks when its blocks are alike (:mod:`trainer.planner.auto.shallow`), else None."""
        if not self._shallow_known:
            self._shallow_model, self._shallow_known = shallow_model(self.base, self.model), True
        return self._shallow_model

    def unit_costs(self, cfg: RunConfig, plan: ParallelPlan, micro: int, pricing) -> dict:
        """``pricing(cfg, plan, micro, model)``'s work per unit, from a pass over two blocks where the model's
        blocks are alike (:meth:`_shallow`): the last block's priced for every deeper one."""
        shallow = self._shallow()
        if shallow is None:
            return pricing(cfg, plan, micro, self.model)
        return expand(pricing(cfg, cut_plan(plan, shallow), micro, shallow), plan)

    def memory_floor(self, cfg: RunConfig, plan: ParallelPlan) -> float | None:
        """A floor of the candidate's peak from a two-block pass (:func:`~trainer.planner.auto.shallow.memory_floor`:
        the saved activations exact, backward's worst moment left out); None where the blocks are not alike."""
        shallow = self._shallow()
        if shallow is None or (plan.pipeline is not None and plan.pipeline.stages):
            return None
        cut = cut_plan(plan, shallow)
        key = (self.params_key(plan), cfg.micro_batch_size, cfg.train.precision, plan.cp_size, _sequence_shards(plan),
               plan.mesh.size(plan.expert_parallel.dim) if plan.expert_parallel else 1, split_key(plan))
        if key not in self._floor_passes:
            self._floor_passes[key] = saved_activations(cfg, cut, cfg.micro_batch_size, model=shallow)
            self.progress.count("meta passes")
        given = Given(memory_floor(self._floor_passes[key], plan))
        return max(e.total for e in predict_memory(cfg, plan, model=self.model, cache=given))

    def predict(self, c: Candidate, cfg: RunConfig, plan: ParallelPlan, *, memory: bool = True) -> None:
        """The candidate's step time, and with ``memory`` its peak memory (:meth:`predict_memory`, the
        costly part). The search leaves memory out for a layout whose step is no faster than one already
        predicted to fit: it cannot be chosen, fits or not."""
        micro, key = cfg.micro_batch_size, self._costs_key(cfg, plan)
        if key not in self._costs:
            self._costs[key] = self.unit_costs(cfg, plan, micro, self.pricing.unit_costs)
            self.progress.count("meta passes")
        step = self.pricing.step(cfg, plan, self._costs[key], self.model, self.params(plan))
        c.step_s, c.tokens_per_s, c.traffic = step.total_s, step.tokens_per_s, step.traffic
        c.parts_s = {"compute": step.compute_s, "bubble": step.bubble_s, "optimizer": step.optimizer_s,
                     "unitemized": step.overhead_s,
                     **{f"comm {axis}": s for axis, s in step.comm_s.items()}}
        c.status, c.memory_skipped = "slower", True
        if memory:
            self.predict_memory(c, cfg, plan)

    def _costs_key(self, cfg: RunConfig, plan: ParallelPlan) -> tuple:
        """What a layout's unit costs (:meth:`unit_costs`) depend on, the rest of the config being the search's own."""
        return (self.params_key(plan), cfg.micro_batch_size, cfg.train.precision, plan.cp_size, _sequence_shards(plan),
                split_key(plan))

    def predict_memory(self, c: Candidate, cfg: RunConfig, plan: ParallelPlan) -> None:
        """The peak memory of a candidate whose time :meth:`predict` priced (a meta pass of the whole model
        per tp size and micro-batch), after a two-block floor that may already show it does not fit."""
        c.memory_skipped = False
        floor = self.memory_floor(cfg, plan)
        if floor is not None and floor > self.limit:  # no full pass for a layout that does not fit even that
            c.peak_bytes, c.status = floor, "does not fit"
            c.reason = (f"does not fit: at least {floor / GIB:.2f} GiB (before backward's worst moment) > "
                        f"{self.budget / GIB:.2f} GiB budget{self._beyond()}")
            return
        # predict_memory's cache tells tp's layouts apart only by there being some: one cache per sequence-parallel set.
        cache = self._memory.setdefault(_sequence_shards(plan), _Traced())
        passes = len(cache)
        c.peak_bytes = max(e.total for e in predict_memory(cfg, plan, model=self.model, cache=cache))
        if len(cache) > passes:  # a full pass: the process's cache gets it too, for the dry run of the winner
            if (key := pass_key(cfg, plan, cfg.micro_batch_size, flash_attention_for_cpu)) is not None:
                PASSES[key] = cache.last  # (None: the model's files cannot be read; predict_memory looks up none)
        self.progress.count("meta passes", len(cache) - passes)
        if c.peak_bytes > self.limit:
            c.status = "does not fit"
            c.reason = (f"does not fit: {c.peak_bytes / GIB:.2f} GiB > {self.budget / GIB:.2f} GiB "
                        f"budget{self._beyond()}")
        elif c.peak_bytes > self.budget:
            c.memory_note = (f"may not fit: {c.peak_bytes / GIB:.2f} GiB, {c.peak_bytes / self.budget - 1:+.0%} over "
                             f"the {self.budget / GIB:.2f} GiB budget, within the {self.margin:.0%} measured error")

    def _beyond(self) -> str:
        return f" + {self.margin:.0%} measured error" if self.margin else ""

    def params_key(self, plan: ParallelPlan) -> int:
        """The tp size: the product of the axes the placements name (asked of every candidate several
        times; the candidates of one resolution share its placements, so their axes are found once)."""
        placements = plan.placements
        if id(placements) not in self._axes:  # the placements live in self._plans: their ids stay theirs
            self._axes[id(placements)] = (placements, sorted({a for axes in placements.values() for a in axes}))
        return plan.mesh.size(self._axes[id(placements)][1])

    # ------------------------------------------------------------------ the search

    def run(self) -> list[Candidate]:
        valid: list[tuple[float, Candidate, RunConfig, ParallelPlan]] = []
        invalid: list[Candidate] = []
        overflowing: list[Candidate] = []
        progress = self.progress
        progress.tick("enumerating", force=True)
        for c in self.layouts():
            progress.count("considered")
            progress.tick("validating and bounding")
            checked = self.validate(c)
            if checked is None:
                invalid.append(c)
                progress.count("invalid")
                continue
            cfg, plan = checked
            if self.overflows(c, cfg, plan):
                overflowing.append(c)
                progress.count("over the floor")
                continue
            # The compute floor first (no collective priced): the full bound only for a layout that may win.
            c.lower_bound_s = self.pricing.compute_floor(cfg, plan, self.params(plan),
                                                         self.flops_per_sequence(cfg, plan))
            valid.append((c.lower_bound_s, c, cfg, plan))
            progress.count("bounded")
        progress.tick(f"pricing the {len(valid)} valid layouts, lowest bound first", force=True)
        valid.sort(key=lambda v: v[0])
        (price_best_first if self.knobs.prune else price_all)(self, valid)
        progress.tick("done", force=True)
        candidates = ranked(valid, invalid, overflowing)
        for _, c, cfg, plan in valid:  # the choice's dry run prices the step its ranking shows, from these costs
            if c is candidates[0] and c.status == "chosen":
                self.pricing.keep(cfg, plan, cfg.micro_batch_size, self._costs[self._costs_key(cfg, plan)])
        return candidates


def _section_keys(c: Candidate) -> dict[str, tuple]:
    """What each section's own checks depend on, so that one failure rejects every candidate that
    shares it without validating again (symmetry: of 21,206 layouts of 4096 ranks, 17,714 fail
    for a tp degree that does not split the heads or a pipeline the batch or model cannot fill).
    tensor_parallel: its degree (heads, shapes) and the ep and cp sizes beside it (cp: tp of a row's share);
    pipeline: its section and the dp, pp, cp, ep, tp sizes."""
    sizes = dict(zip(c.parallel["dims"], c.mesh))
    dp = MeshSpec(tuple(c.mesh), tuple(c.parallel["dims"])).size([a for a in sizes if a.startswith("dp")])
    pipeline = c.parallel.get("pipeline")
    return {"tensor_parallel": ("tensor_parallel", sizes.get("tp", 1), sizes.get("ep", 1), sizes.get("cp", 1)),
            "pipeline": ("pipeline", dp, sizes.get("pp", 1), sizes.get("cp", 1), sizes.get("ep", 1),
                         sizes.get("tp", 1), tuple(sorted(pipeline.items())) if pipeline else None)}


def _sequence_shards(plan: ParallelPlan) -> frozenset[str]:
    """The mesh axes the plan runs the blocks' norms on sequence shards over (sequence parallelism): the
    meta passes of a layout with it and of one without differ."""
    return plan.sequence_parallel_axes


class _Traced(dict):
    """A meta-pass cache that remembers the pass it was last given (see :meth:`Search.predict_memory`)."""

    last: dict | None = None

    def __setitem__(self, key, saved) -> None:
        super().__setitem__(key, saved)
        self.last = saved
