"""Two blocks stand for all: a model whose blocks are alike (the built-in decoder: the same modules and
parameter shapes in every block) does the same work and saves the same activations in each block,
whatever its depth, so the search traces a copy with two blocks and gives the second's numbers to
every deeper one. A 96-block model's pass costs what a 2-block one does (0.3 s instead of 13 s here).

    shallow = shallow_model(base_cfg, model)            # None when the blocks are not alike
    costs = expand(pricing(cfg, cut_plan(plan, shallow), micro, shallow), plan)
    floor = predict_memory(cfg, plan, model=model, cache=Given(memory_floor(saved, plan)))

What depends on the depth is not taken from two blocks: the moment in backward when the most is live
(parameter gradients pile up as activations are freed) is the full pass's. :func:`memory_floor` drops
that moment (what backward adds beyond the saved activations), so the estimate it gives is a floor of
the full one: the search refuses a layout that does not fit even that without the full pass.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from parallel.plan.spec import ParallelPlan
from trainer.config.schema import RunConfig
from trainer.models import build_model

SHALLOW_BLOCKS = 2


def shallow_model(base: RunConfig, model: nn.Module) -> nn.Module | None:
    """``model`` (built from ``base.model``) cut to :data:`SHALLOW_BLOCKS` blocks when its blocks are alike."""
    n = getattr(base.model, "n_layers", None)
    if base.model.arch != "llama" or not n or n <= SHALLOW_BLOCKS:
        return None
    modules = dict(model.named_modules())
    blocks = [modules.get(f"layers.{i}") for i in range(n)]
    if any(b is None for b in blocks):
        return None
    alike = {tuple((name, type(m).__name__, tuple(w.shape) if isinstance(w := getattr(m, "weight", None), nn.Parameter)
                    else None) for name, m in b.named_modules()) for b in blocks if b is not None}
    if len(alike) != 1:
        return None
    return build_model(base.model.model_copy(update={"n_layers": SHALLOW_BLOCKS}), device="meta")


def cut_plan(plan: ParallelPlan, shallow: nn.Module) -> ParallelPlan:
    """``plan`` for the two-block model: its units, blocks, placements and layouts only (no pipeline:
    a pass prices units, whichever stage holds them)."""
    names = {name for name, _ in shallow.named_modules()} | {name for name, _ in shallow.named_parameters()}
    return dataclasses.replace(
        plan, units=tuple(u for u in plan.units if u in names), blocks=tuple(b for b in plan.blocks if b in names),
        placements={fqn: axes for fqn, axes in plan.placements.items() if fqn in names},
        layouts={name: layout for name, layout in plan.layouts.items() if name in names}, pipeline=None)


def expand(per_unit: dict, plan: ParallelPlan, *, blocks_only: bool = False) -> dict:
    """A two-block pass's ``{unit: value}`` for every unit of ``plan``: a deeper block gets the last block's."""
    last = next(u for u in reversed(plan.blocks) if u in per_unit)
    units = plan.blocks if blocks_only else plan.units
    return {u: per_unit[u if u in per_unit else last] for u in units if u in per_unit or u in plan.blocks}


def memory_floor(saved: dict, plan: ParallelPlan) -> dict:
    """A two-block :func:`~trainer.planner.memory.meta_pass.saved_activations` answer for all of ``plan``'s
    blocks, less what backward adds at its worst moment (its timeline: one moment with nothing live)."""
    # Keys this does not know (the memory model may read more) keep the two blocks' values: less, still a floor.
    return {**saved, "units": expand(saved["units"], plan),
            "block_inputs": expand(saved["block_inputs"], plan, blocks_only=True),
            "unit_params": expand(saved["unit_params"], plan), "largest_trainable": saved["largest_trainable"],
            # selective recomputation: what each block's attention core saves (none under other modes)
            "cores": expand(saved["cores"], plan, blocks_only=True) if saved.get("cores") else {},
            "timeline": [(0.0, 0.0)], "forward_ops": 0}


class Given(dict):
    """A meta-pass cache holding one answer for every key: what :func:`predict_memory` reads instead of
    tracing (so the floor follows the memory model, whatever its cache keys)."""

    def __init__(self, saved: dict) -> None:
        super().__init__()
        self.saved = saved

    def __contains__(self, key) -> bool:
        return True

    def __getitem__(self, key) -> dict:
        return self.saved

    def __setitem__(self, key, value) -> None:  # nothing is traced, nothing kept
        pass
