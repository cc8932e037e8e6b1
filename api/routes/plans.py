"""/v1/plans: validate a config and describe how it would run, without launching anything."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import CurrentUser, PlaneDep
from api.errors import BODY_RESPONSES, ERROR_RESPONSES
from api.models import AutoPlanRowPublic, JobCreate, PlanPublic, PlanRank

router = APIRouter(prefix="/v1/plans", tags=["plans"], responses=ERROR_RESPONSES)


@router.post("", response_model=PlanPublic, responses=BODY_RESPONSES)
def create_plan(body: JobCreate, plane: PlaneDep, user: CurrentUser) -> PlanPublic:
    """Validate a config and describe its plan: world size, mesh, stages, memory and communication per rank, pictures."""
    cfg, numbers = plane.plan(overrides=body.overrides, document=body.config)
    return PlanPublic(
        world_size=cfg.world_size, mesh_shape=list(cfg.mesh_shape), dims=list(cfg.parallel.dims) if cfg.parallel else [],
        model=cfg.model.arch, stage_boundaries=list(numbers["boundaries"]), stage_params=list(numbers["stage_params"]),
        per_pp_rank=[PlanRank(**{**memory, **rank})
                     for rank, memory in zip(numbers["per_pp_rank"], numbers["memory"], strict=True)],
        bubble=float(numbers["bubble"]), comm_bytes_per_step={axis: float(n) for axis, n in numbers["comm"].items()},
        memory_budget_bytes=float(numbers["memory_budget"]["bytes"]), memory_note=numbers["memory_note"],
        pictures=numbers["pictures"], config=cfg.model_dump(mode="json"),
        auto_plan=[AutoPlanRowPublic(**row) for row in numbers["auto_plan"]] if numbers.get("auto_plan") else None,
    )
