"""The links a run prints work: runs started from two directories land in the user's one store,
and the command the summary prints serves it where both links point, in the model-training view.

    python -m pytest -q tests/e2e/test_mlflow_links.py

Needs Debian's Chromium and the playwright package, as tests/e2e/test_mlflow_ui.py does (skips
without them, fails under CI=true).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import time
import urllib.request

import pytest
from timing import Deadline, scaled

from tests.conftest import run_cli
from tests.e2e.mlflow_ui import (
    chromium,
    expect_model_training_view,
    require_browser,
    ui_page,
)
from tests.ports import free_port

pytestmark = pytest.mark.slow

TINY = ["train.steps=2", "train.global_batch_size=2", "train.seq_len=16", "model.n_layers=1", "model.dim=32",
        "model.n_heads=2", "model.n_kv_heads=2", "data.max_bytes=20000", "tracking.pictures=false",
        "tracking.system_metrics=false"]
SUMMARY = re.compile(r"^  mlflow run: (?P<link>\S+)  \(serve it: (?P<serve>.+)\)$", re.MULTILINE)


def test_links_from_two_directories_open_in_the_store_the_printed_command_serves(tmp_path):
    require_browser()
    from playwright.sync_api import expect

    home, port = tmp_path / "home", free_port()
    printed = []
    for name in ("first", "second"):
        work = tmp_path / name
        work.mkdir()
        out = run_cli([*TINY, f"tracking.run_name={name}", f"tracking.ui_url=http://127.0.0.1:{port}"], cwd=work,
                      timeout=600, env={"MESHFLOW_HOME": str(home)})
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        printed.append(SUMMARY.search(out.stdout).groupdict())
        shutil.rmtree(work)  # the run's directory may go: the store and its artifacts are the user's
    serve = {p["serve"] for p in printed}
    assert serve == {f"mlflow ui --backend-store-uri sqlite:///{home}/mlflow.db --port {port}"}, printed

    with _serving(serve.pop(), cwd=tmp_path, port=port), chromium() as browser:
        for (name, shown) in zip(("first", "second"), printed):
            experiment_id = re.search(r"#/experiments/(\d+)/runs/", shown["link"])[1]
            with ui_page(browser) as page:  # a new browser each time: no view remembered
                page.goto(shown["link"])
                expect(page.get_by_test_id("runs-header")).to_have_text(name)
                expect_model_training_view(page, experiment_id, "meshflow")
                # a once-per-run number in the overview's parameters, not a chart of one point
                expect(page.get_by_text("predicted_peak_memory_mb", exact=True).first).to_be_visible()


class _serving:
    """The printed ``mlflow ui`` command, as a user pastes it, until the block ends."""

    def __init__(self, command: str, *, cwd, port: int) -> None:
        self.command, self.cwd, self.port = command, cwd, port

    def __enter__(self):
        env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true",
               "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.log = open(self.cwd / "mlflow-ui.log", "wb")
        self.proc = subprocess.Popen(shlex.split(self.command), cwd=self.cwd, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = Deadline(120)
        while not deadline.expired():
            assert self.proc.poll() is None, (self.cwd / "mlflow-ui.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=scaled(2)) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"`{self.command}` not serving: " + (self.cwd / "mlflow-ui.log").read_text()[-3000:])

    def __exit__(self, *exc) -> None:
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=scaled(wait))
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        self.log.close()
