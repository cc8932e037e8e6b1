"""``+parallel=auto mesh=[N]``: choose the layout of N ranks with the calibrated cost model.

    python -m trainer +parallel=auto mesh=[8] dry_run=true    # the ranking, fastest first
    python -m trainer +parallel=auto mesh=[8]                 # trains with the winner

    result = plan_layouts(raw)          # raw: the composed config, `parallel: {auto: {...}}`
    result.winner.parallel              # the chosen `parallel` section, as a user would write it
    print(result.table())

Candidates: every split of N into dp x pp x cp x ep x tp (hsdp's replicate x shard too, beside cp or ep; cp for long
rows, ep for a model with experts), each data-parallel mode, schedule, micro-batch count, stages per rank,
accumulation, activation checkpointing, sequence parallelism and precision the knobs
(:class:`parallel.config.AutoPlanConfig`) allow, with the model family's Megatron plan and ``boundaries: auto``
(:mod:`trainer.planner.auto.layouts`). Each is checked by the validator hand-written configs meet
(:func:`trainer.validate.checks.check_structure`, :func:`parallel.plan.resolve.resolve_plan` with the head-count
check) against one meta model built once. Axis order is fixed (dp outermost, then pp, cp, ep, tp innermost): on one
host permuting the axes changes nothing the model predicts, so one order stands for all.

Search, best first (:mod:`trainer.planner.auto.order`): every valid candidate waits at a lower bound of
its time that needs no meta pass (a compute floor, then :func:`trainer.planner.cost.model.lower_bound_s`),
then at its predicted time (the meta passes are cached by what they depend on: tp size, micro-batch,
precision, sequence parallelism); the lowest is advanced, and the first whose memory fits is chosen. The
rest either were predicted slower (their memory left out) or are pruned by a bound above the choice, and
cannot be faster. Every loser says why it lost.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from parallel.config import AutoPlanConfig
from parallel.errors import ConfigError, ConfigIssue
from parallel.plan.spec import ParallelPlan
from parallel.topology import mesh_world_size
from trainer.config.schema import RunConfig
from trainer.planner.auto.ranking import AutoPlan
from trainer.planner.cost.calibration import Calibration
from trainer.planner.memory.layout import on_cuda
from trainer.validate.checks import validate_with_plan

log = logging.getLogger(__name__)
MAX_PROBE_WORKERS = 16  # a probe of more processes than that on one host measures only the scheduler


def is_auto(raw: dict) -> bool:
    """``raw`` asks the planner to choose (an ``auto`` section and no layout of its own yet)."""
    par = raw.get("parallel")
    return isinstance(par, dict) and par.get("auto") is not None and "dims" not in par


def resolve_auto(raw: dict, *, calibration: Calibration | None = None,
                 progress: Callable[[str], None] | None = None) -> tuple[dict, AutoPlan]:
    """``raw`` with the winner's mesh and parallel section (the knobs kept under ``parallel.auto``);
    ``progress``: where the search's progress lines go (the CLI: the console)."""
    result = plan_layouts(raw, calibration=calibration, progress=progress)
    if result.winner.status != "chosen":
        raise ConfigError([ConfigIssue("parallel.auto",
                                       f"no layout of {result.world_size} ranks is valid and predicted "
                                       f"to fit: {result.winner.reason}", "change the mesh, the batch or the knobs "
                                       "(a dry run prints every candidate and why it lost)")])
    chosen = result.winner
    out = {**raw, "mesh": chosen.mesh, "parallel": {**chosen.parallel, "auto": raw["parallel"]["auto"]}}
    out["train"] = {**(raw.get("train") or {}), "precision": chosen.precision, "grad_accum": chosen.grad_accum}
    return out, result


def resolve_and_validate(raw: dict, *, check_model: bool = True, progress: Callable[[str], None] | None = None
                         ) -> tuple[RunConfig, ParallelPlan | None, AutoPlan | None]:
    """The one way a composed config becomes a run config (the CLI, ``train(config)`` and the
    control plane): ``+parallel=auto`` resolved to the planner's winner first (with ``check_model``;
    the probe of the host and the search take seconds), then validated like any hand-written config.
    Returns the config, its resolved plan (None without ``check_model``) and the ranking (None
    unless the planner chose). ``progress``: where the search says how far it is (the CLI: stderr)."""
    ranking = None
    if is_auto(raw) and check_model:
        raw, ranking = resolve_auto(raw, progress=progress)
    cfg, plan = validate_with_plan(raw, check_model=check_model)
    return cfg, plan, ranking


def ranking_for(cfg: RunConfig, *, calibration: Calibration | None = None) -> AutoPlan | None:
    """The ranking a config chosen by the planner came from (None for a hand-written layout),
    computed again: the calibration is cached and the search takes seconds, so a run records it
    without carrying it through the config (what a REST job or ``trainer.launch job.json`` reads)."""
    if cfg.parallel is None or cfg.parallel.auto is None:
        return None
    raw = cfg.model_dump(mode="json")
    raw.update(mesh=[cfg.world_size], parallel={"auto": raw["parallel"]["auto"]})
    return plan_layouts(raw, calibration=calibration)


def ranking_artifacts(cfg: RunConfig) -> dict[str, str]:
    """``+parallel=auto``: the planner's ranking as a run's ``auto_plan.json`` and ``auto_plan.txt``
    (computed again from the cached calibration, :func:`ranking_for`); empty for a hand-written
    layout, or when the ranking cannot be computed again (it only describes the run)."""
    try:
        ranking = ranking_for(cfg)
    except Exception as err:  # noqa: BLE001 - the ranking only describes the run
        log.warning("no auto_plan.json for this run: %s: %s", type(err).__name__, err)
        return {}
    if ranking is None:
        return {}
    return {"auto_plan.json": ranking.to_json(), "auto_plan.txt": ranking.table(len(ranking.candidates))}


def _knobs(raw: dict) -> AutoPlanConfig:
    from pydantic import ValidationError

    try:
        return AutoPlanConfig.model_validate(raw["parallel"]["auto"] or {})
    except ValidationError as err:
        raise ConfigError([ConfigIssue("parallel.auto." + ".".join(map(str, e["loc"])), e["msg"], "see python -m "
                                       "trainer --help for parallel.auto") for e in err.errors()]) from None


def plan_layouts(raw: dict, *, calibration: Calibration | None = None,
                 progress: Callable[[str], None] | None = None, rank_below: float = 0.0) -> AutoPlan:
    """Rank every candidate layout of ``raw``'s mesh (see the module docstring); ``progress`` is told
    what the search has done at the end of each phase and every few seconds within one. ``rank_below``:
    also predict in full every layout whose step is at most this (seconds), so their ranks are exact."""
    began = time.monotonic()
    knobs = _knobs(raw)
    mesh = raw.get("mesh") or [1]
    if any(isinstance(x, list) for x in mesh):
        raise ConfigError([ConfigIssue("mesh", "the auto-planner lays out a mesh shape, not explicit rank ids",
                                       "give the number of ranks, e.g. mesh=[8]")])
    world = mesh_world_size(mesh)
    base = RunConfig.model_validate({**raw, "mesh": None, "parallel": None})
    # start-up: the search imports DTensor and the cost model, the probe the training loop (about 2 s);
    # only +parallel=auto pays for them, not every validation of a hand-written layout.
    from trainer.planner.auto.search import Progress, Search
    from trainer.planner.forecast.pricing import pricing_for

    if base.hardware.is_host:  # a profile prices without this host: nothing to probe
        calibration = calibration or host_calibration(base, world)
    search = Search(raw, base, knobs, world, pricing_for(base, calibration=calibration),
                    progress=Progress(progress), rank_below=rank_below)
    candidates = search.run()

    return AutoPlan(world_size=world, budget_bytes=search.budget, budget_source=search.budget_source,
                    calibration=search.pricing.describe(), candidates=candidates,
                    seconds=time.monotonic() - began, show=knobs.show)


def host_calibration(base: RunConfig, world: int) -> Calibration:
    """This host's calibration for the workers a run of ``world`` ranks starts here (cached)."""
    workers = max(1, min(world // base.launch.nnodes, MAX_PROBE_WORKERS))
    sizes = [g for g in range(2, world + 1) if world % g == 0 and g <= workers]
    from trainer.planner.calibration.probe import load_or_probe  # start-up: see plan_layouts

    return load_or_probe(workers, sizes, device_type="cuda" if on_cuda(base) else "cpu")
