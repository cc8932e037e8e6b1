"""Control-plane settings, from ``MESHFLOW_*`` environment variables (pydantic-settings).

    MESHFLOW_WORKSPACE=/srv/meshflow MESHFLOW_TOKENS='{"alice": "s3cret"}' \
    MESHFLOW_ADMIN_USERS='["alice"]' MESHFLOW_CAPACITY=8 python -m api

Tokens are hashed as soon as the settings are read (``sha256$<salt>$<hex>``, a fresh random
salt per token); a value already in that form is kept as is, so a deployment can store only
hashes. Auth is off only when ``MESHFLOW_AUTH_DISABLED=true`` says so.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

HASH_SCHEME = "sha256"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


def hash_token(token: str, salt: str | None = None) -> str:
    """``sha256$<salt>$<hex digest of salt + token>``; a new random salt unless one is given."""
    salt = salt if salt is not None else secrets.token_hex(16)
    digest = hashlib.sha256((salt + token).encode()).hexdigest()
    return f"{HASH_SCHEME}${salt}${digest}"


def token_matches(token: str, hashed: str) -> bool:
    """Constant-time check of a presented token against one stored hash."""
    try:
        scheme, salt, _ = hashed.split("$", 2)
    except ValueError:
        return False
    return scheme == HASH_SCHEME and hmac.compare_digest(hash_token(token, salt), hashed)


def _is_hashed(value: str) -> bool:
    parts = value.split("$")
    return len(parts) == 3 and parts[0] == HASH_SCHEME and len(parts[2]) == 64


def host_memory_bytes() -> int:
    """This host's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class Settings(BaseSettings):
    """Everything the control plane needs to know; each field is one ``MESHFLOW_<NAME>`` variable."""

    model_config = SettingsConfigDict(env_prefix="MESHFLOW_", extra="ignore")

    host: str = Field("127.0.0.1", description="Address uvicorn binds to.")
    port: int = Field(8000, ge=0, le=65535, description="Port uvicorn binds to.")
    workspace: Path = Field(Path("meshflow-workspace"),
                            description="Directory holding every job's files; all job paths stay inside it.")
    database_url: str | None = Field(None, description="SQLAlchemy URL of the job store; null = SQLite file "
                                                       "`<workspace>/meshflow.db`.")
    mlflow_tracking_uri: str | None = Field(None,
                                            description="MLflow store the jobs log to; null = "
                                                        "`sqlite:///<workspace>/mlflow.db`.")
    mlflow_artifact_root: Path | None = Field(None, description="Where new MLflow experiments keep their runs' "
                                              "artifacts when the service writes the store itself (a database URI); "
                                              "null = `<workspace>/mlartifacts`. An MLflow server's own setting wins.")
    mlflow_ui_url: str | None = Field(None, description="Base URL of the MLflow UI showing the jobs' store, for each "
                                      "job's run link (`mlflow_ui_url` in replies, the job log's summary); null = the "
                                      "tracking server itself, or for a database store http://127.0.0.1:5000, where "
                                      "`mlflow ui --backend-store-uri <the store> --port 5000` serves it "
                                      "(logged at start).")
    tokens: dict[str, str] = Field(default_factory=dict,
                                   description="User -> bearer token (plain, hashed on load) or `sha256$salt$hex`.")
    admin_users: list[str] = Field(default_factory=list, description="Users who see and cancel every job.")
    metrics_public: bool = Field(False, description="Serve /metrics without a token (a Prometheus scraper on a "
                                 "private network); by default it asks for a bearer token like every other route: "
                                 "the counts of jobs and submissions are the tenants' business.")
    auth_disabled: bool = Field(False, description="Serve without authentication (local use only); every caller "
                                                   "is an admin.")
    # 8 CPU workers run (slowly) even on a 2-core host, so the README's 3d job fits by default.
    capacity: int = Field(default_factory=lambda: max(8, os.cpu_count() or 8), ge=0,
                          description="Worker slots; a job needs prod(mesh) of them. 0 queues jobs and "
                                      "never starts one.")
    max_request_bytes: int = Field(1_000_000, ge=1024,
                                   description="Largest accepted request body; larger ones get 413.")
    cancel_grace_s: float = Field(10.0, ge=0, description="Seconds between SIGTERM and SIGKILL when cancelling a job.")
    poll_interval_s: float = Field(0.25, gt=0, description=(
        "How often the scheduler looks at running jobs and the queue while a job is active "
        "(idle, it waits for a submit or cancel, and looks every 5 s)."))
    log_tail_lines: int = Field(20, ge=1, description="Lines of a failed job's log kept as its error summary.")
    db_pool_size: int = Field(20, ge=1, description="Connections the job store's pool keeps open.")
    db_max_overflow: int = Field(10, ge=0, description="Extra connections the pool may open under a burst.")
    db_pool_timeout_s: float = Field(10.0, gt=0, description="Seconds a request waits for a free connection.")
    # Limits on what one user may ask for; each refusal names the field, the limit and the fix.
    max_steps: int = Field(1_000_000, ge=1, description="Ceiling on train.steps of a submitted job.")
    max_restarts: int = Field(3, ge=0, description="Ceiling on launch.max_restarts of a submitted job.")
    max_rank_memory_gb: float | None = Field(
        None, gt=0, description="Ceiling on a job's predicted peak memory per rank (GiB, by the plan's prediction); "
        "null = 90% of this host's memory shared by the job's own workers on a node (not by `capacity`: "
        "a single-device job may use the host, an 8-worker one an eighth of it each).")
    max_json_depth: int = Field(32, ge=4, le=200,
                                description="Deepest nesting of a request's JSON body; deeper gets 422.")
    max_queued_per_user: int = Field(20, ge=1, description="Jobs one user may have QUEUED at once; more get 429.")
    max_running_per_user: int = Field(4, ge=1, description="Jobs of one user the scheduler runs at once; "
                                      "the rest wait without blocking other users' jobs.")
    max_log_streams_per_user: int = Field(4, ge=1,
                                          description="Live `logs?follow=true` streams one user may hold; "
                                                      "more get 429.")
    validation_workers: int = Field(
        default_factory=lambda: min(2, os.cpu_count() or 1), ge=0, le=64,
        description="Worker processes validating submissions and computing plans in parallel (Hydra composition + "
                    "model checks); 0 validates in the request's thread, one composition at a time.")
    # Plans (POST /v1/plans) and submissions are bounded before and while they are computed (service/plans.py).
    max_world_size: int = Field(4096, ge=1, description="Ceiling on prod(mesh) of a plan or a job, checked before "
                                "any planning (a job also needs at most `capacity` slots when that is not 0).")
    max_global_batch_size: int = Field(65536, ge=1, description="Ceiling on train.global_batch_size of a plan or a "
                                       "job, checked before any planning.")
    max_microbatches: int = Field(1024, ge=1, description="Ceiling on parallel.pipeline.microbatches of a plan or a "
                                  "job, checked before any planning (a plan's timeline has one event per "
                                  "micro-batch, stage and pass).")
    plan_timeout_s: float = Field(120.0, gt=0, description="Seconds one plan or validation may compute in a pool "
                                  "worker; past it the worker is replaced and the request gets 422.")
    plan_memory_gb: float = Field(4.0, gt=0, description="Address space (GiB) one plan or validation may add in its "
                                  "pool worker (RLIMIT_AS); past it the request gets 422.")
    max_plan_reply_bytes: int = Field(4_000_000, ge=10_000, description="Largest plan reply (JSON): past it the "
                                      "pictures are left out (`pictures_note` says so), and a plan still "
                                      "larger is refused.")
    max_plans_per_user: int = Field(4, ge=1, description="Plans one user may have computing or waiting for a worker "
                                    "at once; more get 429 with Retry-After.")
    # One user's slow plans had held every validation worker, and other users' submissions waited behind them.
    plan_workers: int | None = Field(None, ge=1, le=64, description="Validation workers plans may use at once, "
                                     "handed out fairly between users; the other workers are kept for submissions, "
                                     "which then never wait behind a plan. null = all but one of "
                                     "`validation_workers` (at least 1: a single worker is shared).")
    plan_queue_size: int = Field(16, ge=0, description="Plans that may wait for one of the plans' workers, all users "
                                 "together; more get 429 with Retry-After, as does a plan that waited "
                                 "`plan_timeout_s` without one. Each waiting plan holds one of the server's "
                                 "request threads (40).")
    validation_cache_size: int = Field(256, ge=0, description="Validated submissions remembered, so an identical "
                                       "one is answered without composing again (only configs whose checks "
                                       "read no file).")
    # The control plane shares the host with its local jobs: while a job's processes import torch and
    # train on every core, requests would otherwise wait for CPU time (docs/control-plane-load.md).
    job_nice: int = Field(10, ge=0, le=19, description="How far below the server's CPU priority local jobs run "
                          "(`nice`); 0 = the same priority. Only matters when jobs and requests compete for cores.")
    job_env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables every job gets "
                                    "(on top of the allow-listed ones: PATH, HOME, locale, torch / OMP / CUDA "
                                    "/ NCCL ...).")
    # -- where jobs run (service/executors) -------------------------------------------------
    executor: Literal["local", "ray", "kubernetes"] = Field(
        "local", description="Which engine runs the jobs: `local` processes on this host, a `ray` cluster, or "
        "`kubernetes` (one JobSet per job). Users' configs are the same for every engine.")
    # The Ray executor's settings (MESHFLOW_EXECUTOR=ray; service/executors/ray.py).
    ray_address: str = Field("http://127.0.0.1:8265", description="The Ray cluster's job-submission (dashboard) "
                             "address, as `ray start --head` prints it; used when executor is `ray`.")
    # The Kubernetes executor's settings (MESHFLOW_EXECUTOR=kubernetes; service/executors/kubernetes.py).
    kubernetes_namespace: str | None = Field(
        None, description="Namespace the jobs' JobSets and ConfigMaps are created in; null = the api pod's own "
        "namespace in a cluster, else the kubeconfig context's namespace, else `default`.")
    kubernetes_image: str = Field("meshflow:0.1.0", description="Image of the job pods (deploy/Dockerfile; "
                                  "the same image as the api). Push it to a registry the cluster pulls from.")
    kubernetes_image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="imagePullPolicy of the job pods.")
    kubernetes_cpu_per_worker: float = Field(1.0, gt=0, description="CPUs requested per worker process; a pod "
                                             "requests this times its workers (world size / launch.nnodes).")
    kubernetes_memory_gb_per_worker: float = Field(2.0, gt=0, description="Memory (GiB) requested per worker "
                                                   "process; the pod's request and limit are this times its workers.")
    kubernetes_gpus_per_node: int = Field(0, ge=0, description="`nvidia.com/gpu` each job pod asks for; 0 = CPU "
                                          "pods. A job with more workers per node than this is refused.")
    kubernetes_service_account: str | None = Field(
        None, description="ServiceAccount of the job pods (they need no API access: its token is not mounted); "
        "null = the namespace's default.")
    kubernetes_workspace_pvc: str | None = Field(
        None, description="PersistentVolumeClaim (ReadWriteMany) holding this workspace. A job pod mounts only its "
        "own job directory from it (read-write) and the `datasets/` and `models/` areas (read-only), at the same "
        "paths as the api, so a job's checkpoints and logs are shared by its nodes and the api and no other "
        "tenant's are in reach; null = an emptyDir per pod (nothing a job writes outlives it).")
    kubernetes_tracking_secret: str | None = Field(
        None, description="Secret in the jobs' namespace that job pods read the tracking store's credentials from "
        "(secretKeyRef, nothing else of it): key `MLFLOW_TRACKING_URI` (the store's URI with user:password), and "
        "optionally `MLFLOW_TRACKING_USERNAME` / `MLFLOW_TRACKING_PASSWORD` / `MLFLOW_TRACKING_TOKEN` for an MLflow "
        "server behind authentication. Required when MESHFLOW_MLFLOW_TRACKING_URI holds credentials: they never go "
        "into a ConfigMap or a pod's plain environment. null = no credentials.")
    kubernetes_scratch_gb: float = Field(8.0, gt=0, le=1024, description="Size of each job pod's writable scratch "
                                         "(an emptyDir at /tmp, also its HOME: torch's, MLflow's and matplotlib's "
                                         "caches); the root filesystem is read-only. Past it the pod is evicted.")
    kubernetes_rdzv_port: int = Field(29400, ge=1, le=65535, description="Port of the c10d rendezvous on the "
                                      "first node's pod.")

    @field_validator("tokens")
    @classmethod
    def _hash_tokens(cls, tokens: dict[str, str]) -> dict[str, str]:
        return {user: value if _is_hashed(value) else hash_token(value) for user, value in tokens.items()}

    @model_validator(mode="after")
    def _refuse_open_bind_without_auth(self) -> "Settings":
        if self.auth_disabled and self.host not in LOOPBACK_HOSTS:
            raise ValueError(f"MESHFLOW_AUTH_DISABLED=true with MESHFLOW_HOST={self.host}: anyone who reaches "
                             "this address could run jobs as an admin; bind to 127.0.0.1, or set MESHFLOW_TOKENS")
        return self

    @model_validator(mode="after")
    def _resolve_paths(self) -> "Settings":
        self.workspace = self.workspace.expanduser().resolve()
        if self.database_url is None:
            self.database_url = f"sqlite:///{self.workspace / 'meshflow.db'}"
        if self.mlflow_tracking_uri is None:
            self.mlflow_tracking_uri = f"sqlite:///{self.workspace / 'mlflow.db'}"
        self.mlflow_artifact_root = (self.mlflow_artifact_root or self.workspace / "mlartifacts").expanduser().resolve()
        return self

    @property
    def jobs_dir(self) -> Path:
        return self.workspace / "jobs"

    def user_for_token(self, token: str) -> str | None:
        """The user whose token this is, or None; every stored hash is checked (no early exit)."""
        found = None
        for user, hashed in self.tokens.items():
            if token_matches(token, hashed) and found is None:
                found = user
        return found

    def is_admin(self, user: str) -> bool:
        return self.auth_disabled or user in self.admin_users

    def rank_memory_limit(self, workers: int = 1) -> tuple[float, str]:
        """``(bytes per rank a job with ``workers`` workers per node may be predicted to need, where the
        number comes from)``: ``max_rank_memory_gb``, else the host shared by those workers, what
        actually runs for the job (the trainer's own default, :func:`trainer.planner.memory.budget.memory_budget`).
        Dividing by ``capacity`` instead refused a single-device 135M job on a 24 GiB host with capacity 8
        (2.7 GiB per rank), though the job alone would use one worker's memory."""
        if self.max_rank_memory_gb is not None:
            return self.max_rank_memory_gb * 2**30, "max_rank_memory_gb"
        host = host_memory_bytes()
        workers = max(1, workers)
        return 0.9 * host / workers, f"90% of this host's {host / 2**30:.1f} GiB over the job's {workers} worker(s)"
