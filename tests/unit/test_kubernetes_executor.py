"""The Kubernetes executor without a cluster: the rendered JobSet and ConfigMap validate against their
published schemas, and start / poll / stop / adopt drive the official client against an in-memory API
server (tests/unit/k8s_fake_api.py).

Schemas: the JobSet v1alpha2 models Kubeflow Trainer generates from JobSet's OpenAPI spec
(``kubeflow-trainer-api``; the JobSet SDK is not published on PyPI), deserialized strictly (every
key known, every type right: a round trip must give back the same document), and the Kubernetes JSON
schemas of ``kubernetes-validate`` (strict) for the ConfigMap and for the Job each replicated job
becomes.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
from k8s_fake_api import FakeApiServer, api_client
from kubeflow_trainer_api.models.jobset_v1alpha2_job_set import JobsetV1alpha2JobSet

from service.executors.base import JobLaunch
from service.executors.jobset import jobset_name, render
from service.executors.kubernetes import ClusterUnavailable, KubernetesExecutor, connect
from service.runner import job_environment
from service.settings import Settings
from trainer.config.schema import RunConfig

JOB_ID = "0b9c6f0e-3c0d-4a43-9d55-2f1f6c1f8a11"
NAME = f"mf-{JOB_ID}"
K8S_VERSIONS = ["1.29", kubernetes_validate.utils.latest_version()]
SECRETS = {"MESHFLOW_TOKENS": '{"alice": "s3cret"}', "MESHFLOW_DATABASE_URL": "postgresql+psycopg://u:pw@db/meshflow",
           "MESHFLOW_ADMIN_USERS": '["alice"]', "AWS_SECRET_ACCESS_KEY": "xyz", "DATABASE_URL": "postgres://u:pw@db"}


def _settings(tmp_path: Path, **kw) -> Settings:
    return Settings(**{"workspace": tmp_path / "ws", "kubernetes_namespace": "team-a",
                       "kubernetes_image": "reg.example/meshflow:1",
                       "kubernetes_cpu_per_worker": 1.5, "kubernetes_memory_gb_per_worker": 2,
                       "kubernetes_service_account": "meshflow-job", "kubernetes_workspace_pvc": "meshflow-shared",
                       "mlflow_tracking_uri": "http://mlflow:5000", **kw})


def _launch(settings: Settings, *, mesh=(4,), nnodes=2, env=None) -> JobLaunch:
    config = RunConfig.model_validate({"mesh": list(mesh),
                                       "parallel": {"dims": ["dp"], "data_parallel": {"dim": "dp", "mode": "fsdp"}},
                                       "launch": {"nnodes": nnodes}}).model_dump(mode="json")
    server_env = {"PATH": "/usr/local/bin:/usr/bin", "HOME": "/home/meshflow", "OMP_NUM_THREADS": "1", **SECRETS}
    env = job_environment({"HF_HUB_OFFLINE": "1"}, source=server_env) if env is None else env
    return JobLaunch(job_id=JOB_ID, workdir=settings.jobs_dir / JOB_ID, config=config, world_size=4, env=env)


def strict_jobset(doc: dict) -> JobsetV1alpha2JobSet:
    """``doc`` as the JobSet schema's models read it, refusing unknown keys (dropped on the way in, so
    the round trip differs) and wrong types (pydantic's strict types raise)."""
    model = JobsetV1alpha2JobSet.from_dict(doc)
    back = model.to_dict()
    if back != doc:
        raise ValueError(f"not a valid JobSet: keys the schema does not know, or values it changes: {_diff(doc, back)}")
    return model


def _diff(a, b, path="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in a.keys() | b.keys() for d in _diff(a.get(k, "<missing>"), b.get(k, "<missing>"),
                                                              f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} -> {b!r}"]


def _job_of(jobset: dict) -> dict:
    (replicated,) = jobset["spec"]["replicatedJobs"]
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {**replicated["template"]["metadata"],
            "name": f"{jobset['metadata']['name']}-{replicated['name']}-0",
                                                                  "namespace": jobset["metadata"]["namespace"]},
            "spec": replicated["template"]["spec"]}


# ---------------------------------------------------------------------------- rendering


def test_rendered_resources_validate_against_their_schemas(tmp_path):
    settings = _settings(tmp_path)
    rendered = render(_launch(settings), settings)
    model = strict_jobset(rendered.jobset)
    assert model.spec.network.enable_dns_hostnames and model.spec.replicated_jobs[0].template.spec.completions == 2
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(rendered.config_map, version, strict=True)
        kubernetes_validate.validate(_job_of(rendered.jobset), version, strict=True)
    # the validators do refuse: an unknown key deep in the pod, a wrong type, a missing required field
    bad = json.loads(json.dumps(rendered.jobset))
    bad["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["comand"] = ["x"]
    with pytest.raises(ValueError, match=r"containers\[0\]\.comand"):
        strict_jobset(bad)
    with pytest.raises(kubernetes_validate.utils.ValidationError):
        kubernetes_validate.validate(_job_of(bad), K8S_VERSIONS[-1], strict=True)
    bad = json.loads(json.dumps(rendered.jobset))
    bad["spec"]["replicatedJobs"][0]["replicas"] = "1"
    with pytest.raises(Exception, match="replicas"):
        strict_jobset(bad)
    bad["spec"]["replicatedJobs"][0]["replicas"] = 1
    del bad["spec"]["replicatedJobs"][0]["name"]
    with pytest.raises(ValueError, match=r"replicatedJobs\[0\]\.name: '<missing>'"):
        strict_jobset(bad)


def test_every_node_runs_the_same_command_with_its_rank_and_the_first_pods_endpoint(tmp_path):
    settings = _settings(tmp_path)
    launch = _launch(settings)
    rendered = render(launch, settings)
    assert (rendered.namespace, rendered.name, rendered.ref) == ("team-a", NAME, f"team-a/{NAME}")
    spec = rendered.jobset["spec"]
    assert spec["network"] == {"enableDNSHostnames": True, "subdomain": NAME, "publishNotReadyAddresses": True}
    assert spec["failurePolicy"] == {"maxRestarts": 0}
    (replicated,) = spec["replicatedJobs"]
    job = replicated["template"]["spec"]
    # one indexed Job of nnodes pods: pod k is <jobset>-node-0-k and its JOB_COMPLETION_INDEX is k
    assert (replicated["name"], replicated["replicas"]) == ("node", 1)
    assert (job["completionMode"], job["parallelism"], job["completions"], job["backoffLimit"]) == ("Indexed", 2, 2, 0)
    pod = job["template"]["spec"]
    (container,) = pod["containers"]
    endpoint = f"{NAME}-node-0-0.{NAME}:29400"   # pod 0's hostname . the headless Service (= subdomain)
    assert container["args"] == ["python", "-m", "trainer.launch", "/etc/meshflow/job.json",
                                 "--node-rank-env", "JOB_COMPLETION_INDEX", "--rdzv-endpoint", endpoint, "--rdzv-id",
                                 JOB_ID]
    assert "command" not in container and container["workingDir"] == str(launch.workdir)
    assert container["ports"] == [{"name": "rdzv", "containerPort": 29400, "protocol": "TCP"}]
    # the config every node reads: the job's own, validated by the trainer's model, rendezvous fixed
    node = RunConfig.model_validate(json.loads(rendered.config_map["data"]["job.json"]))
    assert (node.launch.nnodes, node.launch.node_rank, node.launch.rdzv_endpoint,
            node.launch.rdzv_id) == (2, 0, endpoint, JOB_ID)
    assert node.model_dump(mode="json", exclude={"launch"}) == {k: v for k, v in launch.config.items() if k != "launch"}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["/etc/meshflow"]["readOnly"]
    assert volumes["config"]["configMap"]["name"] == rendered.config_map["metadata"]["name"]
    assert volumes[mounts[str(launch.workdir)]["name"]]["persistentVolumeClaim"] == {"claimName": "meshflow-shared"}
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
    assert pod["serviceAccountName"] == "meshflow-job" and pod["automountServiceAccountToken"] is False
    assert pod["restartPolicy"] == "Never" and pod["securityContext"]["runAsNonRoot"] is True


def test_the_plan_resolved_at_submission_is_mounted_beside_job_json(tmp_path):
    settings = _settings(tmp_path)
    plan = {"format": 1, "model": {"fingerprint": "0123456789abcdef", "num_parameters": 3}, "plan": {"units": []}}
    rendered = render(dataclasses.replace(_launch(settings), resolved_plan=plan), settings)
    assert json.loads(rendered.config_map["data"]["resolved_plan.json"]) == plan
    pod = rendered.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (config,) = [v for v in pod["volumes"] if v["name"] == "config"]
    # both files under /etc/meshflow: the launcher looks for the plan beside the config it is given
    assert config["configMap"]["items"] == [{"key": "job.json", "path": "job.json"},
                                            {"key": "resolved_plan.json", "path": "resolved_plan.json"}]
    kubernetes_validate.validate(rendered.config_map, K8S_VERSIONS[-1], strict=True)
    without = render(_launch(settings), settings)  # a job stored without one: the launcher resolves it
    assert list(without.config_map["data"]) == ["job.json"]


def test_pod_env_has_no_secrets_and_resources_scale_with_workers(tmp_path):
    settings = _settings(tmp_path)
    rendered = render(_launch(settings), settings)
    container = rendered.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    # the api host's PATH and HOME are not the pod's: the image's PATH, HOME and TMPDIR in its scratch
    assert env == {"HOME": "/tmp/home", "TMPDIR": "/tmp", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                   "PYTHONUNBUFFERED": "1"}
    # a MESHFLOW_* value that reached JobLaunch.env anyway is dropped, the calibration cache dir too (the
    # workspace is not the pod's: it calibrates into its scratch)
    leaked = render(_launch(settings, env={**SECRETS, "MESHFLOW_CACHE_DIR": "/ws/cache"}), settings)
    leaked_pod = leaked.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    leaked_env = leaked_pod["containers"][0]["env"]
    assert [e["name"] for e in leaked_env] == ["HOME", "PYTHONUNBUFFERED", "TMPDIR"]   # none of SECRETS either
    text = json.dumps([rendered.jobset, rendered.config_map])
    assert "s3cret" not in text and "pw@db" not in text and "xyz" not in text
    # 2 workers per pod: 2 x 1.5 CPUs, 2 x 2 GiB, no GPU
    assert container["resources"] == {"requests": {"cpu": "3000m", "memory": "4096Mi"}, "limits": {"memory": "4096Mi"}}
    gpu_settings = _settings(tmp_path, kubernetes_gpus_per_node=2)
    gpu = render(_launch(gpu_settings), gpu_settings)
    gpu_pod = gpu.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    limits = gpu_pod["containers"][0]["resources"]["limits"]
    assert limits == {"memory": "4096Mi", "nvidia.com/gpu": "2"}
    kubernetes_validate.validate(_job_of(gpu.jobset), K8S_VERSIONS[-1], strict=True)
    with pytest.raises(ValueError, match="4 workers per node but MESHFLOW_KUBERNETES_GPUS_PER_NODE is 2"):
        render(_launch(gpu_settings, nnodes=1), gpu_settings)
    with pytest.raises(ValueError, match=r"launch.nnodes: 3 does not divide the world size 4"):
        render(_launch(settings, nnodes=3), settings)
    with pytest.raises(ValueError, match="cannot name a JobSet"):
        jobset_name("x" * 60)


# ---------------------------------------------------------------------------- the client, transport faked


def test_start_poll_stop_adopt_through_the_official_client(tmp_path):
    settings = _settings(tmp_path)
    server = FakeApiServer()
    executor = KubernetesExecutor(settings, api_client=api_client(server))
    launch = _launch(settings)
    rendered = render(launch, settings)

    ref = executor.start(launch)
    assert ref == f"team-a/{NAME}"
    assert [(c.method, c.path) for c in server.calls] == [
        ("POST", "/apis/jobset.x-k8s.io/v1alpha2/namespaces/team-a/jobsets"), ("POST",
                                                                               "/api/v1/namespaces/team-a/configmaps")]
    assert server.calls[0].body == rendered.jobset
    jobset = server.objects[("JobSet", "team-a", NAME)]
    owner = server.calls[1].body["metadata"].pop("ownerReferences")
    assert owner == [{"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "name": NAME,
                      "uid": jobset["metadata"]["uid"], "blockOwnerDeletion": True}]
    assert server.calls[1].body == rendered.config_map
    assert json.loads((launch.workdir / "job.json").read_text()) == launch.config

    assert executor.poll(ref, launch).alive and executor.adopt(launch) == ref
    other = JobLaunch(job_id="9" * 8 + JOB_ID[8:], workdir=tmp_path, config=launch.config, world_size=4)
    assert executor.adopt(other) is None

    # node 1 fails: the reason names it, its pod, its code and its last output; both logs land in job.log
    pod0, pod1 = f"{NAME}-node-0-0", f"{NAME}-node-0-1"
    server.add_pod("team-a", pod0, jobset=NAME, index=0, exit_code=143, message="terminated")
    server.add_pod("team-a", pod1, jobset=NAME, index=1, exit_code=1, message="Traceback ...\nRuntimeError: boom")
    server.pod_logs.update({pod0: "step 1 loss 5.5\n", pod1: "Traceback ...\nRuntimeError: boom\n"})
    jobset["status"] = {"terminalState": "Failed", "conditions": [
        {"type": "Failed", "status": "True", "reason": "FailedJobs", "message": "jobset failed due to one or more "
                                                                                "job failures",
         "lastTransitionTime": "2026-01-01T00:01:00Z"}]}
    status = executor.poll(ref, launch)
    assert (status.alive, status.exit_code) == (False, 143)
    assert f"node 0 (pod {pod0}) exited with code 143" in status.reason
    assert (f"node 1 (pod {pod1}) exited with code 1; its last output:\nTraceback ...\nRuntimeError: boom"
            in status.reason)
    log = (launch.workdir / "job.log").read_text()
    assert (log.index(f"node 0 (pod {pod0})") < log.index("step 1 loss 5.5") < log.index(f"node 1 (pod {pod1})")
            < log.index("boom"))

    jobset["status"] = {"terminalState": "Completed"}
    assert executor.poll(ref, launch) == type(status)(alive=False, exit_code=0)

    server.clear()
    executor.stop(ref, force=True)
    (delete_jobset, delete_cm) = server.calls
    assert (delete_jobset.method, delete_jobset.path) == ("DELETE",
                                                          f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/team-a/jobsets/{NAME}")
    assert delete_jobset.query == {"propagationPolicy": "Foreground", "gracePeriodSeconds": "0"}
    assert (delete_cm.method, delete_cm.path) == ("DELETE", f"/api/v1/namespaces/team-a/configmaps/{NAME}")
    gone = executor.poll(ref, launch)
    assert not gone.alive and gone.exit_code is None and "no longer exists" in gone.reason
    server.clear()
    executor.stop(ref)   # stopping a stopped job is not an error; no force: the pods' grace period
    assert server.calls[0].query == {"propagationPolicy": "Foreground"}
    assert executor.adopt(launch) is None


def test_failures_to_submit_say_what_is_missing(tmp_path, monkeypatch):
    settings = _settings(tmp_path)
    server = FakeApiServer(crd_installed=False)
    executor = KubernetesExecutor(settings, api_client=api_client(server))
    with pytest.raises(RuntimeError, match=f"creating JobSet team-a/{NAME} failed: 404.*JobSet CRD installed"):
        executor.start(_launch(settings))
    assert [c.method for c in server.calls] == ["POST"]   # no ConfigMap without its JobSet

    # no cluster configured: a clear error; a kubeconfig: its context's namespace is the default
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(ClusterUnavailable, match="MESHFLOW_EXECUTOR=kubernetes but no cluster is configured"):
        connect()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "dev",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "dev", "context": {"cluster": "c", "user": "u", "namespace": "ml-jobs"}}]}))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    client, namespace = connect()
    assert namespace == "ml-jobs" and client.configuration.host == "https://127.0.0.1:6443"
    no_ns = Settings(workspace=tmp_path / "ws", mlflow_tracking_uri="http://mlflow:5000")
    assert KubernetesExecutor(no_ns).namespace == "ml-jobs"
    assert KubernetesExecutor(settings).namespace == "team-a"


def test_the_api_role_allows_every_call_the_executor_makes(tmp_path):
    """deploy/k8s/api-rbac.yaml's Role against the requests of a whole job's life (start, poll a
    failure with its pods and logs, adopt, stop): each maps to (API group, resource, verb)."""
    import yaml

    settings = _settings(tmp_path)
    server = FakeApiServer()
    executor = KubernetesExecutor(settings, api_client=api_client(server))
    launch = _launch(settings)
    ref = executor.start(launch)
    server.add_pod("team-a", f"{NAME}-node-0-0", jobset=NAME, index=0, exit_code=1, message="boom")
    server.objects[("JobSet", "team-a", NAME)]["status"] = {"terminalState": "Failed"}
    assert executor.poll(ref, launch).exit_code == 1 and executor.adopt(launch) == ref
    executor.stop(ref)
    path = re.compile(r"^/(?:api/v1|apis/(?P<group>[^/]+)/[^/]+)/namespaces/[^/]+/(?P<resource>[^/]+)"
                      r"(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?$")
    needed = set()
    for call in server.calls:
        m = path.match(call.path)
        resource = m["resource"] + (f"/{m['sub']}" if m["sub"] else "")
        verb = {"POST": "create", "DELETE": "delete"}.get(call.method) or ("get" if m["name"] else "list")
        needed.add((m["group"] or "", resource, verb))
    assert needed == {("jobset.x-k8s.io", "jobsets", "create"), ("jobset.x-k8s.io", "jobsets", "get"),
                      ("jobset.x-k8s.io", "jobsets", "delete"), ("", "configmaps", "create"),
                      ("", "configmaps", "delete"),
                      ("", "pods", "list"), ("", "pods/log", "get")}
    rbac = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "api-rbac.yaml"
    (role,) = [d for d in yaml.safe_load_all(rbac.read_text()) if d and d["kind"] == "Role"]
    allowed = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    assert needed <= allowed, f"the Role lacks {needed - allowed}"
