"""The MLflow dashboard as a person opens it: a 3d run's page in headless Chromium, served by `mlflow server`.

    python -m pytest -q tests/e2e/test_mlflow_ui.py
    MESHFLOW_SCREENSHOT_DIR=docs python -m pytest -q tests/e2e/test_mlflow_ui.py -k 3d   # docs/tracking.md's pictures

Needs Debian's Chromium at /usr/bin/chromium and the playwright package (both installed by .ci/run
and the dev extra); without them the tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.e2e.mlflow_ui import (
    check_run_page,
    chromium,
    mlflow_server,
    png_size,
    require_browser,
    run_page_url,
    ui_page,
)

pytestmark = pytest.mark.slow

EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
RUN_TAGS = ("mesh", "dims", "preset", "world_size", "model", "precision", "git_commit", "user", "host")
ARTIFACTS = ("config.yaml", "plan.txt", "pictures/timeline.png", "pictures/timeline.json",
             "pictures/placement.png", "pictures/placement.json")
TIMELINE = "pictures/timeline.png"
THREE_D = ["+parallel=3d", "mesh=[2,2,2]", "train.steps=4", "train.log_every=2"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_browser()  # before the server starts: a skip costs nothing
    with mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as server:
        yield server


@pytest.fixture(scope="module")
def browser(server):  # closed before the server stops, so no connection holds up its shutdown
    with chromium() as browser:
        yield browser


def _client(server):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=server.url)


def _timeline_png(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3), dpi=100)
    for rank in range(4):
        ax.broken_barh([(rank * 0.5 + step * 3, 1.0) for step in range(3)], (rank - 0.4, 0.8))
    ax.set(title="pipeline timeline", xlabel="ms", ylabel="pp rank")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def test_run_page_shows_model_training_view_tags_and_picture(server, browser, tmp_path):
    """The UI side alone, on a run written through MlflowClient as the contract says the trainer
    writes it: the selectors the 3d test relies on, checked in seconds."""
    client = _client(server)
    experiment_id = client.create_experiment("ui-selectors", tags=dict([EXPERIMENT_KIND]))
    tags = {"mesh": "[2, 2, 2]", "dims": "[dp, pp, tp]", "preset": "3d", "world_size": "8", "model": "gpt_debug",
            "precision": "fp32", "git_commit": "0123456789abcdef0123456789abcdef01234567", "user": "alice",
            "host": "node1"}
    run_id = client.create_run(experiment_id, run_name="3d-2x2x2", tags=tags).info.run_id
    client.log_artifact(run_id, str(_timeline_png(tmp_path / "timeline.png")), "pictures")
    client.log_text(run_id, "mesh: [2, 2, 2]\n", "config.yaml")
    client.set_terminated(run_id)

    with ui_page(browser) as page:
        shots = check_run_page(page, server.url, experiment_id=experiment_id, experiment_name="ui-selectors",
                               run_id=run_id, run_name="3d-2x2x2", tags=tags, picture=TIMELINE,
                               picture_size=png_size((tmp_path / "timeline.png").read_bytes()),
                               out_dir=tmp_path / "screenshots")
    assert [png_size(shots[name].read_bytes())[0] for name in ("overview", "artifact")] == [1400, 1400]

    # The checks tell the views apart: without the URL parameter a new browser gets the GenAI view,
    # tag or no tag (MLflow 3.17; should this fail, the UI honours the tag again and the parameter
    # may go), and its links are there instead.
    from playwright.sync_api import expect

    with ui_page(browser) as page:
        page.goto(run_page_url(server.url, experiment_id, run_id, view=None))
        expect(page.get_by_test_id("runs-header")).to_have_text("3d-2x2x2")
        expect(page.get_by_role("link", name="Sessions", exact=True)).to_be_visible()
        expect(page.get_by_role("link", name="Model registry", exact=True)).to_have_count(0)


def test_3d_run_in_mlflow_ui(server, browser, tmp_path):
    """Acceptance ("MLflow dashboards worth opening"): after a 3d run the run page shows the
    model-training view, the run's tags and its pipeline timeline picture."""
    out = run_cli([*THREE_D, f"tracking.tracking_uri={server.url}"], cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    client = _client(server)
    experiment = client.get_experiment_by_name("meshflow")
    assert experiment is not None, "no experiment 'meshflow' on the server"
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.status for r in runs] == ["FINISHED"]
    run = runs[0]
    problems = _contract_problems(client, experiment, run)  # all of them at once, not the first
    assert not problems, "the run does not meet the tracking contract:\n  - " + "\n  - ".join(problems)
    timeline_json, timeline_png = _download(server, run.info.run_id, ["pictures/timeline.json", TIMELINE],
                                            tmp_path / "downloaded")
    _check_chrome_trace(json.loads(timeline_json.read_text()))

    with ui_page(browser) as page:
        shots = check_run_page(page, server.url, experiment_id=experiment.experiment_id,
                               experiment_name="meshflow", run_id=run.info.run_id, run_name=run.info.run_name,
                               tags={k: run.data.tags[k] for k in RUN_TAGS}, picture=TIMELINE,
                               picture_size=png_size(timeline_png.read_bytes()), out_dir=tmp_path / "screenshots")
    _publish(shots)


def _contract_problems(client, experiment, run) -> list[str]:
    """What the trainer's side of the contract misses: the experiment's kind, a readable run name,
    the run's tags and its artifacts."""
    problems = []
    key, kind = EXPERIMENT_KIND
    if experiment.tags.get(key) != kind:
        problems.append(f"experiment tag {key}={kind!r} (experiment tags: {experiment.tags})")
    if not run.info.run_name.startswith("3d-2x2x2"):
        problems.append(f"a readable run name such as '3d-2x2x2', not {run.info.run_name!r}")
    tags = run.data.tags
    if missing := [k for k in RUN_TAGS if not tags.get(k)]:
        problems.append(f"run tags {missing} (run tags: "
                        f"{ {k: v for k, v in tags.items() if not k.startswith('mlflow.')} })")
    expected = {"mesh": "[2, 2, 2]", "preset": "3d", "world_size": "8"}
    if wrong := {k: tags.get(k) for k, v in expected.items() if tags.get(k) not in (None, v)}:
        problems.append(f"run tags {wrong} should be {expected}")
    if tags.get("dims") and not re.search(r"dp\W+pp\W+tp", tags["dims"]):
        problems.append(f"run tag dims={tags['dims']!r} should name dp, pp, tp in order")
    artifacts = _artifact_paths(client, run.info.run_id)
    if missing := sorted(set(ARTIFACTS) - artifacts):
        problems.append(f"artifacts {missing} (the run has {sorted(artifacts)})")
    if not any(path.startswith("logs/") for path in artifacts):
        problems.append("artifacts under logs/")
    return problems


def _artifact_paths(client, run_id: str, path: str | None = None) -> set[str]:
    """Every file in the run's artifacts, as paths relative to the root."""
    found = set()
    for info in client.list_artifacts(run_id, path):
        found |= _artifact_paths(client, run_id, info.path) if info.is_dir else {info.path}
    return found


def _download(server, run_id: str, paths: list[str], dst: Path) -> list[Path]:
    from mlflow.artifacts import download_artifacts

    dst.mkdir(parents=True, exist_ok=True)
    return [Path(download_artifacts(run_id=run_id, artifact_path=p, dst_path=str(dst), tracking_uri=server.url))
            for p in paths]


def _check_chrome_trace(trace) -> None:
    """Chrome's trace format: a list of events, or an object holding them under traceEvents."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert isinstance(events, list) and events, "timeline.json holds no trace events"
    assert all("ph" in event and "name" in event for event in events), events[:3]


def _publish(shots: dict[str, Path]) -> None:
    """With MESHFLOW_SCREENSHOT_DIR set, keep the pictures there as mlflow-run-overview.png and
    mlflow-run-timeline.png (docs/tracking.md shows docs/'s)."""
    target = os.environ.get("MESHFLOW_SCREENSHOT_DIR")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shots["overview"], Path(target) / "mlflow-run-overview.png")
        shutil.copyfile(shots["artifact"], Path(target) / "mlflow-run-timeline.png")
