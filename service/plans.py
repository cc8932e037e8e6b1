"""A plan computed in a validation worker, within the request's limits (``POST /v1/plans``).

    answer = plan_in_pool(validator, owner="alice", overrides=["+parallel=fsdp", "mesh=[8]"], document=None,
                          page=AutoPlanPage(offset=0, limit=100))
    answer.config, answer.numbers, answer.auto_plan_total, answer.pictures_note, answer.pid

What bounds one plan (docs/control-plane.md has the numbers):

- before anything is planned, the composed document's world size, mesh, global batch and
  micro-batches against the service's ceilings (:func:`service.limits.check_size_ceilings`);
- the plan runs in a worker of :class:`service.validation.Validator`'s pool, never in the
  server, and only in one of the plans' ``plan_workers``, handed out fairly between users (the
  others are the submissions'): ``plan_timeout_s`` (the worker is then replaced) and ``plan_memory_gb`` of address
  space on top of what the worker holds (``RLIMIT_AS``, so an allocation past it fails with
  MemoryError in the worker and the request gets 422);
- the reply: the auto-planner's candidates come one page at a time (``auto_plan_offset``,
  ``auto_plan_limit``) with their total, and a reply still above ``max_plan_reply_bytes``
  leaves its pictures out and says so in ``pictures_note``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from parallel.errors import ConfigError, ConfigIssue
from service.settings import Settings
from service.validation import Validator, resolve_as_service
from trainer.planner.auto.plan import ranking_for
from trainer.planner.report import (  # the trainer's public planning functions
    plan_pictures,
    plan_report,
)


@dataclass(frozen=True)
class AutoPlanPage:
    """Which of the auto-planner's candidates (``+parallel=auto``) a plan reply carries."""

    offset: int = 0
    limit: int = 100


@dataclass(frozen=True)
class PlanAnswer:
    """A computed plan: the validated config (JSON), :func:`trainer.planner.report.plan_report`'s
    numbers with ``pictures`` and a page of ``auto_plan``, the candidates' total, why pictures were
    left out, and the pid of the process that computed it."""

    config: dict[str, Any]
    numbers: dict[str, Any]
    auto_plan_total: int | None
    pictures_note: str | None
    pid: int


def plan_in_pool(validator: Validator, *, owner: str, overrides: list[str] | None, document: dict[str, Any] | None,
                 page: AutoPlanPage) -> PlanAnswer:
    """The plan of ``owner``'s request, computed in ``validator``'s pool within its limits, once one of the
    plans' workers is free and ``owner``'s turn (:class:`~service.plan_queue.PlanQueue`), or
    :class:`ConfigError` naming every problem (a limit met included)."""
    settings = validator.settings
    kind, value = validator.run_plan(owner, "<plan>", compute_plan, overrides, document,
                                     workdir=settings.jobs_dir / "plan", page=page)
    if kind == "invalid":
        raise ConfigError([ConfigIssue(*issue) for issue in value])
    return PlanAnswer(**value)


def warm_plan_worker(settings: Settings) -> int:
    """A pool worker's warm-up (:class:`Validator`'s ``warm_up``): the default config planned once,
    pictures included, so what planning loads lazily (matplotlib, the BLAS threads' buffers, torch's
    packages, a first model) is there before any request, and outside any request's memory limit."""
    compute_plan([], None, workdir=settings.jobs_dir / "plan", settings=settings, page=AutoPlanPage())
    return os.getpid()


def _json_size(value: Any) -> int:
    return len(json.dumps(value, default=str, separators=(",", ":")))


def compute_plan(overrides: list[str] | None, document: dict[str, Any] | None, *, workdir: Path, settings: Settings,
                 page: AutoPlanPage) -> tuple[str, Any]:
    """A plan as plain values (see the module docstring); the config is checked exactly as a job's."""
    try:
        cfg, plan = resolve_as_service(settings, overrides=overrides, document=document, workdir=workdir)
    except ConfigError as err:
        return "invalid", [(i.path, i.reason, i.fix) for i in err.issues]
    numbers = {**plan_report(cfg, plan), "world_size": cfg.world_size, "mesh_shape": list(cfg.mesh_shape)}
    ranking = ranking_for(cfg)  # +parallel=auto: the table the dry run prints
    total = len(ranking.candidates) if ranking is not None else None
    rows = ranking.candidates[page.offset:page.offset + page.limit] if ranking is not None else []
    numbers["auto_plan"] = [asdict(c) for c in rows] if ranking is not None else None
    config = cfg.model_dump(mode="json")
    numbers["pictures"], note = None, None
    if cfg.tracking.pictures:
        pictures = plan_pictures(cfg, plan)
        size = _json_size([numbers, config, pictures])
        if size <= settings.max_plan_reply_bytes:
            numbers["pictures"] = pictures
        else:
            note = (f"pictures left out: with them the reply would be {size} bytes, above this service's limit of "
                    f"{settings.max_plan_reply_bytes} (max_plan_reply_bytes); draw them with `python -m trainer "
                    "... dry_run=true`")
    size = _json_size([numbers, config])
    if size > settings.max_plan_reply_bytes:
        return "invalid", [("<plan>", f"the plan's reply would be {size} bytes, above this service's limit of "
                            f"{settings.max_plan_reply_bytes} (max_plan_reply_bytes)",
                            "ask for fewer auto_plan rows (auto_plan_limit), or plan fewer pipeline ranks")]
    return "ok", {"config": config, "numbers": numbers, "auto_plan_total": total, "pictures_note": note,
                  "pid": os.getpid()}
