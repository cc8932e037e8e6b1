"""Kubernetes jobs kept apart (issue 36, item 5), on the rendered manifests: a pod mounts only its own
job directory (read-write) and the read-only areas of the workspace; it runs as the Pod Security
Standard "restricted" asks, on a read-only root filesystem; no credential is in its spec, its
ConfigMap or its plain environment (the tracking store's are ``secretKeyRef`` s to a Secret); and a
setting that would need any of that is refused when the executor starts.
"""

from __future__ import annotations

import json

import kubernetes_validate
import pytest
from k8s_fake_api import FakeApiServer, api_client
from test_kubernetes_executor import JOB_ID, K8S_VERSIONS, _job_of, _launch, _settings, strict_jobset

from service.executors.base import JobLaunch
from service.executors.jobset import render
from service.executors.kubernetes import KubernetesExecutor
from service.runner import job_environment
from service.submit import confine
from trainer.config.schema import RunConfig

FULL_URI = "http://alice:pw-123@mlflow:5000"


def _pod(rendered) -> dict:
    return rendered.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def test_a_pod_mounts_its_own_job_directory_and_the_read_only_areas_only(tmp_path):
    settings = _settings(tmp_path)
    launch = _launch(settings)
    pod = _pod(render(launch, settings))
    (container,) = pod["containers"]
    ws = settings.workspace
    workspace_mounts = {m["mountPath"]: m for m in container["volumeMounts"] if m["name"] == "workspace"}
    assert workspace_mounts == {
        str(launch.workdir): {"name": "workspace", "mountPath": str(launch.workdir), "subPath": f"jobs/{JOB_ID}"},
        str(ws / "datasets"): {"name": "workspace", "mountPath": str(ws / "datasets"), "subPath": "datasets",
                               "readOnly": True},
        str(ws / "models"): {"name": "workspace", "mountPath": str(ws / "models"), "subPath": "models",
                             "readOnly": True},
    }
    # what the pod can write: its job directory, its scratch and /dev/shm, nothing else
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert writable == {str(launch.workdir), "/tmp", "/dev/shm"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["scratch"] == {"name": "scratch", "emptyDir": {"sizeLimit": "8192Mi"}}
    # no PVC (an emptyDir): each mount still names its part of the pod's own volume
    no_pvc = _settings(tmp_path, kubernetes_workspace_pvc=None)
    assert {m.get("subPath") for m in _pod(render(_launch(no_pvc), no_pvc))["containers"][0]["volumeMounts"]
            if m["name"] == "workspace"} == {f"jobs/{JOB_ID}", "datasets", "models"}
    outside = JobLaunch(job_id=JOB_ID, workdir=tmp_path / "elsewhere", config=launch.config, world_size=4)
    with pytest.raises(ValueError, match="is not inside the workspace"):
        render(outside, settings)


def test_a_pod_is_restricted_and_its_root_filesystem_read_only(tmp_path):
    settings = _settings(tmp_path)
    rendered = render(_launch(settings), settings)
    pod = _pod(rendered)
    (container,) = pod["containers"]
    # the Pod Security Standard "restricted": seccomp, non-root, no escalation, no capabilities
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}
    assert pod["automountServiceAccountToken"] is False
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HOME"].startswith("/tmp/") and env["TMPDIR"] == "/tmp"   # torch's, MLflow's caches: in scratch
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(_job_of(rendered.jobset), version, strict=True)
    strict_jobset(rendered.jobset)


def _launch_with_credentials(settings, tmp_path) -> JobLaunch:
    """A job as the scheduler launches it when the store's URI holds credentials: the config as
    :func:`confine` stores it, the environment as :func:`job_environment` makes it."""
    workdir = settings.jobs_dir / JOB_ID
    raw = {"mesh": [4], "parallel": {"dims": ["dp"], "data_parallel": {"dim": "dp", "mode": "fsdp"}},
           "launch": {"nnodes": 2}}
    confined, issues = confine(raw, workspace=settings.workspace, workdir=workdir,
                               tracking_uri=settings.mlflow_tracking_uri, run_id="r1", multi_node=True)
    assert not issues and confined["tracking"]["tracking_uri"] == "http://mlflow:5000"
    config = RunConfig.model_validate(confined).model_dump(mode="json")
    env = job_environment({"HF_HUB_OFFLINE": "1"}, source={"OMP_NUM_THREADS": "1"},
                          tracking_uri=settings.mlflow_tracking_uri)
    assert env["MLFLOW_TRACKING_URI"] == FULL_URI   # the job needs them: in its environment, by name
    return JobLaunch(job_id=JOB_ID, workdir=workdir, config=config, world_size=4, env=env)


def test_tracking_credentials_reach_a_pod_only_from_the_secret(tmp_path):
    settings = _settings(tmp_path, mlflow_tracking_uri=FULL_URI, kubernetes_tracking_secret="meshflow-tracking")
    launch = _launch_with_credentials(settings, tmp_path)
    rendered = render(launch, settings)
    text = json.dumps([rendered.jobset, rendered.config_map])
    assert "pw-123" not in text and "alice" not in text
    node = json.loads(rendered.config_map["data"]["job.json"])
    assert node["tracking"]["tracking_uri"] == "http://mlflow:5000"
    (container,) = _pod(rendered)["containers"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
    assert refs == {
        "MLFLOW_TRACKING_URI": {"name": "meshflow-tracking", "key": "MLFLOW_TRACKING_URI", "optional": False},
        **{name: {"name": "meshflow-tracking", "key": name, "optional": True}
           for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")}}
    plain = [e for e in container["env"] if "value" in e]
    assert all("@" not in e["value"] for e in plain) and "MLFLOW_TRACKING_URI" not in {e["name"] for e in plain}
    kubernetes_validate.validate(_job_of(rendered.jobset), K8S_VERSIONS[-1], strict=True)
    kubernetes_validate.validate(rendered.config_map, K8S_VERSIONS[-1], strict=True)

    # a row stored before configs were stripped: its ConfigMap is stripped all the same
    legacy = JobLaunch(job_id=JOB_ID, workdir=launch.workdir, world_size=4, env=launch.env,
                       config={**launch.config, "tracking": {**launch.config["tracking"], "tracking_uri": FULL_URI}})
    assert "pw-123" not in json.dumps(render(legacy, settings).config_map)
    # a credential in any other variable the operator added to every job: refused, not copied into the spec
    with pytest.raises(ValueError, match="MESHFLOW_JOB_ENV's DB holds credentials"):
        render(launch, _settings(tmp_path, job_env={"DB": "postgresql://u:pw@db/x"}))


def test_settings_that_would_leak_or_widen_a_pod_are_refused_when_the_executor_starts(tmp_path):
    server = FakeApiServer()
    with pytest.raises(ValueError, match="MESHFLOW_KUBERNETES_TRACKING_SECRET=meshflow-tracking"):
        KubernetesExecutor(_settings(tmp_path, mlflow_tracking_uri=FULL_URI), api_client=api_client(server))
    with pytest.raises(ValueError, match=r"run an MLflow server .* MESHFLOW_MLFLOW_TRACKING_URI=http://mlflow:5000"):
        KubernetesExecutor(_settings(tmp_path, mlflow_tracking_uri=f"sqlite:///{tmp_path}/ws/mlflow.db"),
                           api_client=api_client(server))
    assert server.calls == []
    # an http store without credentials needs no Secret; the Secret named anyway gives optional keys only
    plain = _settings(tmp_path, kubernetes_tracking_secret="meshflow-tracking")
    KubernetesExecutor(plain, api_client=api_client(server))
    (container,) = _pod(render(_launch(plain), plain))["containers"]
    assert all(e["valueFrom"]["secretKeyRef"]["optional"] for e in container["env"] if "valueFrom" in e)


def test_a_files_corpus_is_tokenized_into_the_pods_own_directory(tmp_path):
    settings = _settings(tmp_path)
    launch = _launch(settings)
    shared = str(settings.workspace / ".cache" / "meshflow-tokens")   # confine's default: every job's
    files = {**launch.config, "data": {"kind": "files", "paths": [str(settings.workspace / "datasets" / "a.jsonl")],
                                       "cache_dir": shared}}
    node = json.loads(render(JobLaunch(job_id=JOB_ID, workdir=launch.workdir, config=files, world_size=4), settings)
                      .config_map["data"]["job.json"])
    assert node["data"]["cache_dir"] == f"{launch.workdir}/.cache/meshflow-tokens"
    own = {**files, "data": {**files["data"], "cache_dir": f"{launch.workdir}/tokens"}}   # the user's, in the workdir
    node = json.loads(render(JobLaunch(job_id=JOB_ID, workdir=launch.workdir, config=own, world_size=4), settings)
                      .config_map["data"]["job.json"])
    assert node["data"]["cache_dir"] == f"{launch.workdir}/tokens"
