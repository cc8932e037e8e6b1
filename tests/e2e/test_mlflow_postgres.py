"""MLflow on PostgreSQL, as deployed: ``mlflow server`` with a PostgreSQL backend store and an artifact
root, a trainer run logging to it over HTTP, and the same run logged to a SQLite store.

    python -m pytest -q tests/e2e/test_mlflow_postgres.py

The PostgreSQL server is the session's own (tests/pg.py: initdb + pg_ctl on 127.0.0.1, skipped
without the binaries, failed under CI=true); the MLflow server gets a new database on it and is
stopped at the end. The two runs have the same config and seed, so every metric that does not
measure time reads back with the same values at the same steps, whichever store holds it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.conftest import run_cli
from tests.e2e.mlflow_ui import mlflow_server

pytestmark = pytest.mark.slow

TINY = ("train.steps=4", "train.global_batch_size=2", "train.seq_len=16", "train.log_every=1", "data.max_bytes=20000",
        "model.n_layers=1", "model.dim=32", "model.n_heads=2", "model.n_kv_heads=2", "tracking.system_metrics=false")
# Metrics that measure the machine (time, memory), not the training: they differ between any two runs.
MEASURED = ("step_time_s", "tokens_per_s", "peak_memory_mb", "checkpoint_seconds")


def _train(tracking_uri: str, cwd: Path) -> str:
    """One tiny run logging to ``tracking_uri``; its run id."""
    cwd.mkdir()
    proc = run_cli([*TINY, f"tracking.tracking_uri={tracking_uri}"], cwd=cwd, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "done: steps 1..4" in proc.stdout
    client = MlflowClient(tracking_uri=tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("meshflow").experiment_id])
    assert run.info.status == "FINISHED"
    return run.info.run_id


def _histories(client: MlflowClient, run_id: str) -> dict[str, list[tuple[int, float]]]:
    run = client.get_run(run_id)
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
            for key in run.data.metrics if not key.startswith(MEASURED) and not key.startswith("system/")}


def _files(client: MlflowClient, run_id: str, path: str) -> set[str]:
    """Every file artifact under ``path``, recursively, as paths relative to the run's root."""
    found = set()
    for entry in client.list_artifacts(run_id, path):
        found |= _files(client, run_id, entry.path) if entry.is_dir else {entry.path}
    return found


def _stored_metric_rows(postgres, database: str, run_id: str) -> int:
    import psycopg

    with psycopg.connect(postgres.url(database, driver="postgresql")) as connection:
        return connection.execute("SELECT count(*) FROM metrics WHERE run_uuid = %s", (run_id,)).fetchone()[0]


def test_a_run_logged_over_http_to_postgresql_reads_back_like_one_in_sqlite(postgres, tmp_path):
    backend = postgres.create_database("mlflow")
    with mlflow_server(tmp_path / "server", backend_store_uri=backend) as server:
        http_run = _train(server.url, tmp_path / "http")
        over_http = MlflowClient(tracking_uri=server.url)
        http_metrics = _histories(over_http, http_run)
        experiment_id = over_http.get_run(http_run).info.experiment_id
        http_artifacts = {a.path for a in over_http.list_artifacts(http_run)}
        http_logs = _files(over_http, http_run, "logs")
        http_config = yaml.safe_load(Path(over_http.download_artifacts(http_run, "config.yaml",
                                                                       str(tmp_path))).read_text())
    sqlite_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    local_run = _train(sqlite_uri, tmp_path / "local")
    local_metrics = _histories(MlflowClient(tracking_uri=sqlite_uri), local_run)

    # The same numbers at the same steps: the loss of every step, and the rest that training decides.
    assert {"loss", "lr", "grad_norm"} <= http_metrics.keys()
    assert [step for step, _ in http_metrics["loss"]] == [1, 2, 3, 4]
    assert http_metrics == local_metrics
    # ... held in PostgreSQL (the server's store), not somewhere else.
    assert _stored_metric_rows(postgres, "mlflow", http_run) >= 4 * len(http_metrics)

    # Artifacts went through the server into its artifact root: <root>/<experiment>/<run>/artifacts/.
    root = tmp_path / "server" / "artifacts" / experiment_id / http_run / "artifacts"
    assert {"config.yaml", "plan.txt", "logs"} <= http_artifacts
    assert (root / "config.yaml").is_file() and (root / "plan.txt").is_file()
    assert yaml.safe_load((root / "config.yaml").read_text()) == http_config
    assert http_config["train"]["steps"] == 4 and http_config["model"]["dim"] == 32
    # The run's files under logs/ (one device: the placement and timeline files) are all in the root, not empty.
    on_disk = {str(p.relative_to(root)) for p in (root / "logs").rglob("*") if p.is_file() and p.stat().st_size}
    assert http_logs and on_disk == http_logs, (on_disk, http_logs)
    assert _files(MlflowClient(tracking_uri=sqlite_uri), local_run, "logs") == http_logs
