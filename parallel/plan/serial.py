"""A resolved plan as a file: what the launcher resolved once, read by its workers instead of resolving it again.

    resolved = ResolvedPlan.of(plan, meta_model)           # the plan and its model's fingerprint
    resolved.write(folder / "resolved_plan.json")          # beside the config the workers read
    plan = ResolvedPlan.read(path).plan_for(model)         # a worker: its own build checked first

:func:`plan_to_dict` and :func:`plan_from_dict` turn a :class:`~parallel.plan.spec.ParallelPlan` into plain
JSON values and back, exactly (``plan_from_dict(plan_to_dict(plan)) == plan``): placements as the config
writes them (``Shard(0)``), tuples as lists. The fingerprint names the model a plan was resolved for by its
parameters' names and shapes; a worker whose own build differs is refused (:class:`PlanMismatch`) rather than
given a plan for another model.
"""

from __future__ import annotations

import dataclasses

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from torch import nn

from parallel.placements import parse_placement_table, placement_texts
from parallel.plan.cube import CubeSpec
from parallel.plan.spec import (ContextParallelSpec, DataParallelSpec, ExpertParallelSpec, GridSpec, LayoutSpec,
                                ParallelPlan, PipelineSpec, StagePlan)
from parallel.topology import MeshSpec

FORMAT = 1  # the file's layout; a reader refuses another


class PlanMismatch(RuntimeError):
    """A worker's model is not the one its plan was resolved for."""


def model_fingerprint(model: nn.Module) -> tuple[str, int]:
    """A short digest of ``model``'s parameter names and shapes in their order (the device and values play no
    part: a meta build and a real one agree), and how many parameters there are."""
    digest = hashlib.sha256()
    count = 0
    for name, param in model.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)};".encode())
        count += 1
    return digest.hexdigest()[:16], count


@dataclass(frozen=True)
class ResolvedPlan:
    """A resolved plan and the fingerprint (:func:`model_fingerprint`) of the model it was resolved for."""

    plan: ParallelPlan
    fingerprint: str
    num_parameters: int

    @classmethod
    def of(cls, plan: ParallelPlan, model: nn.Module) -> ResolvedPlan:
        return cls(plan, *model_fingerprint(model))

    def plan_for(self, model: nn.Module, *, source: str = "the launcher's plan") -> ParallelPlan:
        """The plan, once ``model`` is seen to be the one it was resolved for; else :class:`PlanMismatch`
        naming both fingerprints (``source``: where the plan came from, for the message)."""
        fingerprint, count = model_fingerprint(model)
        if fingerprint != self.fingerprint:
            raise PlanMismatch(
                f"{source} was resolved for a model with fingerprint {self.fingerprint} ({self.num_parameters} "
                f"parameters), but this worker built {type(model).__name__} with fingerprint {fingerprint} ({count} "
                "parameters): the parameter names or shapes differ; launch the workers with the same model config "
                "(and model files) the launcher validated")
        return self.plan

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "model": {"fingerprint": self.fingerprint, "num_parameters": self.num_parameters},
                "plan": plan_to_dict(self.plan)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ResolvedPlan:
        if data.get("format") != FORMAT:
            raise ValueError(f"a resolved plan of format {data.get('format')!r}; this version reads format {FORMAT}")
        model = data["model"]
        return cls(plan_from_dict(data["plan"]), str(model["fingerprint"]), int(model["num_parameters"]))

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict()))

    @classmethod
    def read(cls, path: Path) -> ResolvedPlan:
        return cls.from_dict(json.loads(path.read_text()))


def plan_to_dict(plan: ParallelPlan) -> dict[str, Any]:
    """``plan`` as JSON values: every field by its name (a per-stage layout's plan nested the same way)."""
    dp, pp, cp, ep = plan.data_parallel, plan.pipeline, plan.context_parallel, plan.expert_parallel
    return {
        "mesh": {"shape": list(plan.mesh.shape), "dim_names": list(plan.mesh.dim_names),
                 "rank_ids": plan.mesh.rank_ids},
        "units": list(plan.units),
        "blocks": list(plan.blocks),
        "data_parallel": None if dp is None else {"mode": dp.mode, "dim_names": list(dp.dim_names)},
        "pipeline": None if pp is None else _pipeline_to_dict(pp),
        "context_parallel": None if cp is None else {"dim": cp.dim, "method": cp.method},
        "placements": placement_texts(plan.placements),
        "layouts": _layouts_to_dict(plan.layouts),
        "activation_checkpointing": plan.activation_checkpointing,
        "activation_checkpointing_every": plan.activation_checkpointing_every,
        "loss_parallel": plan.loss_parallel,
        "expert_parallel": None if ep is None else {"dim": ep.dim, "modules": list(ep.modules)},
        "grid": None if plan.grid is None else {"rows": plan.grid.rows, "cols": plan.grid.cols,
                                                "depth": plan.grid.depth},
        "cube": None if plan.cube is None else {**dataclasses.asdict(plan.cube)},
    }


def plan_from_dict(data: Mapping[str, Any]) -> ParallelPlan:
    """The plan :func:`plan_to_dict` wrote: equal, field by field, to the one it was written from."""
    mesh, dp, pp, cp, ep = (data[k] for k in ("mesh", "data_parallel", "pipeline", "context_parallel",
                                                "expert_parallel"))
    return ParallelPlan(
        mesh=MeshSpec(tuple(mesh["shape"]), tuple(mesh["dim_names"]), mesh["rank_ids"]),
        units=tuple(data["units"]),
        blocks=tuple(data["blocks"]),
        data_parallel=None if dp is None else DataParallelSpec(dp["mode"], tuple(dp["dim_names"])),
        pipeline=None if pp is None else _pipeline_from_dict(pp),
        context_parallel=None if cp is None else ContextParallelSpec(cp["dim"], cp["method"]),
        placements=MappingProxyType(parse_placement_table(data["placements"])),
        layouts=MappingProxyType(_layouts_from_dict(data["layouts"])),
        activation_checkpointing=data["activation_checkpointing"],
        activation_checkpointing_every=data["activation_checkpointing_every"],
        loss_parallel=data["loss_parallel"],
        expert_parallel=None if ep is None else ExpertParallelSpec(ep["dim"], tuple(ep["modules"])),
        grid=GridSpec(**data["grid"]) if data.get("grid") is not None else None,
        cube=_cube_from_dict(data.get("cube")),
    )


def _cube_from_dict(cube: Mapping[str, Any] | None) -> CubeSpec | None:
    if cube is None:
        return None
    dims = cube["dims"]
    return CubeSpec((dims[0], dims[1], dims[2]), tuple(cube["first"]), tuple(cube["second"]), tuple(cube["norms"]),
                    tuple(cube["attention"]), split_heads=bool(cube["split_heads"]))


def _pipeline_to_dict(pp: PipelineSpec) -> dict[str, Any]:
    return {"dim": pp.dim, "schedule": pp.schedule, "num_microbatches": pp.num_microbatches,
            "stages_per_rank": pp.stages_per_rank, "stage_units": [list(units) for units in pp.stage_units],
            "stage_ranks": list(pp.stage_ranks),
            "stages": [{"rank_ids": stage.rank_ids, "layout": plan_to_dict(stage.layout)} for stage in pp.stages]}


def _pipeline_from_dict(pp: Mapping[str, Any]) -> PipelineSpec:
    return PipelineSpec(
        dim=pp["dim"], schedule=pp["schedule"], num_microbatches=pp["num_microbatches"],
        stages_per_rank=pp["stages_per_rank"], stage_units=tuple(tuple(units) for units in pp["stage_units"]),
        stage_ranks=tuple(pp["stage_ranks"]),
        stages=tuple(StagePlan(stage["rank_ids"], plan_from_dict(stage["layout"])) for stage in pp["stages"]))


def _layouts_to_dict(layouts: Mapping[str, LayoutSpec]) -> dict[str, dict[str, dict[str, str]]]:
    """``{module: {"input": {axis: placement}, "output": ...}}``, each placement as the config writes it
    (``Shard(0)``, ``Partial(avg)``)."""
    inputs = placement_texts({fqn: layout.input for fqn, layout in layouts.items()})
    outputs = placement_texts({fqn: layout.output for fqn, layout in layouts.items()})
    return {fqn: {"input": inputs[fqn], "output": outputs[fqn]} for fqn in layouts}


def _layouts_from_dict(layouts: Mapping[str, Mapping[str, Mapping[str, str]]]) -> dict[str, LayoutSpec]:
    inputs = parse_placement_table({fqn: layout["input"] for fqn, layout in layouts.items()})
    outputs = parse_placement_table({fqn: layout["output"] for fqn, layout in layouts.items()})
    return {fqn: LayoutSpec(inputs[fqn], outputs[fqn]) for fqn in layouts}
