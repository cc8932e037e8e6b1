"""The README's commands, as a new user types them (the install part is what CI itself runs)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli


def _readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [line for block in blocks[:2] for line in block.splitlines() if line.strip()]


def test_readme_opens_with_install_and_run_commands():
    main, tests = _readme_commands()[:2]
    assert main == "pip install torch==2.13.0 && pip install -e . && python -m trainer +parallel=3d mesh=[2,2,2]"
    assert tests == 'pip install torch==2.13.0 && pip install -e ".[dev]" && python -m pytest -q'
    ci = (REPO / ".ci" / "run").read_text()
    assert tests in ci
    assert "python -m pytest -q -m slow" in ci.split(tests, 1)[1]  # CI's second pass, after the default run


def _finished_run(cwd):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{cwd}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("meshflow").experiment_id])
    assert [r.info.status for r in runs] == ["FINISHED"]
    return client, runs[0]


@pytest.mark.slow
def test_readme_main_command_trains_3d_and_logs_one_run(tmp_path):
    command = _readme_commands()[0].split("&&")[-1].strip()
    args = shlex.split(command)
    assert args[:3] == ["python", "-m", "trainer"]
    out = run_cli(args[3:], cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "workers: rank0=" in out.stdout and "rank7=" in out.stdout
    client, run = _finished_run(tmp_path)
    losses = [m.value for m in client.get_metric_history(run.info.run_id, "loss")]
    assert len(losses) == 10  # 100 steps, logged every 10
    assert losses[-1] < losses[0] - 1.0, losses
    assert run.data.params["parallel.pipeline.schedule"] == "1F1B"
    assert "config.yaml" in [a.path for a in client.list_artifacts(run.info.run_id)]
    # The pipeline timeline of the last steps (tracking.pictures), its bubble beside (p-1)/(m+p-1).
    _assert_pictures(client, run, out.stdout)
    assert run.data.metrics["pipeline_bubble_theory"] == pytest.approx(1 / 5)
    assert 0 < run.data.metrics["pipeline_bubble"] < 1


def test_plain_trainer_command_runs_one_device(tmp_path):
    out = run_cli([], cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "done: steps 1..100" in out.stdout
    client, run = _finished_run(tmp_path)
    losses = [m.value for m in client.get_metric_history(run.info.run_id, "loss")]
    assert len(losses) == 10 and losses[-1] < 3.5, losses
    _assert_pictures(client, run, out.stdout)  # one device: forward + backward and optimizer, no bubble
    assert "pipeline_bubble" not in run.data.metrics


def _assert_pictures(client, run, stdout: str) -> None:
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id, "pictures")) == [
        "pictures/placement.json", "pictures/placement.png", "pictures/timeline.json", "pictures/timeline.png"]
    assert "pictures: timeline " in stdout and "timeline.png" in stdout
    # the summary names where each picture is kept on disk
    for name, file in (("placement picture", "placement.png"), ("timeline picture", "timeline.png")):
        line = next(x for x in stdout.splitlines() if x.startswith(f"  {name}: "))
        assert line.endswith(file) and Path(line.split(": ", 1)[1]).is_file(), line
