"""Tracking against a real MLflow sqlite store: params, metrics, artifacts, run status, SIGTERM.

Run: ``pytest tests/unit/test_tracking.py -q``. The store is created once per module: its
first use runs MLflow's schema migrations, which take seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from trainer.config.schema import TrackingConfig
from trainer.tracking.mlflow_tracker import MAX_PARAM_VALUE_LENGTH, MLflowTracker, make_tracker
from trainer.tracking.tracker import NullTracker, Terminated, TrackingError, run_lifecycle
from timing import scaled

SIGTERM_EXIT_CODE = 143  # 128 + SIGTERM: what Terminated.exit_code gives and the script exits with


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(tracking URI, its directory); cwd is moved there because MLflow puts artifacts under ./mlruns."""
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root}/mlflow.db"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        MlflowClient(tracking_uri=uri).search_experiments()  # run the migrations once
        yield uri, root


@pytest.fixture
def cfg(store: tuple[str, Path], request: pytest.FixtureRequest) -> TrackingConfig:
    return TrackingConfig(tracking_uri=store[0], experiment="unit", run_name=request.node.name)


@pytest.fixture
def client(store: tuple[str, Path]) -> MlflowClient:
    return MlflowClient(tracking_uri=store[0])


def test_params_are_flattened_with_dotted_keys(cfg: TrackingConfig, client: MlflowClient) -> None:
    tracker = MLflowTracker(cfg)
    tracker.log_params(
        {
            "train": {"seq_len": 128, "grad_clip": None, "checkpoint": {"keep": 3}},
            "mesh": [2, 2],
            "optim": {"betas": (0.9, 0.95)},
            "parallel": {"placements": {"layers.*.w[13].weight": {"tp": "Shard(0)"}}, "layouts": {}},
        }
    )
    assert client.get_run(tracker.run_id).data.params == {
        "train.seq_len": "128",
        "train.grad_clip": "null",
        "train.checkpoint.keep": "3",
        "mesh": "[2, 2]",
        "optim.betas": "[0.9, 0.95]",
        # MLflow rejects * [ ] in keys: a glob-keyed mapping stays one readable JSON param
        "parallel.placements": '{"layers.*.w[13].weight": {"tp": "Shard(0)"}}',
        "parallel.layouts": "{}",
    }


def test_param_keys_stay_valid_and_distinct(cfg: TrackingConfig, client: MlflowClient) -> None:
    tracker = MLflowTracker(cfg)
    tracker.log_params({"w[13]": 1, "w_13_": 2, "k" * 300: 3})
    logged = client.get_run(tracker.run_id).data.params
    assert sorted(logged.values()) == ["1", "2", "3"]  # nothing lost to a collision or a rejected key
    assert logged["w_13_"] == "2" and all(len(key) <= 250 for key in logged)


def test_many_params_and_a_long_value(
    cfg: TrackingConfig, client: MlflowClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    long_value = "".join(str(i % 10) for i in range(10_000))
    params = {"group": {f"p{i:03d}": i for i in range(150)}, "long": long_value}
    tracker = MLflowTracker(cfg)
    # MlflowClient.log_batch chunks by itself in mlflow 3.17; a server's API does not, so we do.
    sizes = []
    real_log_batch = tracker._client.log_batch
    monkeypatch.setattr(tracker._client, "log_batch", lambda *a,
                        **kw: sizes.append(len(kw["params"])) or real_log_batch(*a, **kw))
    tracker.log_params(params)

    assert sizes == [100, 51]
    logged = client.get_run(tracker.run_id).data.params
    assert len(logged) == 151 and logged["group.p149"] == "149"
    assert len(logged["long"]) <= MAX_PARAM_VALUE_LENGTH
    assert long_value.startswith(logged["long"].split("...")[0]) and "params/long.txt" in logged["long"]
    artifact = client.download_artifacts(tracker.run_id, "params/long.txt", str(tmp_path))
    assert Path(artifact).read_text() == long_value


def test_metrics_one_batch_per_step(cfg: TrackingConfig, client: MlflowClient, monkeypatch: pytest.MonkeyPatch) -> None:
    tracker = MLflowTracker(cfg)
    calls = []
    real_log_batch = tracker._client.log_batch
    monkeypatch.setattr(tracker._client, "log_batch", lambda *a, **kw: calls.append(kw) or real_log_batch(*a, **kw))
    for step in (1, 2, 3):
        tracker.log_metrics({"loss": 1.0 / step, "lr": 0.1 * step}, step=step)

    assert len(calls) == 3
    loss = client.get_metric_history(tracker.run_id, "loss")
    assert [(m.step, m.value) for m in sorted(loss, key=lambda m: m.step)] == [(1, 1.0), (2, 0.5), (3, 1.0 / 3)]
    assert sorted(m.step for m in client.get_metric_history(tracker.run_id, "lr")) == [1, 2, 3]


def test_once_per_run_numbers_are_params_not_one_point_charts(cfg: TrackingConfig, client: MlflowClient,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    tracker = MLflowTracker(cfg)
    tracker.log_summary({"pipeline_bubble": 0.188349, "predicted_peak_memory_mb": 56.25, "checkpoint_bytes": 4096})
    run = client.get_run(tracker.run_id)
    assert run.data.params == {"pipeline_bubble": "0.1883", "predicted_peak_memory_mb": "56.25",
                               "checkpoint_bytes": "4096"}
    assert run.data.metrics == {}  # the run's overview lists them; no chart of one point
    # A restarted attempt attaches to the run and measures again: MLflow keeps a param's first value,
    # the attempt goes on, new numbers are added and the kept ones named.
    again = MLflowTracker(cfg, run_id=tracker.run_id)
    with caplog.at_level("WARNING", logger="trainer.tracking.mlflow_tracker"):
        again.log_summary({"pipeline_bubble": 0.2, "predicted_peak_memory_mb": 56.25, "checkpoint_seconds": 0.5})
    params = client.get_run(tracker.run_id).data.params
    assert (params["pipeline_bubble"], params["checkpoint_seconds"]) == ("0.1883", "0.5")
    assert "pipeline_bubble" in caplog.text and "predicted_peak_memory_mb" not in caplog.text


def test_a_sqlite_store_keeps_artifacts_beside_it_whichever_directory_a_run_starts_in(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One store for every directory (the default ``~/.meshflow/mlflow.db``): a new experiment's
    artifacts go to ``mlartifacts/`` beside the file, not to ``./mlruns`` of the first run's
    directory, so a later run from elsewhere still logs after that directory is gone."""
    home = tmp_path / "home" / ".meshflow"  # not there yet: the first run makes it
    uri = f"sqlite:///{home}/mlflow.db"
    for name in ("first", "second"):
        work = tmp_path / name
        work.mkdir()
        monkeypatch.chdir(work)
        tracker = MLflowTracker(TrackingConfig(tracking_uri=uri, experiment="shared", run_name=name))
        tracker.log_artifact_text(name, "note.txt")
        monkeypatch.chdir(tmp_path)
        assert sorted(p.name for p in work.iterdir()) == []  # nothing in the working directory
        work.rmdir()
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("shared")
    assert experiment.artifact_location == (home / "mlartifacts" / "shared").as_uri()
    runs = {run.info.run_name: run.info.run_id for run in client.search_runs([experiment.experiment_id])}
    assert Path(client.download_artifacts(runs["second"], "note.txt", str(tmp_path))).read_text() == "second"
    assert (home / "mlartifacts" / "shared" / runs["first"] / "artifacts" / "note.txt").read_text() == "first"


def test_artifact_text_and_tags(cfg: TrackingConfig, client: MlflowClient, tmp_path: Path) -> None:
    tracker = MLflowTracker(cfg)
    tracker.log_artifact_text("mesh: [2, 2]\n", "config/resolved.yaml")
    tracker.set_tag("mesh_shape", (2, 2))
    run = client.get_run(tracker.run_id)
    assert run.data.tags["mesh_shape"] == "(2, 2)"
    assert run.info.run_name == "test_artifact_text_and_tags"
    path = client.download_artifacts(tracker.run_id, "config/resolved.yaml", str(tmp_path))
    assert Path(path).read_text() == "mesh: [2, 2]\n"


@pytest.mark.parametrize(
    ("error", "status"),
    [(None, "FINISHED"), (ValueError, "FAILED"), (KeyboardInterrupt, "KILLED"), (Terminated, "KILLED")],
)
def test_lifecycle_status(cfg: TrackingConfig, client: MlflowClient, error: type[BaseException] | None,
                          status: str) -> None:
    tracker = MLflowTracker(cfg)
    assert client.get_run(tracker.run_id).info.status == "RUNNING"
    if error is None:
        with run_lifecycle(tracker):
            tracker.log_metrics({"loss": 1.0}, step=0)
    else:
        with pytest.raises(error), run_lifecycle(tracker):
            raise error()
    assert client.get_run(tracker.run_id).info.status == status
    tracker.finish("FAILED")  # idempotent: the first status stays
    assert client.get_run(tracker.run_id).info.status == status


def test_attach_to_existing_run(cfg: TrackingConfig, client: MlflowClient) -> None:
    launcher_run = MLflowTracker(cfg).run_id  # the launcher creates the run ...
    worker = make_tracker(cfg.model_copy(update={"run_id": launcher_run}), is_main=True)  # ... rank 0 joins it
    assert worker.run_id == launcher_run
    worker.log_metrics({"loss": 2.0}, step=5)
    assert [m.step for m in client.get_metric_history(launcher_run, "loss")] == [5]
    assert MLflowTracker(cfg, run_id=launcher_run).run_id == launcher_run  # the argument works too

    with pytest.raises(TrackingError, match="tracking.run_id: MLflow run 'f00' not found"):
        MLflowTracker(cfg, run_id="f00")


def test_make_tracker_null_cases(cfg: TrackingConfig) -> None:
    assert isinstance(make_tracker(cfg, is_main=False), NullTracker)
    null = make_tracker(cfg.model_copy(update={"backend": "none"}), is_main=True)
    assert isinstance(null, NullTracker) and null.run_id is None
    with run_lifecycle(null):
        null.log_params({"a": {"b": 1}})
        null.log_metrics({"loss": 1.0}, step=1)


def _run_python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=scaled(60))


def test_null_tracker_does_not_import_mlflow(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import sys
        from trainer.config.schema import TrackingConfig
        from trainer.tracking.mlflow_tracker import make_tracker
        from trainer.tracking.tracker import run_lifecycle
        tracker = make_tracker(TrackingConfig(backend="none"), is_main=True)
        with run_lifecycle(tracker):
            tracker.log_params({"train": {"steps": 1}})
        print(type(tracker).__name__, sorted(m for m in sys.modules if m.split(".")[0] == "mlflow"))
        """
    )
    result = _run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "NullTracker []"


SIGTERM_SCRIPT = """
import sys, time
from trainer.config.schema import TrackingConfig
from trainer.tracking.mlflow_tracker import make_tracker
from trainer.tracking.tracker import Terminated, install_signal_handlers, run_lifecycle

cfg = TrackingConfig(tracking_uri=sys.argv[1], experiment="unit", run_name="sigterm")
try:
    with install_signal_handlers():
        tracker = make_tracker(cfg, is_main=True)
        with run_lifecycle(tracker):
            print(tracker.run_id, flush=True)
            while True:
                time.sleep(0.05)
except Terminated as exc:
    sys.exit(exc.exit_code)
"""


def test_sigterm_ends_run_killed(store: tuple[str, Path], client: MlflowClient, tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(SIGTERM_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), store[0]], cwd=store[1], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        run_id = proc.stdout.readline().strip()
        assert run_id, proc.stderr.read()
        assert client.get_run(run_id).info.status == "RUNNING"
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=scaled(30)) == SIGTERM_EXIT_CODE, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert client.get_run(run_id).info.status == "KILLED"


def test_a_sigterm_during_an_mlflow_write_is_raised_once_the_write_is_whole(
    cfg: TrackingConfig, client: MlflowClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from trainer.tracking.tracker import install_signal_handlers

    tracker = MLflowTracker(cfg)
    real_log_batch, written = tracker._client.log_batch, []

    def signalled_mid_write(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs in here, between two bytecodes of the write
        real_log_batch(*args, **kwargs)
        written.append(True)

    monkeypatch.setattr(tracker._client, "log_batch", signalled_mid_write)
    with install_signal_handlers(), pytest.raises(Terminated):
        tracker.log_metrics({"loss": 2.5}, step=1)
    assert written == [True]
    assert [(m.step, m.value) for m in client.get_metric_history(tracker.run_id, "loss")] == [(1, 2.5)]
    with install_signal_handlers(), pytest.raises(Terminated):  # outside a write it still stops at once
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)


def test_a_restarted_attempt_logs_each_step_once(cfg: TrackingConfig, client: MlflowClient) -> None:
    """Workers restarted after a failure resume from the checkpoint at step 2 and replay step 3: MLflow
    keeps the first attempt's point of each step, and the steps after it come from the new attempt."""
    first = MLflowTracker(cfg)
    for step in (1, 2, 3):
        first.log_metrics({"loss": 10.0 + step, "lr": 0.1}, step=step)
    first.log_metrics({"val_loss": 5.0}, step=2)
    again = MLflowTracker(cfg, run_id=first.run_id)
    for step in (3, 4):
        again.log_metrics({"loss": 20.0 + step, "lr": 0.2, "val_loss": 6.0}, step=step)
    loss = sorted((m.step, m.value) for m in client.get_metric_history(first.run_id, "loss"))
    assert loss == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 24.0)]
    assert sorted(m.step for m in client.get_metric_history(first.run_id, "lr")) == [1, 2, 3, 4]
    assert sorted((m.step, m.value) for m in client.get_metric_history(first.run_id, "val_loss")) == \
        [(2, 5.0), (3, 6.0), (4, 6.0)]
