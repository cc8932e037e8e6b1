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


def _user_run(tmp_path: Path, args: list[str], timeout: float):
    """``python -m trainer <args>`` in ``tmp_path/work`` as a user with the home ``tmp_path/home``:
    ``(output, MLflow client of the default store, the one run in it)``. The store is the user's
    (``$MESHFLOW_HOME/mlflow.db``), not the working directory's, and the summary's link says how to
    serve it there."""
    from mlflow.tracking import MlflowClient

    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    out = run_cli(args, cwd=work, timeout=timeout, env={"MESHFLOW_HOME": str(home)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert not (work / "mlflow.db").exists() and not (work / "mlruns").exists()
    uri = f"sqlite:///{home}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("meshflow")
    assert experiment.artifact_location == (home / "mlartifacts" / "meshflow").as_uri()
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.status for r in runs] == ["FINISHED"]
    link = (f"  mlflow run: http://127.0.0.1:5000/#/experiments/{experiment.experiment_id}/runs/{runs[0].info.run_id}"
            f"?workflowType=machine_learning  (serve it: mlflow ui --backend-store-uri {uri} --port 5000)")
    assert link in out.stdout.splitlines(), out.stdout
    return out, client, runs[0]


@pytest.mark.slow
def test_readme_main_command_trains_3d_and_logs_one_run(tmp_path):
    command = _readme_commands()[0].split("&&")[-1].strip()
    args = shlex.split(command)
    assert args[:3] == ["python", "-m", "trainer"]
    out, client, run = _user_run(tmp_path, args[3:], timeout=900)
    assert "workers: rank0=" in out.stdout and "rank7=" in out.stdout
    losses = [m.value for m in client.get_metric_history(run.info.run_id, "loss")]
    assert len(losses) == 10  # 100 steps, logged every 10
    assert losses[-1] < losses[0] - 1.0, losses
    assert run.data.params["parallel.pipeline.schedule"] == "1F1B"
    assert {"config.yaml", "model"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    # The pipeline timeline of the last steps (tracking.pictures), its bubble beside (p-1)/(m+p-1):
    # numbers of the run, in its overview's params, not one-point charts.
    _assert_pictures(client, run, out.stdout)
    assert float(run.data.params["pipeline_bubble_theory"]) == pytest.approx(1 / 5)
    assert 0 < float(run.data.params["pipeline_bubble"]) < 1
    assert float(run.data.params["predicted_peak_memory_mb"]) > 0
    assert not {"pipeline_bubble", "predicted_peak_memory_mb", "checkpoint_seconds"} & set(run.data.metrics)
    # The README's next commands read the checkpoint the run left.
    _export_and_generate(tmp_path / "work", "checkpoints/step_00000100")


def _export_and_generate(cwd: Path, checkpoint: str) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    exported = subprocess.run([sys.executable, "-m", "trainer.export", checkpoint, "--format", "hf", "--out", "exported/"],
                              cwd=cwd, env=env, capture_output=True, text=True)
    assert exported.returncode == 0, exported.stderr
    assert {"config.json", "model.safetensors"} <= {p.name for p in (cwd / "exported").iterdir()}
    generated = subprocess.run([sys.executable, "-m", "trainer.generate", checkpoint, "--prompt", "The mesh",
                                "--max-new-tokens", "60", "--temperature", "0.8", "--top-k", "40"],
                               cwd=cwd, env=env, capture_output=True, text=True)
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.startswith("The mesh") and len(generated.stdout.encode()) > len("The mesh")


def test_plain_trainer_command_runs_one_device(tmp_path):
    out, client, run = _user_run(tmp_path, [], timeout=600)
    assert "done: steps 1..100" in out.stdout
    losses = [m.value for m in client.get_metric_history(run.info.run_id, "loss")]
    assert len(losses) == 10 and losses[-1] < 3.5, losses
    _assert_pictures(client, run, out.stdout)  # one device: forward + backward and optimizer, no bubble
    assert "pipeline_bubble" not in run.data.params and "pipeline_bubble" not in run.data.metrics
    # the final checkpoint (train.checkpoint.save_final) and its weights in the run
    assert (tmp_path / "work" / "checkpoints" / "step_00000100" / "COMPLETE").is_file()
    assert [a.path for a in client.list_artifacts(run.info.run_id, "model")] == ["model/model.safetensors"]


def _assert_pictures(client, run, stdout: str) -> None:
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id, "pictures")) == [
        "pictures/placement.json", "pictures/placement.png", "pictures/timeline.json", "pictures/timeline.png"]
    assert "pictures: timeline " in stdout and "timeline.png" in stdout
    # the summary names where each picture is kept on disk
    for name, file in (("placement picture", "placement.png"), ("timeline picture", "timeline.png")):
        line = next(x for x in stdout.splitlines() if x.startswith(f"  {name}: "))
        assert line.endswith(file) and Path(line.split(": ", 1)[1]).is_file(), line
