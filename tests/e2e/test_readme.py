"""The README's commands, as a new user types them (the install part is what CI itself runs): the main
command in a fresh directory, then the commands that read what it left there, in the README's order."""

from __future__ import annotations

import concurrent.futures
import math
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.docs_text import blocks, readme, readme_blocks
from timing import scaled

MAIN = 'pip install torch==2.13.0 && pip install -e ".[hf]" && python -m trainer +parallel=3d mesh=[2,2,2]'
TESTS = 'pip install torch==2.13.0 && pip install -e ".[dev]" && python -m pytest -q'
CHECKPOINT = "checkpoints/step_00000100"  # the main run's final checkpoint (100 steps)


def test_readme_opens_with_install_and_run_commands():
    main, uses, tests, slow = readme_blocks()[:4]
    assert main == [MAIN]
    # right after it, the commands that use its output: export, then generate, both from its last checkpoint
    assert [shlex.split(line)[:4] for line in uses] == [["python", "-m", "trainer.export", CHECKPOINT],
                                                         ["python", "-m", "trainer.generate", CHECKPOINT]]
    assert tests == [TESTS]
    assert slow[0].startswith("python -m pytest -q -m slow")
    ci = (REPO / ".ci" / "run").read_text()
    assert TESTS in ci
    assert "python -m pytest -q -m slow" in ci.split(TESTS, 1)[1]  # CI's second pass, after the default run


def _user_run(tmp_path: Path, args: list[str], timeout: float):
    """``python -m trainer <args>`` in ``tmp_path/work`` as a user with the home ``tmp_path/home``:
    ``(output, MLflow client of the default store, the one run in it)``. The store is the user's
    (``$MESHFLOW_HOME/mlflow.db``), not the working directory's, and the summary's link says how to
    serve it there."""
    from mlflow.tracking import MlflowClient

    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    out, until_summary = _timed_cli(args, cwd=work, timeout=timeout, env={"MESHFLOW_HOME": str(home)})
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
    lines = out.stdout.splitlines()
    assert link in lines, out.stdout
    # the same link, with the command that serves it, once the run exists: the run is made while the workers
    # start (trainer.tracking.opening), so on a busy small host after the first steps, and before the summary
    assert lines.index(link.strip()) < next(i for i, line in enumerate(lines) if line.startswith("done: ")), out.stdout
    # the summary's wall time is the command's, from the process's start to the summary (the
    # interpreter's own exit after it, seconds on a busy host, is no part of it)
    wall = float(re.search(r"^  wall time ([\d.]+) s \|", out.stdout, re.M)[1])
    assert until_summary - scaled(1.0) <= wall <= until_summary + 0.05, (wall, until_summary)  # printed to 0.1 s
    return out, client, runs[0]


def _timed_cli(args: list[str], *, cwd: Path, timeout: float, env: dict) -> tuple[subprocess.CompletedProcess, float]:
    """``python -m trainer <args>`` (as :func:`tests.conftest.run_cli`), and the seconds from its start to
    the moment its summary's wall-time line is read."""
    began = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=cwd, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
    errors = concurrent.futures.ThreadPoolExecutor(1).submit(proc.stderr.read)  # a full stderr pipe would stall it
    hung = threading.Timer(scaled(timeout), proc.kill)  # a trainer that hangs without a word
    hung.start()
    lines, until_summary = [], math.inf
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("  wall time "):
            until_summary = time.monotonic() - began
    proc.wait()
    hung.cancel()
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(lines), errors.result()), until_summary


@pytest.mark.slow
def test_readme_main_command_trains_3d_and_logs_one_run(tmp_path):
    command = readme_blocks()[0][0].split("&&")[-1].strip()
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
    _readme_uses_the_checkpoint(tmp_path / "work", run, losses)


def _typed(line: str, cwd: Path) -> subprocess.CompletedProcess:
    """One README line, split as a shell splits it and run in ``cwd`` (``python`` is this interpreter);
    its output as UTF-8 text, newlines untranslated (a sampled carriage return is a byte like any other)."""
    args = shlex.split(line)
    assert args[:2] == ["python", "-m"], line
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONIOENCODING": "utf-8"}
    done = subprocess.run([sys.executable, *args[1:]], cwd=cwd, env=env, capture_output=True, timeout=scaled(300))
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode("utf-8"),
                                       done.stderr.decode("utf-8", errors="replace"))


def _readme_uses_the_checkpoint(cwd: Path, run, losses: list[float]) -> None:
    """The README's export and generate lines, exactly as printed and in its order, after its main command."""
    import transformers

    from trainer.export.weights import load_checkpoint_model

    export, generate = readme_blocks()[1]
    out = _typed(export, cwd)
    assert out.returncode == 0, out.stdout + out.stderr
    exported = cwd / shlex.split(export)[shlex.split(export).index("--out") + 1]
    assert {"config.json", "model.safetensors"} <= {p.name for p in exported.iterdir()}
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    params = run.data.params
    assert (hf.config.num_hidden_layers, hf.config.hidden_size, hf.config.vocab_size) == (
        int(params["model.n_layers"]), int(params["model.dim"]), int(params["model.vocab_size"]))
    # transformers computes the trained model's logits: those of the checkpoint the run left
    model, _, _ = load_checkpoint_model(cwd / CHECKPOINT)
    ids = torch.tensor([list(Path(os.__file__).read_bytes()[:128])])  # the default data: stdlib source, as bytes
    with torch.no_grad():
        ours, theirs = model.eval()(ids).float(), hf(ids).logits.float()
        loss = torch.nn.functional.cross_entropy(theirs[0, :-1], ids[0, 1:]).item()
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    assert loss < losses[0] - 1.0, (loss, losses)  # trained weights, not the initial ones

    # the README's python block after them: transformers loads the export, the text's bytes its ids
    snippet = blocks(readme(), "python")[0]
    loaded = subprocess.run([sys.executable, "-c", "\n".join(snippet)], cwd=cwd, capture_output=True, text=True,
                            timeout=scaled(300))
    assert loaded.returncode == 0 and loaded.stdout.startswith("The mesh"), loaded.stdout + loaded.stderr

    out = _typed(generate, cwd)
    assert out.returncode == 0, out.stdout + out.stderr
    args = shlex.split(generate)
    prompt, wanted = args[args.index("--prompt") + 1], int(args[args.index("--max-new-tokens") + 1])
    text = out.stdout.removesuffix("\n")  # print's newline; a sampled newline stays
    assert text.startswith(prompt), out.stdout
    sampled = text[len(prompt):]
    # byte-level tokens, decoded with errors="replace": each U+FFFD stands for 1 to 3 bytes that were no
    # whole UTF-8 character. The requested count, or fewer ending at the end-of-document byte (NUL).
    least = sum(1 if ch == "\ufffd" else len(ch.encode()) for ch in sampled)
    most = sum(3 if ch == "\ufffd" else len(ch.encode()) for ch in sampled)
    assert least <= wanted <= most or (sampled.endswith("\0") and least <= most < wanted), (least, most, text)


def test_plain_trainer_command_runs_one_device(tmp_path):
    """``python -m trainer`` with every default but the length (20 of its 100 steps: the 100-step
    learning curve is the README main command's, in the slow pass): one device, the user's MLflow
    store, pictures, the final checkpoint and its weights in the run."""
    out, client, run = _user_run(tmp_path, ["train.steps=20"], timeout=300)
    assert "done: steps 1..20" in out.stdout
    losses = [m.value for m in client.get_metric_history(run.info.run_id, "loss")]
    assert len(losses) == 2 and losses[-1] < losses[0] - 1.0, losses  # logged every 10 steps; 5.0 -> 3.8 here
    _assert_pictures(client, run, out.stdout)  # one device: forward + backward and optimizer, no bubble
    assert "pipeline_bubble" not in run.data.params and "pipeline_bubble" not in run.data.metrics
    # the final checkpoint (train.checkpoint.save_final) and its weights in the run
    assert (tmp_path / "work" / "checkpoints" / "step_00000020" / "COMPLETE").is_file()
    assert [a.path for a in client.list_artifacts(run.info.run_id, "model")] == ["model/hf", "model/model.safetensors"]


def _assert_pictures(client, run, stdout: str) -> None:
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id, "pictures")) == [
        "pictures/placement.json", "pictures/placement.png", "pictures/timeline.json", "pictures/timeline.png"]
    assert "pictures: timeline " in stdout and "timeline.png" in stdout
    # the summary names where each picture is kept on disk
    for name, file in (("placement picture", "placement.png"), ("timeline picture", "timeline.png")):
        line = next(x for x in stdout.splitlines() if x.startswith(f"  {name}: "))
        assert line.endswith(file) and Path(line.split(": ", 1)[1]).is_file(), line
