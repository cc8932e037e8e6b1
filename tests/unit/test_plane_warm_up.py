"""The control plane warms where its validations run: the pool's workers warm themselves, and the
server process validates the default config itself only when it has no workers (a validation there
beside the workers' warm-ups only took CPU from them, delaying the first submission)."""

from __future__ import annotations

import pytest

from service.plane import ControlPlane
from service.settings import Settings


@pytest.mark.parametrize("workers, warmed_here", [(2, 0), (0, 1)])
def test_warm_up_validates_in_the_server_only_without_workers(tmp_path, monkeypatch, workers, warmed_here):
    settings = Settings(workspace=tmp_path / "ws", database_url=f"sqlite:///{tmp_path}/jobs.db",
                        mlflow_tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", validation_workers=workers, capacity=0)
    plane = ControlPlane(settings)  # not started: its pool has no workers yet, so nothing is waited for
    calls = []
    monkeypatch.setattr(plane, "resolve", lambda **request: calls.append(request))
    try:
        plane._warm_up()  # what start() runs in its warm-up thread
        assert plane.warm.is_set()
        assert calls == [{"overrides": [], "document": None}] * warmed_here
    finally:
        plane.stop()
