"""``MESHFLOW_EXECUTOR=kubernetes``: every job runs as its own JobSet in the cluster, not in the api pod.

The api (in a pod with deploy/k8s/api.yaml's ServiceAccount, or anywhere with a kubeconfig) renders
the job (``jobset.render``), creates the JobSet with the official ``kubernetes`` client's
``CustomObjectsApi``, then the ConfigMap holding the validated config, owned by the JobSet so that
deleting one deletes both. The JobSet controller (a cluster prerequisite: deploy/README.md) makes
the pods and the headless Service of the rendezvous.

- ``poll`` reads the JobSet's ``status.terminalState`` (or its Completed / Failed condition); on
  failure it names the node, the pod, its exit code and the tail of its output (the pods'
  ``terminationMessagePolicy: FallbackToLogsOnError``). When the job ends, the pods' logs are copied
  into ``<workdir>/job.log``, where the api serves a job's log from.
- ``stop`` deletes the JobSet with ``propagationPolicy: Foreground``: its Jobs and pods go first
  (SIGTERM, then the pods' grace period; ``force``: grace period 0).
- The ref is ``<namespace>/<jobset name>``; ``adopt`` finds a JobSet created just before the
  control plane died by its name, ``mf-<job id>``.

Install the client with ``pip install 'meshflow[kubernetes]'`` (the image has it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from service.executors.base import Executor, JobLaunch, JobStatus
from service.executors.jobset import (
    CONTAINER,
    JOB_ID_LABEL,
    JOBSET_GROUP,
    JOBSET_NAME_LABEL,
    JOBSET_PLURAL,
    JOBSET_VERSION,
    check_settings,
    jobset_name,
    owned_by,
    render,
)
from service.runner import DIR_MODE, LOG_NAME, write_job_config, write_private
from service.settings import Settings

IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"   # label and annotation of an indexed Job's pods
LOG_BYTES_PER_POD = 4 * 2**20
MESSAGE_CHARS = 2000


class ClusterUnavailable(RuntimeError):
    """No Kubernetes cluster is configured, or the client is not installed."""


def _client():
    try:
        import kubernetes
    except ImportError as exc:  # an optional extra: the local executor needs none of it
        raise ClusterUnavailable("MESHFLOW_EXECUTOR=kubernetes needs the kubernetes client, which is not installed "
                                 "(pip install 'meshflow[kubernetes]')") from exc
    return kubernetes


def connect(environ: Mapping[str, str] | None = None) -> tuple[Any, str | None]:
    """``(ApiClient, namespace or None)`` of the cluster this process is configured for: the pod's
    ServiceAccount when it runs in one, else the kubeconfig (``$KUBECONFIG`` or ``~/.kube/config``)."""
    kubernetes = _client()
    environ = os.environ if environ is None else environ
    configuration = kubernetes.client.Configuration()
    try:
        if environ.get("KUBERNETES_SERVICE_HOST"):
            kubernetes.config.load_incluster_config(client_configuration=configuration)
            namespace = IN_CLUSTER_NAMESPACE.read_text().strip() if IN_CLUSTER_NAMESPACE.is_file() else None
        else:
            # read $KUBECONFIG now: the client's default location is fixed when it is imported
            config_file = environ.get("KUBECONFIG") or None
            kubernetes.config.load_kube_config(config_file=config_file, client_configuration=configuration)
            _, context = kubernetes.config.list_kube_config_contexts(config_file=config_file)
            namespace = (context or {}).get("context", {}).get("namespace")
    except kubernetes.config.ConfigException as exc:
        raise ClusterUnavailable(f"MESHFLOW_EXECUTOR=kubernetes but no cluster is configured: {exc} (run the api in "
                                 "a pod with deploy/k8s/api.yaml's ServiceAccount, or point KUBECONFIG at a "
                                 "kubeconfig)") from exc
    return kubernetes.client.ApiClient(configuration), namespace


class KubernetesExecutor(Executor):
    """Jobs as JobSets in one namespace; see the module docstring."""

    name = "kubernetes"

    @classmethod
    def from_settings(cls, settings: Settings) -> KubernetesExecutor:
        return cls(settings)

    def __init__(self, settings: Settings, *, api_client: Any = None) -> None:
        kubernetes = _client()
        check_settings(settings)   # at start-up, not at the first job
        namespace = None
        if api_client is None:
            api_client, namespace = connect()
        self.settings = settings
        self.namespace = settings.kubernetes_namespace or namespace or "default"
        self._api_exception = kubernetes.client.ApiException
        self._custom = kubernetes.client.CustomObjectsApi(api_client)
        self._core = kubernetes.client.CoreV1Api(api_client)

    # -------------------------------------------------------------------- the interface

    def start(self, launch: JobLaunch) -> str:
        rendered = render(launch, self.settings, namespace=self.namespace)
        launch.workdir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        write_job_config(launch.workdir, launch.config, launch.resolved_plan)   # the record, as with local jobs
        try:
            created = self._custom.create_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, rendered.namespace, JOBSET_PLURAL, rendered.jobset)
        except self._api_exception as exc:
            if exc.status != 409:
                raise RuntimeError(self._api_error(f"creating JobSet {rendered.ref}", exc)) from exc
            created = self._get_jobset(rendered.namespace, rendered.name)   # started before a restart
        try:
            self._core.create_namespaced_config_map(rendered.namespace, owned_by(rendered.config_map, created))
        except self._api_exception as exc:
            if exc.status != 409:
                self._delete_jobset(rendered.namespace, rendered.name, force=True)
                raise RuntimeError(self._api_error(f"creating ConfigMap {rendered.ref}", exc)) from exc
        return rendered.ref

    def poll(self, ref: str, launch: JobLaunch) -> JobStatus:
        namespace, name = _split(ref)
        try:
            jobset = self._get_jobset(namespace, name)
        except self._api_exception as exc:
            if exc.status == 404:
                return JobStatus(alive=False, reason=f"JobSet {ref} no longer exists (deleted outside the "
                                                     "control plane?)")
            raise RuntimeError(self._api_error(f"reading JobSet {ref}", exc)) from exc
        state, message = terminal_state(jobset.get("status") or {})
        if state is None:
            return JobStatus(alive=True)
        pods = self._pods(namespace, name)
        self._save_logs(namespace, pods, launch.workdir)
        if state == "Completed":
            return JobStatus(alive=False, exit_code=0)
        exit_code, reason = failure_reason(ref, pods, message)
        return JobStatus(alive=False, exit_code=exit_code, reason=reason)

    def stop(self, ref: str, *, force: bool = False) -> None:
        namespace, name = _split(ref)
        self._delete_jobset(namespace, name, force=force)
        try:   # owned by the JobSet, so normally collected with it; gone at once here all the same
            self._core.delete_namespaced_config_map(name, namespace)
        except self._api_exception as exc:
            if exc.status != 404:
                raise RuntimeError(self._api_error(f"deleting ConfigMap {ref}", exc)) from exc

    def adopt(self, launch: JobLaunch) -> str | None:
        name = jobset_name(launch.job_id)
        try:
            jobset = self._get_jobset(self.namespace, name)
        except self._api_exception as exc:
            if exc.status == 404:
                return None
            raise RuntimeError(self._api_error(f"reading JobSet {self.namespace}/{name}", exc)) from exc
        labels = jobset.get("metadata", {}).get("labels") or {}
        return f"{self.namespace}/{name}" if labels.get(JOB_ID_LABEL) == launch.job_id else None

    # -------------------------------------------------------------------- helpers

    def _get_jobset(self, namespace: str, name: str) -> dict[str, Any]:
        return self._custom.get_namespaced_custom_object(JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSET_PLURAL, name)

    def _delete_jobset(self, namespace: str, name: str, *, force: bool) -> None:
        try:
            self._custom.delete_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSET_PLURAL, name,
                propagation_policy="Foreground", grace_period_seconds=0 if force else None)
        except self._api_exception as exc:
            if exc.status != 404:   # already gone: stopped
                raise RuntimeError(self._api_error(f"deleting JobSet {namespace}/{name}", exc)) from exc

    def _pods(self, namespace: str, name: str) -> list[Any]:
        try:
            pods = self._core.list_namespaced_pod(namespace, label_selector=f"{JOBSET_NAME_LABEL}={name}").items
        except self._api_exception:
            return []   # the reason then comes from the JobSet's own condition
        return sorted(pods, key=lambda pod: (node_rank(pod), pod.metadata.name))

    def _save_logs(self, namespace: str, pods: list[Any], workdir: Path) -> None:
        """The pods' output into ``<workdir>/job.log`` once, node by node (best effort: a pod may be gone)."""
        path = workdir / LOG_NAME
        if path.is_file() and path.stat().st_size:
            return
        parts = []
        for pod in pods:
            try:
                text = self._core.read_namespaced_pod_log(pod.metadata.name, namespace, container=CONTAINER,
                                                          limit_bytes=LOG_BYTES_PER_POD)
            except self._api_exception as exc:
                text = f"(no log: {exc.status} {exc.reason})\n"
            parts.append(f"===== node {node_rank(pod)} (pod {pod.metadata.name}) =====\n{text}")
        if parts and workdir.is_dir():
            write_private(path, "".join(p if p.endswith("\n") else p + "\n" for p in parts))

    @staticmethod
    def _api_error(action: str, exc: Any) -> str:
        hint = {401: "the api's credentials were refused",
                403: "the api's ServiceAccount lacks the permission (deploy/k8s/api-rbac.yaml grants it)",
                404: "is the JobSet CRD installed? (deploy/README.md: the JobSet controller)"}.get(exc.status, "")
        return f"{action} failed: {exc.status} {exc.reason}" + (f"; {hint}" if hint else "")


def _split(ref: str) -> tuple[str, str]:
    namespace, sep, name = ref.partition("/")
    if not sep or not namespace or not name:
        raise ValueError(f"not a Kubernetes job ref: {ref!r} (expected <namespace>/<jobset name>)")
    return namespace, name


def terminal_state(status: dict[str, Any]) -> tuple[str | None, str]:
    """``("Completed" | "Failed" | None, message)`` from a JobSet's status."""
    conditions = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
    state = status.get("terminalState") or next((t for t in ("Failed", "Completed") if t in conditions), None)
    return state, (conditions.get(state) or {}).get("message", "") if state else ""


def node_rank(pod: Any) -> int:
    for source in (pod.metadata.labels, pod.metadata.annotations):
        value = (source or {}).get(COMPLETION_INDEX)
        if value is not None and str(value).isdigit():
            return int(value)
    return -1


def failure_reason(ref: str, pods: list[Any], message: str) -> tuple[int, str]:
    """``(exit code, why)`` of a failed JobSet: every pod whose trainer exited non-zero, by node."""
    failures = []
    for pod in pods:
        for status in (pod.status.container_statuses or []) if pod.status else []:
            terminated = status.state.terminated if status.name == CONTAINER and status.state else None
            if terminated is None or not terminated.exit_code:
                continue
            why = f"node {node_rank(pod)} (pod {pod.metadata.name}) exited with code {terminated.exit_code}"
            if terminated.reason == "OOMKilled":
                why += " (OOMKilled: raise MESHFLOW_KUBERNETES_MEMORY_GB_PER_WORKER)"
            tail = (terminated.message or "").strip()[-MESSAGE_CHARS:]
            failures.append((terminated.exit_code, why + (f"; its last output:\n{tail}" if tail else "")))
    if not failures:
        return 1, f"JobSet {ref} failed: {message or 'no pod reported an exit code'}"
    return failures[0][0], "\n".join(why for _, why in failures)
