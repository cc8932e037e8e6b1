"""Render one job as Kubernetes resources: a JobSet (jobset.x-k8s.io/v1alpha2) and its ConfigMap.

Pure functions of the job and the settings, no cluster and no client: ``render(launch, settings)``
gives plain dicts that ``kubernetes.py`` submits and the tests validate against the published
schemas. The shape follows JobSet's own PyTorch example:

- one replicated job ``node`` whose single indexed Job runs ``launch.nnodes`` pods
  (``completionMode: Indexed``); each pod's ``JOB_COMPLETION_INDEX`` is its node rank;
- ``network.enableDNSHostnames``: JobSet makes a headless Service named after the JobSet, so the
  first node's pod is ``<jobset>-node-0-0.<jobset>``, the c10d rendezvous endpoint of every node;
- every pod runs the same command, ``python -m trainer.launch /etc/meshflow/job.json
  --node-rank-env JOB_COMPLETION_INDEX --rdzv-endpoint <endpoint> --rdzv-id <job id>``, on the
  config the control plane validated, mounted from the ConfigMap (read-only);
- no retries at the Kubernetes level (``backoffLimit: 0``, ``failurePolicy.maxRestarts: 0``):
  torch's elastic agent restarts workers (``launch.max_restarts``); a pod that fails fails the job.

Tenants apart: a pod mounts from the workspace only its own job directory (``subPath``, read-write)
and the read-only ``datasets/`` and ``models/`` areas (service/confine.py's rule), at the api's
paths; never the job store, other jobs' directories or the shared token cache (a pod tokenizes into
its own directory). Its root filesystem is read-only (scratch: an emptyDir at /tmp, also its HOME),
it runs as a non-root user with no privilege escalation, no capabilities and the runtime's default
seccomp profile (Pod Security Standard "restricted"). No credentials in the ConfigMap or the pod's
plain environment: the config names the tracking store without them
(trainer.tracking.credentials) and the pod reads them from the Secret
``MESHFLOW_KUBERNETES_TRACKING_SECRET`` names (``secretKeyRef``, those keys only).

Why a JobSet and not a Kubeflow Trainer TrainJob: a TrainJob's torch runtime starts ``torchrun``
itself, while Meshflow's launcher is the one that starts the elastic agent (and validates, plans
and owns the MLflow run first); a JobSet runs our command as it is and needs only the JobSet
controller, which Kubeflow Trainer itself is built on.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from service.executors.base import JobLaunch
from service.runner import ENV_NAMES, HOST_ENV_NAMES
from service.settings import Settings
from trainer.tracking.credentials import MLFLOW_AUTH_ENV, TRACKING_URI_ENV, has_credentials, strip_credentials

JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL, JOBSET_KIND = "jobset.x-k8s.io", "v1alpha2", "jobsets", "JobSet"
JOBSET_API_VERSION = f"{JOBSET_GROUP}/{JOBSET_VERSION}"
REPLICATED_JOB = "node"
CONTAINER = "trainer"
CONFIG_DIR, CONFIG_FILE = "/etc/meshflow", "job.json"
PLAN_FILE = "resolved_plan.json"  # service.runner.PLAN_NAME: the name the launcher looks for beside job.json
NODE_RANK_ENV = "JOB_COMPLETION_INDEX"       # set by Kubernetes in every pod of an indexed Job
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"   # JobSet labels its Jobs and pods with it
JOB_ID_LABEL = "meshflow.dev/job-id"
NAME_PREFIX = "mf-"
# A pod's hostname is <jobset>-<replicated job>-<job index>-<pod index> and must be a DNS label.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_MAX_JOBSET_NAME = 63 - len(f"-{REPLICATED_JOB}-0-") - 4   # room for up to 9999 nodes
# The pod's only writable paths besides its job directory: scratch (an emptyDir), also its HOME.
SCRATCH_DIR = "/tmp"
SCRATCH_HOME = f"{SCRATCH_DIR}/home"
READ_ONLY_AREAS = ("datasets", "models")   # service.confine.READ_ONLY_AREAS: what a job may read
TOKEN_CACHE = ".cache/meshflow-tokens"     # a pod's own, in its job directory (the shared one is every tenant's)
RUN_AS = 10001                             # deploy/Dockerfile's user
LOCAL_STORES = ("", "file", "sqlite")      # tracking URIs naming a file: on the api's disk, not a pod's


@dataclass(frozen=True)
class RenderedJob:
    """The resources of one job, as the API server takes them."""

    namespace: str
    name: str
    config_map: dict[str, Any]
    jobset: dict[str, Any]

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


def jobset_name(job_id: str) -> str:
    """``mf-<job id>``, lower-cased; refused when it cannot name a JobSet whose pods get DNS hostnames."""
    name = NAME_PREFIX + job_id.lower()
    if len(name) > _MAX_JOBSET_NAME or not _DNS_LABEL.match(name):
        raise ValueError(f"job id {job_id!r} cannot name a JobSet: {name!r} must be a DNS label of at most "
                         f"{_MAX_JOBSET_NAME} characters (lower-case letters, digits, '-'); the job store's UUIDs are")
    return name


def rendezvous_endpoint(name: str, port: int) -> str:
    """The first node's pod through the JobSet's headless Service (its subdomain is the JobSet's name)."""
    return f"{name}-{REPLICATED_JOB}-0-0.{name}:{port}"


def workers_per_node(launch: JobLaunch) -> int:
    nnodes = launch.nnodes
    if nnodes < 1 or launch.world_size % nnodes:
        raise ValueError(f"launch.nnodes: {nnodes} does not divide the world size {launch.world_size}; "
                         "every node runs the same number of workers (use an nnodes dividing prod(mesh))")
    return launch.world_size // nnodes


def check_settings(settings: Settings) -> None:
    """Refuse settings under which a job pod could not track its run without a tenant's reach growing
    or a credential leaving its Secret (called when the executor starts, and on every render)."""
    uri = settings.mlflow_tracking_uri or ""
    if urlsplit(uri).scheme.partition("+")[0] in LOCAL_STORES and uri not in ("databricks", "databricks-uc"):
        raise ValueError(f"MESHFLOW_EXECUTOR=kubernetes with MESHFLOW_MLFLOW_TRACKING_URI={strip_credentials(uri)}: "
                         "a job pod mounts only its own directory, so a store in the workspace is out of its reach "
                         "(and would hold every tenant's runs); run an MLflow server (deploy/k8s/mlflow.yaml) and set "
                         "MESHFLOW_MLFLOW_TRACKING_URI=http://mlflow:5000")
    if has_credentials(uri) and not settings.kubernetes_tracking_secret:
        raise ValueError("MESHFLOW_MLFLOW_TRACKING_URI holds credentials, which job pods read only from a Secret: "
                         "kubectl create secret generic meshflow-tracking --from-literal=MLFLOW_TRACKING_URI=<the URI> "
                         "and set MESHFLOW_KUBERNETES_TRACKING_SECRET=meshflow-tracking")
    if leaked := sorted(k for k, v in settings.job_env.items() if has_credentials(v)):
        raise ValueError(f"MESHFLOW_JOB_ENV's {', '.join(leaked)} holds credentials (user:password@), which would "
                         "be in every job pod's spec; remove them from MESHFLOW_JOB_ENV")


def pod_environment(env: dict[str, str], settings: Settings) -> list[dict[str, Any]]:
    """The job's environment as a container's ``env``: of what the control plane passed, only the
    allow-listed names (service.runner.ENV_NAMES) and the operator's ``job_env``, less this host's own
    (PATH, HOME, TMPDIR...: the image and the pod's scratch give them) and any ``MESHFLOW_*``
    (tokens, database URL) even if one slipped in; never a tracking credential as a value: those are
    ``secretKeyRef`` s to the tracking Secret. Unbuffered output, so the pod's log is live."""
    allowed = (ENV_NAMES | settings.job_env.keys()) - HOST_ENV_NAMES - {TRACKING_URI_ENV, *MLFLOW_AUTH_ENV,
                                                                        NODE_RANK_ENV}
    kept = {k: v for k, v in env.items() if k in allowed and not k.startswith("MESHFLOW_")}
    if leaked := sorted(k for k, v in kept.items() if has_credentials(v)):
        raise ValueError(f"the job's environment variable(s) {', '.join(leaked)} hold credentials (user:password@); "
                         "a pod gets credentials only from a Secret (MESHFLOW_KUBERNETES_TRACKING_SECRET)")
    kept.update(PYTHONUNBUFFERED="1", HOME=SCRATCH_HOME, TMPDIR=SCRATCH_DIR)
    out: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in sorted(kept.items())]
    if settings.kubernetes_tracking_secret:
        required = has_credentials(settings.mlflow_tracking_uri or "")   # else each key is the operator's option
        for name in (TRACKING_URI_ENV, *MLFLOW_AUTH_ENV):
            ref = {"name": settings.kubernetes_tracking_secret, "key": name,
                   "optional": not (required and name == TRACKING_URI_ENV)}
            out.append({"name": name, "valueFrom": {"secretKeyRef": ref}})
    return out


def node_config(config: dict[str, Any], *, endpoint: str, rdzv_id: str, workdir: str) -> dict[str, Any]:
    """The job's config as every node reads it: the rendezvous fixed, node 0 until the command line's
    ``--node-rank-env`` gives each pod its own rank; no credentials; a files corpus tokenized into
    the job's directory (``workdir``) when the config names the service's shared cache."""
    out = copy.deepcopy(config)
    launch = out.setdefault("launch", {})
    launch.update(rdzv_endpoint=endpoint, rdzv_id=rdzv_id, node_rank=0)
    tracking = out.get("tracking") or {}
    if isinstance(tracking.get("tracking_uri"), str):   # stored without credentials since issue 36; rows before, too
        tracking["tracking_uri"] = strip_credentials(tracking["tracking_uri"])
    data = out.get("data") or {}
    if data.get("kind") == "files" and not _inside(str(data.get("cache_dir", "")), workdir):
        data["cache_dir"] = f"{workdir}/{TOKEN_CACHE}"   # the shared cache is not mounted: tokenize into the job's own
    return out


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def trainer_args(*, endpoint: str, rdzv_id: str) -> list[str]:
    return ["python", "-m", "trainer.launch", f"{CONFIG_DIR}/{CONFIG_FILE}", "--node-rank-env", NODE_RANK_ENV,
            "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id]


def _resources(settings: Settings, workers: int) -> dict[str, Any]:
    cpu = f"{max(1, round(settings.kubernetes_cpu_per_worker * workers * 1000))}m"
    memory = f"{max(1, round(settings.kubernetes_memory_gb_per_worker * workers * 1024))}Mi"
    resources: dict[str, Any] = {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": memory}}
    if settings.kubernetes_gpus_per_node:
        if workers > settings.kubernetes_gpus_per_node:
            raise ValueError(f"the job runs {workers} workers per node but MESHFLOW_KUBERNETES_GPUS_PER_NODE is "
                             f"{settings.kubernetes_gpus_per_node}: one worker per GPU (raise launch.nnodes, or "
                             "the setting)")
        resources["limits"]["nvidia.com/gpu"] = str(settings.kubernetes_gpus_per_node)
    return resources


def _volumes(settings: Settings, name: str, memory: str, workdir: str,
             files: tuple[str, ...] = (CONFIG_FILE,)) -> tuple[list[dict], list[dict]]:
    """The pod's volumes and mounts: of the workspace only the job's own directory (read-write) and the
    read-only areas, each at the api's path; the config (the ConfigMap's ``files``) read-only; scratch and
    /dev/shm."""
    workspace = settings.workspace
    try:
        job_dir = PurePosixPath(workdir).relative_to(workspace)
    except ValueError:
        raise ValueError(f"the job's directory {workdir} is not inside the workspace {workspace}") from None
    if not job_dir.parts or ".." in job_dir.parts:
        raise ValueError(f"the job's directory {workdir} is not a directory below the workspace {workspace}")
    if settings.kubernetes_workspace_pvc:
        workspace_volume: dict[str, Any] = {"name": "workspace",
                                            "persistentVolumeClaim": {"claimName": settings.kubernetes_workspace_pvc}}
    else:
        workspace_volume = {"name": "workspace", "emptyDir": {}}
    scratch = f"{max(1, round(settings.kubernetes_scratch_gb * 1024))}Mi"
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": name, "items": [{"key": key, "path": key} for key in files]}},
        workspace_volume,
        # torch's workers share tensors through /dev/shm; a container's default is 64 MiB
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": memory}},
        {"name": "scratch", "emptyDir": {"sizeLimit": scratch}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "workspace", "mountPath": workdir, "subPath": str(job_dir)},
        *({"name": "workspace", "mountPath": str(workspace / area), "subPath": area, "readOnly": True}
          for area in READ_ONLY_AREAS),
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "scratch", "mountPath": SCRATCH_DIR},
    ]
    return volumes, mounts


def namespace_of(settings: Settings) -> str:
    return settings.kubernetes_namespace or "default"


def render(launch: JobLaunch, settings: Settings, *, namespace: str | None = None) -> RenderedJob:
    """The ConfigMap and the JobSet that run ``launch`` on ``launch.nnodes`` pods."""
    check_settings(settings)
    name = jobset_name(launch.job_id)
    namespace = namespace or namespace_of(settings)
    nnodes, workers = launch.nnodes, workers_per_node(launch)
    endpoint = rendezvous_endpoint(name, settings.kubernetes_rdzv_port)
    labels = {"app.kubernetes.io/name": "meshflow-job", "app.kubernetes.io/part-of": "meshflow",
              "app.kubernetes.io/managed-by": "meshflow-api", JOB_ID_LABEL: launch.job_id}
    files = {CONFIG_FILE: json.dumps(node_config(launch.config, endpoint=endpoint, rdzv_id=launch.job_id,
                                                 workdir=str(launch.workdir)), indent=2, sort_keys=True)}
    if launch.resolved_plan is not None:  # beside job.json: the plan resolved at submission, each launcher's
        files[PLAN_FILE] = json.dumps(launch.resolved_plan)
    config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": name, "namespace": namespace, "labels": labels}, "data": files}
    resources = _resources(settings, workers)
    volumes, mounts = _volumes(settings, name, resources["limits"]["memory"], str(launch.workdir),
                               tuple(files))
    container = {
        "name": CONTAINER,
        "image": settings.kubernetes_image,
        "imagePullPolicy": settings.kubernetes_image_pull_policy,
        # args, not command: the image's ENTRYPOINT (tini) stays PID 1 and reaps the workers
        "args": trainer_args(endpoint=endpoint, rdzv_id=launch.job_id),
        "workingDir": str(launch.workdir),
        "env": pod_environment(launch.env, settings),
        "ports": [{"name": "rdzv", "containerPort": settings.kubernetes_rdzv_port, "protocol": "TCP"}],
        "resources": resources,
        "volumeMounts": mounts,
        # a failed pod's status then carries its log's tail: the job's failure reason names it
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # writable: the job's directory, scratch and /dev/shm only
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,   # the trainer never talks to the Kubernetes API
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": volumes,
    }
    if settings.kubernetes_service_account:
        pod_spec["serviceAccountName"] = settings.kubernetes_service_account
    jobset = {
        "apiVersion": JOBSET_API_VERSION, "kind": JOBSET_KIND,
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True},
            "failurePolicy": {"maxRestarts": 0},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [REPLICATED_JOB]},
            "replicatedJobs": [{
                "name": REPLICATED_JOB,
                "replicas": 1,
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "completionMode": "Indexed", "parallelism": nnodes, "completions": nnodes,
                        "backoffLimit": 0,
                        "template": {"metadata": {"labels": labels}, "spec": pod_spec},
                    },
                },
            }],
        },
    }
    return RenderedJob(namespace=namespace, name=name, config_map=config_map, jobset=jobset)


def owned_by(config_map: dict[str, Any], jobset: dict[str, Any]) -> dict[str, Any]:
    """``config_map`` owned by the created ``jobset`` (its uid), so deleting the JobSet deletes it."""
    out = copy.deepcopy(config_map)
    meta = jobset["metadata"]
    out["metadata"]["ownerReferences"] = [{"apiVersion": JOBSET_API_VERSION, "kind": JOBSET_KIND, "name": meta["name"],
                                           "uid": meta["uid"], "blockOwnerDeletion": True}]
    return out
