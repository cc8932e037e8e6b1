"""/v1/plans: validate a config and describe how it would run, without launching anything.

The plan is computed in the validation pool within the service's limits (service/plans.py): the
size ceilings before any planning, a time and a memory limit, a bounded reply, and at most
``max_plans_per_user`` plans of one user at once (429 with Retry-After past it)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.deps import CurrentUser, PlaneDep
from api.errors import BODY_RESPONSES, ERROR_RESPONSES, QUOTA_RESPONSES
from api.models import AutoPlanRowPublic, JobCreate, PlanPublic, PlanRank
from service.plans import AutoPlanPage

router = APIRouter(prefix="/v1/plans", tags=["plans"], responses=ERROR_RESPONSES)


@router.post("", response_model=PlanPublic, responses={**BODY_RESPONSES, **QUOTA_RESPONSES})
def create_plan(body: JobCreate, plane: PlaneDep, user: CurrentUser,
                auto_plan_offset: Annotated[int, Query(ge=0, le=1_000_000, description="With parallel.auto: the "
                                                       "first candidate layout of the page.")] = 0,
                auto_plan_limit: Annotated[int, Query(ge=1, le=1000, description="With parallel.auto: candidate "
                                                      "layouts per page.")] = 100,
                ) -> PlanPublic:
    """Validate a config and describe its plan: world size, mesh, stages, memory and communication per rank,
    pictures."""
    answer = plane.plan(owner=user, overrides=body.overrides, document=body.config,
                        page=AutoPlanPage(offset=auto_plan_offset, limit=auto_plan_limit))
    numbers, config = answer.numbers, answer.config
    dims = list(config["parallel"]["dims"]) if config.get("parallel") else []
    return PlanPublic(
        world_size=numbers["world_size"], mesh_shape=list(numbers["mesh_shape"]), dims=dims,
        model=config["model"]["arch"], stage_boundaries=list(numbers["boundaries"]),
        stage_params=list(numbers["stage_params"]),
        per_pp_rank=[PlanRank(**{**memory, **rank})
                     for rank, memory in zip(numbers["per_pp_rank"], numbers["memory"], strict=True)],
        bubble=float(numbers["bubble"]), comm_bytes_per_step={axis: float(n) for axis, n in numbers["comm"].items()},
        memory_budget_bytes=float(numbers["memory_budget"]["bytes"]), memory_note=numbers["memory_note"],
        pictures=numbers["pictures"], pictures_note=answer.pictures_note, config=config,
        auto_plan=[AutoPlanRowPublic(**row) for row in numbers["auto_plan"]] if numbers["auto_plan"] is not None
        else None,
        auto_plan_total=answer.auto_plan_total,
    )
