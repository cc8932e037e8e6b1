"""Structural checks of deploy/ (no Docker engine, no cluster): the files parse, name real
settings, real routes and real services, and install torch before the project."""

from __future__ import annotations

import importlib
import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

from service.executors.jobset import check_settings
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
PREFIX = "MESHFLOW_"
DOCUMENTED_URL = "postgresql+psycopg://meshflow:change-me@postgres:5432/meshflow"

YAML_FILES = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])


def _docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _is_setting(name: str) -> bool:
    return name.startswith(PREFIX) and name[len(PREFIX):].lower() in Settings.model_fields


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _env_example() -> dict[str, str]:
    """deploy/.env.example as compose reads it: KEY=VALUE, quotes stripped, comments skipped."""
    values = {}
    for line in (DEPLOY / ".env.example").read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def _interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR:?error} against ``env``."""
    def sub(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if name in env and env[name] != "":
            return env[name]
        if op == "-":
            return arg
        raise AssertionError(f"compose variable {name} has no value and no default ({arg})")
    return re.sub(r"\$\{(\w+)(?::([-?])([^}]*))?\}", sub, value)


def _workloads() -> list[tuple[str, dict]]:
    """(file:kind/name, pod spec) of every Kubernetes workload under deploy/k8s."""
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in _docs(path):
            if doc["kind"] in {"Deployment", "StatefulSet"}:
                out.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc["spec"]["template"]["spec"]))
    return out


def _k8s_docs() -> list[dict]:
    return [doc for path in sorted(K8S.glob("*.yaml")) for doc in _docs(path)]


def _api_deployment() -> dict:
    (doc,) = [d for d in _docs(K8S / "api.yaml") if d["kind"] == "Deployment"]
    return doc


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    lines, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        lines.append(current)
        current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


# ---------------------------------------------------------------------------- every YAML


def test_deploy_has_the_expected_files():
    for name in ["Dockerfile", "Dockerfile.dockerignore", "docker-compose.yml", ".env.example", "README.md",
                 "k8s/postgres.yaml", "k8s/mlflow.yaml", "k8s/api.yaml", "k8s/api-rbac.yaml", "k8s/secret.example.yaml",
                 "k8s/ingress.example.yaml"]:
        assert (DEPLOY / name).is_file(), name


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_parses(path):
    docs = _docs(path)
    assert docs and all(isinstance(doc, dict) for doc in docs)


def test_k8s_manifests_are_namespaceless_and_well_formed():
    for doc in _k8s_docs():
        assert {"apiVersion", "kind", "metadata"} <= doc.keys(), doc
        assert "namespace" not in doc["metadata"], doc["metadata"]


# ---------------------------------------------------------------------------- compose


def test_compose_services_and_depends_on():
    services = _compose()["services"]
    assert {"postgres", "mlflow", "api"} <= services.keys()
    for name, service in services.items():
        for dep, cond in (service.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            assert cond["condition"] == "service_healthy" and "healthcheck" in services[dep], (name, dep)
    api = services["api"]
    assert set(api["depends_on"]) == {"postgres", "mlflow"}
    assert "127.0.0.1:8000:8000" in api["ports"]
    # plain HTTP never leaves the host: every published port is bound to the loopback address
    for name, service in services.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"
    assert services["ray-head"]["profiles"] == ["ray"] and all("profiles" not in services[n]
                                                               for n in ("api", "mlflow", "postgres"))


def test_compose_api_env_names_are_settings():
    env = _compose()["services"]["api"]["environment"]
    assert {"MESHFLOW_DATABASE_URL", "MESHFLOW_MLFLOW_TRACKING_URI", "MESHFLOW_MLFLOW_UI_URL",
            "MESHFLOW_WORKSPACE", "MESHFLOW_TOKENS", "MESHFLOW_CAPACITY"} <= env.keys()
    unknown = [name for name in env if not _is_setting(name)]
    assert not unknown, f"not Settings fields: {unknown}"


def test_compose_api_env_builds_settings(monkeypatch):
    """The api's environment, interpolated with .env.example, is accepted by Settings."""
    services = _compose()["services"]
    env = {k: _interpolate(str(v), _env_example()) for k, v in services["api"]["environment"].items()}
    import os
    for name in [n for n in os.environ if n.startswith(PREFIX)]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.workspace == Path("/workspace")
    assert settings.tokens.keys() == {"alice"} and settings.admin_users == ["alice"]
    assert settings.mlflow_tracking_uri == "http://mlflow:5000"
    url = make_url(settings.database_url)
    assert (url.drivername, url.host, url.port, url.database) == ("postgresql+psycopg", "postgres", 5432, "meshflow")
    mounts = [v.split(":")[1] for v in services["api"]["volumes"]]
    assert str(settings.workspace) in mounts
    # MLflow's store is the same server, its own database, same driver
    command = services["mlflow"]["command"]
    backend = make_url(_interpolate(command[command.index("--backend-store-uri") + 1], _env_example()))
    assert (backend.drivername, backend.host, backend.database) == ("postgresql+psycopg", "postgres", "mlflow")
    allowed = _interpolate(services["mlflow"]["environment"]["MLFLOW_SERVER_ALLOWED_HOSTS"], _env_example())
    assert "mlflow:5000" in allowed.split(",")
    assert settings.executor == "local"


# ---------------------------------------------------------------------------- kubernetes


def test_k8s_meshflow_env_names_are_settings():
    seen = []
    for where, pod in _workloads():
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            for var in container.get("env", []):
                if var["name"].startswith(PREFIX):
                    seen.append(var["name"])
                    assert _is_setting(var["name"]), f"{where}: {var['name']} is not a Settings field"
    assert "MESHFLOW_DATABASE_URL" in seen and "MESHFLOW_TOKENS" in seen


def test_k8s_secret_refs_exist_in_example_secret():
    secret, tracking = _docs(K8S / "secret.example.yaml")
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == "meshflow-secrets"
    # the job pods' Secret: the tracking keys only, named by the api's setting
    assert tracking["kind"] == "Secret" and set(tracking["stringData"]) == {"MLFLOW_TRACKING_URI"}
    api_env = {v["name"]: v.get("value") for v in _api_deployment()["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert api_env["MESHFLOW_KUBERNETES_TRACKING_SECRET"] == tracking["metadata"]["name"]
    assert tracking["stringData"]["MLFLOW_TRACKING_URI"] == api_env["MESHFLOW_MLFLOW_TRACKING_URI"]
    keys = set(secret["stringData"])
    json.loads(secret["stringData"]["tokens"])
    for where, pod in _workloads():
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == "meshflow-secrets" and ref["key"] in keys, (where, ref)


def test_k8s_volumes_and_claims_resolve():
    claims = {d["metadata"]["name"] for d in _k8s_docs() if d["kind"] == "PersistentVolumeClaim"}
    config_maps = {d["metadata"]["name"] for d in _k8s_docs() if d["kind"] == "ConfigMap"}
    for where, pod in _workloads():
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        templates = set()
        for doc in _k8s_docs():
            if doc["kind"] == "StatefulSet":
                templates |= {t["metadata"]["name"] for t in doc["spec"].get("volumeClaimTemplates", [])}
        for container in pod["containers"]:
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in templates, (where, mount)
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, (where, volume)
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps, (where, volume)


def test_k8s_services_select_their_workloads():
    docs = _k8s_docs()
    workload_labels = [d["spec"]["template"]["metadata"]["labels"] for d in docs if d["kind"] in {"Deployment",
                                                                                                  "StatefulSet"}]
    for svc in (d for d in docs if d["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        assert any(selector.items() <= labels.items() for labels in workload_labels), svc["metadata"]["name"]
    names = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    assert {"postgres", "mlflow", "meshflow-api"} <= names


def test_k8s_api_is_one_replica_and_runs_jobs_as_jobsets(monkeypatch):
    """Jobs run as their own JobSets: the api pod is small, has the RBAC to create them, and its
    settings name a shared (ReadWriteMany) workspace claim and a job ServiceAccount that exist."""
    deployment = _api_deployment()
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"][:3] == ["python", "-m", "api"] and "command" not in container  # keeps tini
    env = {v["name"]: v["value"] for v in container["env"] if "value" in v}
    import os
    for name in [n for n in os.environ if n.startswith(PREFIX)]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if "$(" not in value:
            monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.executor == "kubernetes" and settings.kubernetes_image == container["image"]
    check_settings(settings)   # the executor starts: an MLflow server, no credential outside a Secret
    cpu = container["resources"]["requests"]["cpu"]
    assert (float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)) <= 1, "the api pod runs no workers"
    docs = _k8s_docs()
    (claim,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"
                and d["metadata"]["name"] == settings.kubernetes_workspace_pvc]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    mounted = {v["persistentVolumeClaim"]["claimName"]: v["name"] for v in pod["volumes"]
               if "persistentVolumeClaim" in v}
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == mounted[settings.kubernetes_workspace_pvc]]
    assert mount["mountPath"] == str(settings.workspace)   # the job pods mount it at the same path
    accounts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
    assert pod["serviceAccountName"] in accounts
    assert accounts[settings.kubernetes_service_account]["automountServiceAccountToken"] is False
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"]}]
    (role,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == binding["roleRef"]["name"]]
    allowed = {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    assert {("jobset.x-k8s.io", "jobsets", v) for v in ("create", "get", "delete")} <= allowed
    assert ("", "pods/log", "get") in allowed and not any(r == "secrets" for _, r, _ in allowed)


def test_k8s_api_probes_hit_real_routes(tmp_path):
    from api.main import create_app

    app = create_app(Settings(workspace=tmp_path, auth_disabled=True))
    # app.routes holds the top-level routes; newer FastAPI keeps included routers as nested
    # objects there, so walk them, and also take the OpenAPI schema's paths.
    paths, stack = set(app.openapi()["paths"]), list(app.routes)
    while stack:
        route = stack.pop()
        if getattr(route, "path", None):
            paths.add(route.path)
        stack.extend(getattr(route, "routes", None) or [])
    assert {"/healthz", "/readyz"} <= paths
    (container,) = _api_deployment()["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for probe in (container["readinessProbe"], container["livenessProbe"]):
        port = probe["httpGet"]["port"]
        assert port in {p.get("name") for p in container["ports"]} | {p["containerPort"] for p in container["ports"]}
    assert {p["containerPort"] for p in container["ports"]} == {8000}
    compose_check = _compose()["services"]["api"]["healthcheck"]["test"]
    assert any("/readyz" in part for part in compose_check)


# ---------------------------------------------------------------------------- Dockerfile


def test_dockerfile_installs_torch_before_the_project_and_runs_the_api():
    instructions = _dockerfile_instructions()
    assert instructions[0] == ("FROM", "python:3.11-slim")
    runs = [(i, args) for i, (op, args) in enumerate(instructions) if op == "RUN"]
    (torch_at,) = [i for i, args in runs if "torch==2.13.0" in args]
    assert "download.pytorch.org/whl/cpu" in instructions[torch_at][1]
    (project_at,) = [i for i, args in runs if re.search(r'pip install "?\./?(\[\$\{EXTRAS\}\])?"?(\s|$)', args)]
    (extras,) = [args for op, args in instructions if op == "ARG" and args.startswith("EXTRAS=")]
    assert "kubernetes" in extras.split("=", 1)[1].split(",")   # the api submits JobSets with the client
    assert not any("pip install -e" in args for _, args in runs)  # the wheel, not the source tree
    copies = [i for i, (op, _) in enumerate(instructions) if op == "COPY"]
    assert torch_at < min(copies) < project_at
    copied = " ".join(args for op, args in instructions if op == "COPY")
    for needed in ["pyproject.toml", "README.md", "parallel", "trainer", "service", "api"]:
        assert re.search(rf"(^|\s){re.escape(needed)}(\s|$)", copied), f"{needed} is not copied"
    ops = [op for op, _ in instructions]
    user_at = ops.index("USER")
    assert instructions[user_at][1] == "10001:10001" and user_at > project_at   # the k8s runAsUser
    workdirs = [args for op, args in instructions if op == "WORKDIR"]
    assert workdirs[-1] == "/workspace"  # `python -m api` must not find a source tree in its cwd
    assert ("EXPOSE", "8000") in instructions
    (cmd,) = [args for op, args in instructions if op == "CMD"]
    assert json.loads(cmd) == ["python", "-m", "api", "--host", "0.0.0.0", "--port", "8000"]


def test_conf_dir_ships_inside_the_trainer_package():
    """The image installs a wheel: CONF_DIR is package data, and the top-level conf links to it."""
    from trainer.config.compose import CONF_DIR

    assert CONF_DIR == ROOT / "trainer" / "conf" and (CONF_DIR / "config.yaml").is_file()
    assert (ROOT / "conf").resolve() == CONF_DIR


def test_dockerignore_keeps_what_the_build_needs():
    rules = {line.strip() for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")}
    for needed in ["pyproject.toml", "README.md", "parallel", "trainer", "service", "api", "deploy", "*"]:
        assert needed not in rules and f"/{needed}" not in rules, needed
    assert "deploy/.env" in rules and ".git" in rules


# ---------------------------------------------------------------------------- PostgreSQL


def test_documented_postgres_url_parses_and_its_driver_imports():
    url = make_url(DOCUMENTED_URL)
    assert url.get_backend_name() == "postgresql" and url.get_driver_name() == "psycopg"
    importlib.import_module("psycopg")
    engine = create_engine(url)  # no connection is made
    assert (engine.dialect.name, engine.dialect.driver) == ("postgresql", "psycopg")
    engine.dispose()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(dep.replace(" ", "").startswith("psycopg[binary]") for dep in deps)
    assert DOCUMENTED_URL.split("://")[0] + "://" in (DEPLOY / "README.md").read_text()
