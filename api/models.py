"""Request and response models of the REST API (they are its OpenAPI schema)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from service.store import Job, JobState
from service.submit import without_credentials


def _absent_not_null(schema: dict[str, Any]) -> None:
    """No `default: null` in the schema: the key is left out, never sent as null."""
    schema.pop("default", None)


def _integral_number(value: Any) -> Any:
    """``53.0`` as ``53``: JSON Schema's ``integer`` is any number without a fractional part, so a
    client (or schemathesis) may send one with ``.0``; ``53.5``, strings and booleans stay refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


class JobCreate(BaseModel):
    """A job to run: Hydra overrides as typed after `python -m trainer`, or a whole config document,
    exactly one of the two (`"overrides": []` is the default config)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        # What _one_source enforces, stated in the schema: exactly one of the two keys.
        "oneOf": [{"required": ["overrides"], "title": "By overrides"},
                  {"required": ["config"], "title": "By document"}],
        "examples": [{"name": "dp-demo", "overrides": ["+parallel=dp", "mesh=[2]", "train.steps=20"]}]})

    name: str = Field("job", min_length=1, max_length=200, description="A label for people; need not be unique.")
    # Absent, never null: the schema's oneOf tells the two sources apart by which key is present.
    overrides: list[Annotated[str, Field(max_length=1000)]] = Field(
        None, max_length=200, json_schema_extra=_absent_not_null,  # type: ignore[arg-type]
        description="Hydra overrides against conf/ (`+parallel=3d`, `mesh=[2,2,2]`, `train.steps=50`); "
                    "no `hydra.*`, `_target_`, `~`/`++` forms or `${...}`. Give this or `config`.")
    config: dict[str, Any] = Field(
        None, json_schema_extra=_absent_not_null,  # type: ignore[arg-type]
        description="A whole config document (the shape `python -m trainer --cfg job` prints) instead of overrides.")
    priority: Annotated[int, BeforeValidator(_integral_number)] = Field(
        0, ge=-100, le=100, description="Higher starts first; FIFO among equal priorities.")

    @model_validator(mode="after")
    def _one_source(self) -> "JobCreate":
        if (self.overrides is None) == (self.config is None):
            raise ValueError("give exactly one of overrides (a list of Hydra overrides; [] for the defaults) "
                             "and config (a whole document), not " + ("both" if self.overrides is not None
                                                                      else "neither"))
        return self


class Problem(BaseModel):
    """One thing wrong with a request, as the CLI reports it."""

    path: str = Field(description="Config path (`train.checkpoint.dir`, `parallel.placements[\"...\"].tp`) or "
                                  "request field.")
    reason: str = Field(description="What is wrong.")
    fix: str = Field(description="How to make it right.")


class ProblemList(BaseModel):
    """The body of every 422 response."""

    detail: list[Problem] = Field(description="Every problem found, all at once.")


class Message(BaseModel):
    """The body of 401, 403, 404, 409 and 413 responses."""

    detail: str = Field(description="What went wrong.")


def _utc(moment: datetime | None) -> datetime | None:
    """The instant in UTC: SQLite returns naive datetimes (the store writes UTC), PostgreSQL aware
    ones in its session's TimeZone."""
    if moment is None:
        return None
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)


class JobSummary(BaseModel):
    """A job as the list shows it: everything but the config document (read one job for that)."""

    id: str = Field(description="Job id (UUID).")
    name: str = Field(description="The label given at submission.")
    owner: str = Field(description="The user who submitted it.")
    state: JobState = Field(description="QUEUED -> STARTING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED "
                                        "(CANCELLING between).")
    priority: int = Field(description="Higher starts first.")
    overrides: list[str] | None = Field(description="The overrides submitted, if the job was submitted as overrides.")
    world_size: int = Field(description="Worker processes (= worker slots) the job needs: prod(mesh).")
    created_at: datetime = Field(description="When the job was accepted (UTC).")
    started_at: datetime | None = Field(description="When its process started (UTC).")
    finished_at: datetime | None = Field(description="When it ended (UTC).")
    exit_code: int | None = Field(description="The trainer's exit code: 0 ok, 1 worker failure, 2 bad config, "
                                              "143 SIGTERM.")
    error: str | None = Field(description="Why it failed: the reason and the last lines of its log.")
    executor: str | None = Field(None, description="What runs the job: local (processes on the service's host), ray "
                                                   "or kubernetes.")
    pid: int | None = Field(description="Process id of the job's process group leader, while known (local jobs).")
    mlflow_run_id: str | None = Field(description="The MLflow run the job logs to (created at submission).")
    mlflow_ui_url: str | None = Field(description="Link to the run in the MLflow UI, when the service knows the "
                                                  "UI's address.")

    @classmethod
    def fields_of(cls, job: Any, ui_url: str | None) -> dict[str, Any]:
        """The summary's fields of a :class:`Job` or of a row of its summary columns."""
        return dict(id=job.id, name=job.name, owner=job.owner, state=JobState(job.state), priority=job.priority,
                    overrides=job.overrides, world_size=job.world_size, created_at=_utc(job.created_at),
                    started_at=_utc(job.started_at), finished_at=_utc(job.finished_at), exit_code=job.exit_code,
                    error=job.error, executor=job.executor, pid=job.pid, mlflow_run_id=job.mlflow_run_id,
                    mlflow_ui_url=ui_url)


class JobPublic(JobSummary):
    """A job as the service knows it."""

    config: dict[str, Any] = Field(description="The resolved, validated config the job runs with.")

    @classmethod
    def from_job(cls, job: Job, ui_url: str | None) -> "JobPublic":
        return cls(**cls.fields_of(job, ui_url), config=without_credentials(job.config))


class JobList(BaseModel):
    """One page of jobs, newest first. Page with ``limit`` and ``offset``: the next page starts at
    ``offset + limit`` while that is below ``total``."""

    items: list[JobSummary] = Field(description="The jobs on this page, without their config documents "
                                    "(GET /v1/jobs/{job_id} has it).")
    total: int = Field(description="Jobs matching the filters, over all pages.")
    limit: int = Field(description="Page size asked for.")
    offset: int = Field(description="Jobs skipped before this page.")

    @classmethod
    def page_json(cls, rows: Iterable[Sequence[Any]], *, keys: Sequence[str], total: int, limit: int, offset: int,
                  ui_link: Callable[[str | None, str | None], str | None]) -> str:
        """A page of the store's summary rows (tuples in the order of ``keys``) as this model's JSON.

        The whole page is validated and serialized by pydantic-core in one call each, not one
        :class:`JobSummary` constructed in Python per row: on the list endpoint that halved the
        time per page of 50. Keys the summary does not have (the workdir, the request hash) are
        ignored by the validation."""
        items = []
        for row in rows:
            item = dict(zip(keys, row))
            item["created_at"], item["started_at"], item["finished_at"] = (
                _utc(item["created_at"]), _utc(item["started_at"]), _utc(item["finished_at"]))
            item["mlflow_ui_url"] = ui_link(item["mlflow_experiment_id"], item["mlflow_run_id"])
            items.append(item)
        page = cls.model_validate({"items": items, "total": total, "limit": limit, "offset": offset})
        return page.model_dump_json()


class MetricPoint(BaseModel):
    """One logged value of a metric."""

    step: int = Field(description="Training step.")
    value: float | None = Field(description="The value (null when MLflow stored NaN).")
    timestamp: int = Field(description="Milliseconds since the epoch.")


class MetricsPublic(BaseModel):
    """A job's metric histories, read from its MLflow run."""

    job_id: str = Field(description="Job id.")
    mlflow_run_id: str | None = Field(description="The MLflow run read; null for `tracking=none` jobs.")
    run_status: str | None = Field(description="MLflow's status of the run: RUNNING, FINISHED, FAILED, KILLED.")
    metrics: dict[str, list[MetricPoint]] = Field(description="Metric name (`loss`, `lr`, `grad_norm`, ...) -> "
                                                              "history by step.")


class PlanRank(BaseModel):
    """What one pipeline rank holds."""

    pp_rank: int = Field(description="Pipeline rank.")
    stages: list[int] = Field(description="Stages this rank runs.")
    params: int = Field(description="Parameters it holds after tensor-parallel sharding.")
    param_bytes: float = Field(description="Bytes of parameters per rank after data-parallel sharding.")
    grad_bytes: float = Field(description="Bytes of gradients per rank.")
    optim_bytes: float = Field(description="Bytes of AdamW state per rank.")
    gathered_bytes: float = Field(0.0, description="Bytes of FSDP's gathered (unsharded) parameters, or "
                                                   "autocast's bf16 weight copies, at the peak.")
    activation_bytes: float = Field(0.0, description="Bytes of activations saved for backward at the peak, over the "
                                    "micro-batches in flight.")
    microbatches_in_flight: int = Field(1, description="Micro-batch passes whose activations this rank holds at once.")
    backward_bytes: float = Field(0.0, description="Bytes backward adds to the saved activations at its worst moment "
                                  "(gradients of the largest activations and of the logits).")
    process_bytes: float = Field(0.0, description="Bytes of the worker's runtime and, on CPU, of glibc's heap holes.")
    peak_bytes: float = Field(0.0, description="Predicted peak bytes per rank: weights + grads + AdamW + "
                                               "gathered + the larger of (activations + backward) and the optimizer "
                                               "step's temporaries + process.")
    peak_phase: str | None = Field(None, description="The moment of the step the peak is at: backward, gradient reduce "
                                   "or optimizer step; null where the activations could not be predicted.")
    terms_bytes: dict[str, float] | None = Field(None, description="The peak by named term (weights, optimizer_state, "
                                                 "gradients, gathered_parameters, activations, recompute, "
                                                 "logits_and_loss, backward_transient, gradient_reduce_buffers, "
                                                 "optimizer_step_temporaries, runtime, allocator_slack), adding up "
                                                 "to peak_bytes (docs/planning.md, Memory); null where the "
                                                 "activations could not be predicted.")


class PlanPictures(BaseModel):
    """The plan drawn: what a run logs under ``pictures/``, predicted instead of measured."""

    placement_png: str = Field(description="The placement picture, PNG, base64: each stage's mesh as a grid of ranks "
                               "and each parameter group cut into the slices its ranks hold.")
    placement: dict[str, Any] = Field(description="The slice table behind it: per group and stage, shape, placements "
                                      "and each rank's [start, stop) per tensor dim.")
    timeline_png: str | None = Field(None, description="With a pipeline: the schedule's predicted timeline "
                                                       "(unit costs: a forward 1, a backward 2), PNG, base64.")
    timeline: dict[str, Any] | None = Field(None,
                                            description="The same timeline as a Chrome trace (Perfetto opens it).")
    bubble_theory: float | None = Field(None, description="The schedule's theoretical bubble, e.g. (p-1)/(m+p-1).")


class AutoPlanRowPublic(BaseModel):
    """One layout the auto-planner considered (``+parallel=auto``), in ranking order."""

    label: str = Field(description="The layout in short: dp x pp x tp with modes, schedule, micro-batches, "
                                   "AC, precision.")
    status: str = Field(description="chosen, slower, does not fit, pruned or invalid.")
    reason: str = Field(description="Why it was chosen or why it lost.")
    mesh: list[int] = Field(description="Its mesh shape.")
    parallel: dict[str, Any] = Field(description="Its parallel section, as a config would write it.")
    precision: str = Field(description="Its compute precision.")
    step_s: float | None = Field(None, description="Predicted seconds per optimizer step (null: not predicted).")
    tokens_per_s: float | None = Field(None, description="Predicted tokens per second.")
    peak_bytes: float | None = Field(None, description="Predicted per-rank peak memory in bytes.")
    lower_bound_s: float | None = Field(None, description="The lower bound on its step time the search pruned by.")
    parts_s: dict[str, float] = Field(default_factory=dict, description="Predicted seconds by part: compute, bubble, "
                                      "comm per axis, optimizer, unitemized (what the calibration's reference "
                                      "training steps take beyond the itemized parts).")
    traffic: dict[str, float] = Field(default_factory=dict, description="Bytes a rank sends per step, per mesh axis.")


class PlanPublic(BaseModel):
    """The plan of a valid config: what would run where; nothing is launched."""

    world_size: int = Field(description="Worker processes: prod(mesh).")
    mesh_shape: list[int] = Field(description="Mesh shape, outermost axis first.")
    dims: list[str] = Field(description="Mesh axis names ([] for one device).")
    model: str = Field(description="Model architecture.")
    stage_boundaries: list[str] = Field(description="First module of every pipeline stage but the first.")
    stage_params: list[int] = Field(description="Parameters per pipeline stage.")
    per_pp_rank: list[PlanRank] = Field(description="Memory per pipeline rank.")
    bubble: float = Field(description="Pipeline bubble fraction (0 without a pipeline).")
    comm_bytes_per_step: dict[str, float] = Field(description="Bytes each rank sends per optimizer step, "
                                                              "per mesh axis.")
    memory_budget_bytes: float = Field(0.0, description="The per-rank budget a run is checked against "
                                       "(launch.memory_budget_gb, the GPU's memory, or a share of the host's).")
    memory_note: str | None = Field(None, description="Why activations were not predicted (then each rank's peak "
                                    "is weights + grads + AdamW only, a lower bound); null when they were.")
    pictures: PlanPictures | None = Field(None, description="The plan drawn (null with tracking.pictures=false).")
    pictures_note: str | None = Field(None, description="Why the pictures were left out although tracking.pictures "
                                      "is on (the reply would pass the service's max_plan_reply_bytes); "
                                      "null otherwise.")
    auto_plan: list[AutoPlanRowPublic] | None = Field(
        None, description="With parallel.auto: one page (auto_plan_offset, auto_plan_limit) of the layouts the planner "
        "considered, in ranking order, the chosen one first; null otherwise.")
    auto_plan_total: int | None = Field(None, description="With parallel.auto: how many layouts the planner "
                                        "considered (every page together); null otherwise.")
    config: dict[str, Any] = Field(description="The resolved, validated config.")
