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
from typing import Any

from service.executors.base import JobLaunch
from service.settings import Settings

JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL, JOBSET_KIND = "jobset.x-k8s.io", "v1alpha2", "jobsets", "JobSet"
JOBSET_API_VERSION = f"{JOBSET_GROUP}/{JOBSET_VERSION}"
REPLICATED_JOB = "node"
CONTAINER = "trainer"
CONFIG_DIR, CONFIG_FILE = "/etc/meshflow", "job.json"
NODE_RANK_ENV = "JOB_COMPLETION_INDEX"       # set by Kubernetes in every pod of an indexed Job
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"   # JobSet labels its Jobs and pods with it
JOB_ID_LABEL = "meshflow.dev/job-id"
NAME_PREFIX = "mf-"
# A pod's hostname is <jobset>-<replicated job>-<job index>-<pod index> and must be a DNS label.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_MAX_JOBSET_NAME = 63 - len(f"-{REPLICATED_JOB}-0-") - 4   # room for up to 9999 nodes
# Names a pod's environment never gets from the control plane, whatever JobLaunch.env holds.
_CACHE_DIR = "MESHFLOW_CACHE_DIR"


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


def pod_environment(env: dict[str, str]) -> list[dict[str, str]]:
    """The job's environment as a container's ``env``: the allow-listed names the control plane
    passed, never a ``MESHFLOW_*`` setting (tokens, database URL) even if one slipped in, plus
    unbuffered output so the pod's log is live."""
    kept = {k: v for k, v in env.items() if not k.startswith("MESHFLOW_") or k == _CACHE_DIR}
    kept.pop(NODE_RANK_ENV, None)   # Kubernetes sets it per pod
    kept["PYTHONUNBUFFERED"] = "1"
    return [{"name": k, "value": v} for k, v in sorted(kept.items())]


def node_config(config: dict[str, Any], *, endpoint: str, rdzv_id: str) -> dict[str, Any]:
    """The job's config as every node reads it: the rendezvous fixed, node 0 until the command line's
    ``--node-rank-env`` gives each pod its own rank."""
    out = copy.deepcopy(config)
    launch = out.setdefault("launch", {})
    launch.update(rdzv_endpoint=endpoint, rdzv_id=rdzv_id, node_rank=0)
    return out


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


def _volumes(settings: Settings, name: str, memory: str) -> tuple[list[dict], list[dict]]:
    workspace = str(settings.workspace)
    if settings.kubernetes_workspace_pvc:
        workspace_volume = {"name": "workspace", "persistentVolumeClaim": {"claimName": settings.kubernetes_workspace_pvc}}
    else:
        workspace_volume = {"name": "workspace", "emptyDir": {}}
    volumes = [
        {"name": "config", "configMap": {"name": name, "items": [{"key": CONFIG_FILE, "path": CONFIG_FILE}]}},
        workspace_volume,
        # torch's workers share tensors through /dev/shm; a container's default is 64 MiB
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": memory}},
    ]
    mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
              {"name": "workspace", "mountPath": workspace},
              {"name": "dshm", "mountPath": "/dev/shm"}]
    return volumes, mounts


def namespace_of(settings: Settings) -> str:
    return settings.kubernetes_namespace or "default"


def render(launch: JobLaunch, settings: Settings, *, namespace: str | None = None) -> RenderedJob:
    """The ConfigMap and the JobSet that run ``launch`` on ``launch.nnodes`` pods."""
    name = jobset_name(launch.job_id)
    namespace = namespace or namespace_of(settings)
    nnodes, workers = launch.nnodes, workers_per_node(launch)
    endpoint = rendezvous_endpoint(name, settings.kubernetes_rdzv_port)
    labels = {"app.kubernetes.io/name": "meshflow-job", "app.kubernetes.io/part-of": "meshflow",
              "app.kubernetes.io/managed-by": "meshflow-api", JOB_ID_LABEL: launch.job_id}
    config_map = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "data": {CONFIG_FILE: json.dumps(node_config(launch.config, endpoint=endpoint, rdzv_id=launch.job_id),
                                         indent=2, sort_keys=True)},
    }
    resources = _resources(settings, workers)
    volumes, mounts = _volumes(settings, name, resources["limits"]["memory"])
    container = {
        "name": CONTAINER,
        "image": settings.kubernetes_image,
        "imagePullPolicy": settings.kubernetes_image_pull_policy,
        # args, not command: the image's ENTRYPOINT (tini) stays PID 1 and reaps the workers
        "args": trainer_args(endpoint=endpoint, rdzv_id=launch.job_id),
        "workingDir": str(launch.workdir),
        "env": pod_environment(launch.env),
        "ports": [{"name": "rdzv", "containerPort": settings.kubernetes_rdzv_port, "protocol": "TCP"}],
        "resources": resources,
        "volumeMounts": mounts,
        # a failed pod's status then carries its log's tail: the job's failure reason names it
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,   # the trainer never talks to the Kubernetes API
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001},
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
