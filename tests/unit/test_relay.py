"""One MLflow client per job: worker rank 0's writes made by the launcher's tracker (trainer.tracking.relay),
whose run is made beside the workers' start (trainer.tracking.opening).

Run: ``pytest tests/unit/test_relay.py -q``. Rank 0 is this test's thread, or a process of its own where
what it imports matters; the launcher's tracker a recording fake, or an MLflow run in a SQLite store.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from trainer.config.schema import TrackingConfig
from trainer.tracking.mlflow_tracker import MLflowTracker
from trainer.tracking.opening import OpeningRun
from trainer.tracking.relay import RelayServer, RelayTracker
from trainer.tracking.tracker import TrackingError
from timing import scaled


class Recorder:
    """A launcher's tracker that keeps every call; ``fail`` names a method that raises ``OSError``."""

    run_id = "run-1"

    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[tuple] = []
        self.stamps: list[int] = []  # log_metrics' at_ms: when rank 0 measured them
        self.fail = fail

    def __getattr__(self, method: str):
        def call(*args, at_ms=None):
            if method == "log_metrics":
                self.stamps.append(at_ms)
            if method == self.fail:
                raise OSError(28, "No space left on device")
            if method == "log_artifact":  # what MLflow would upload: the file's bytes, now
                args = (Path(args[0]).read_text(), *args[1:])
            self.calls.append((method, *args))
        return call


def test_every_write_reaches_the_launchers_tracker_in_order(tmp_path: Path) -> None:
    launcher = Recorder()
    with RelayServer(launcher) as relay:
        rank0 = RelayTracker(relay.address)
        rank0.log_summary({"predicted_peak_memory_mb": 31.0})
        rank0.log_metrics({"loss": 5.5, "lr": 1e-4}, step=1)
        rank0.set_tag("latest_checkpoint", tmp_path)
        rank0.log_artifact_text("[]", "metrics/peak.json")
        file = tmp_path / "model.safetensors"
        file.write_text("weights")
        rank0.log_artifact(file, "model")
        file.unlink()  # acknowledged: the launcher has read it before the call returned
        rank0.finish("FINISHED")  # the launcher's to make: not relayed
        rank0.close()
    assert launcher.calls == [
        ("log_summary", {"predicted_peak_memory_mb": 31.0}),
        ("log_metrics", {"loss": 5.5, "lr": 1e-4}, 1),
        ("set_tag", "latest_checkpoint", str(tmp_path)),
        ("log_artifact_text", "[]", "metrics/peak.json"),
        ("log_artifact", "weights", "model"),
    ]


def test_a_failed_write_is_raised_in_rank0_as_the_launcher_raised_it(tmp_path: Path) -> None:
    with RelayServer(Recorder(fail="set_tag")) as relay:
        rank0 = RelayTracker(relay.address)
        rank0.set_tag("a", 1)  # not waited for ...
        with pytest.raises(OSError, match="No space left on device") as raised:
            rank0.close()  # ... raised at the next call that waits, or the one after it
        assert "the launcher's MLflow client" in " ".join(raised.value.__notes__)
    with RelayServer(Recorder(fail="log_artifact")) as relay:
        rank0 = RelayTracker(relay.address)
        (tmp_path / "f").write_text("x")
        with pytest.raises(OSError, match="No space left"):
            rank0.log_artifact(tmp_path / "f")  # an artifact's write is waited for: raised at once
        rank0.log_metrics({"loss": 1.0}, step=1)  # the connection is still in step
        rank0.close()


def test_a_restarted_attempt_does_not_log_its_replayed_steps_twice() -> None:
    launcher = Recorder()
    with RelayServer(launcher) as relay:
        first = RelayTracker(relay.address)
        for step in (1, 2, 3):
            first.log_metrics({"loss": float(step)}, step=step)
        first.log_metrics({"eval_loss": 9.0}, step=2)
        first.close()
        again = RelayTracker(relay.address)  # resumed from step 1's checkpoint: steps 2 and 3 again
        for step in (2, 3, 4):
            again.log_metrics({"loss": 10.0 + step, "eval_loss": 20.0 + step}, step=step)
        again.close()
    assert [call[1:] for call in launcher.calls] == [
        ({"loss": 1.0}, 1), ({"loss": 2.0}, 2), ({"loss": 3.0}, 3), ({"eval_loss": 9.0}, 2),
        ({"eval_loss": 23.0}, 3), ({"loss": 14.0, "eval_loss": 24.0}, 4)]


def test_the_relay_outlives_a_rank0_gone_mid_call_and_stops_with_one_still_connected() -> None:
    launcher = Recorder(fail="log_artifact")
    with RelayServer(launcher) as relay:
        gone = RelayTracker(relay.address)
        gone._send("set_tags", {"a": "1"})
        gone._conn.send((9, "log_artifact", ("/no/such/file",), {}))  # fails; its answer finds no one
        gone._conn.close()
        again = RelayTracker(relay.address)  # the next attempt's rank 0 is served
        again.log_metrics({"loss": 1.0}, step=1)
        # never closed (a rank 0 killed): the relay stops at the launcher's exit all the same, its writes made
    assert launcher.calls == [("set_tags", {"a": "1"}), ("log_metrics", {"loss": 1.0}, 1)]


def test_only_the_trackers_writes_are_relayed() -> None:
    with RelayServer(Recorder()) as relay:
        rank0 = RelayTracker(relay.address)
        rank0._send("finish", "FAILED")
        with pytest.raises(TrackingError, match="not 'finish'"):
            rank0.close()


RANK0 = """
import json, sys
from trainer.tracking.relay import RelayAddress, RelayTracker
tracker = RelayTracker(RelayAddress(**json.loads(sys.argv[1])))
for step in range(1, 4):
    tracker.log_metrics({"loss": 5.0 - step}, step=step)
tracker.log_summary({"pipeline_bubble": 0.2})
tracker.log_artifact(sys.argv[2], "pictures")
tracker.close()
print(sorted(m for m in sys.modules if m.split(".")[0] == "mlflow"))
"""


def test_rank0_in_its_own_process_logs_into_the_launchers_run_without_mlflow(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    launcher = MLflowTracker(TrackingConfig(tracking_uri=uri, experiment="relay", run_name="relay"))
    picture = tmp_path / "timeline.json"
    picture.write_text("{}")
    with RelayServer(launcher) as relay:
        rank0 = subprocess.run([sys.executable, "-c", textwrap.dedent(RANK0), json.dumps(vars(relay.address)),
                                str(picture)], cwd=tmp_path, capture_output=True, text=True, timeout=scaled(120))
    assert rank0.returncode == 0, rank0.stderr
    assert rank0.stdout.strip() == "[]"  # rank 0 never imported MLflow
    client = MlflowClient(tracking_uri=uri)
    history = client.get_metric_history(launcher.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 4.0), (2, 3.0), (3, 2.0)]
    assert client.get_run(launcher.run_id).data.params["pipeline_bubble"] == "0.2"
    assert [a.path for a in client.list_artifacts(launcher.run_id, "pictures")] == ["pictures/timeline.json"]


def test_an_opening_run_is_a_tracker_at_once_and_its_calls_wait_for_the_run() -> None:
    made, launcher = threading.Event(), Recorder()

    def make() -> Recorder:
        made.wait()
        return launcher

    tracker = OpeningRun(make)  # returns before the run exists
    with RelayServer(tracker) as relay:  # rank 0's writes queue meanwhile, in order
        rank0 = RelayTracker(relay.address)
        rank0.log_metrics({"loss": 5.0}, step=1)
        rank0.set_tag("resumed_from", "ck")
        assert launcher.calls == []  # nothing written before the run exists
        time.sleep(0.05)
        made_ms = int(time.time() * 1000)
        made.set()
        rank0.close()
    tracker.log_summary({"bubble": 0.2})
    tracker.finish("FINISHED")
    assert tracker.run_id == "run-1" and tracker.failure() is None
    assert launcher.stamps[0] < made_ms  # written once the run existed, dated when rank 0 measured it
    assert launcher.calls == [("log_metrics", {"loss": 5.0}, 1), ("set_tag", "resumed_from", "ck"),
                              ("log_summary", {"bubble": 0.2}), ("finish", "FINISHED")]


def test_a_run_that_could_not_be_made_fails_the_writes_that_need_it_and_has_nothing_to_end() -> None:
    def make() -> Recorder:
        raise TrackingError("tracking.experiment: MLflow experiment 'gone' is deleted")

    tracker = OpeningRun(make)
    with RelayServer(tracker) as relay:
        rank0 = RelayTracker(relay.address)
        rank0.log_metrics({"loss": 5.0}, step=1)
        with pytest.raises(TrackingError, match="'gone' is deleted"):
            rank0.close()  # rank 0 stops on it, at its next call that waits or the one after
    assert tracker.run_id is None and tracker.experiment_id is None
    assert "is deleted" in str(tracker.failure())
    tracker.finish("FAILED")  # no run: nothing to end, nothing raised
    with pytest.raises(TrackingError):
        tracker.set_tag("a", 1)
