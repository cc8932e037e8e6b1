"""What lands in MLflow from the CLI: sweeps as parent + children, and never a secret.

    pytest tests/e2e/test_mlflow_runs.py -q

A 2-value ``--multirun`` makes one parent run with 2 children carrying their own params; an
Optuna sweep (Hydra's sweeper plugin) does the same with the values Optuna picked; a failing
job fails the sweep and the process. A run whose tracking store sits in a folder with a
"secret" name, and whose tags and data path hold a token and URL credentials, shows none of
them in any param, tag or config artifact.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.conftest import run_cli

pytestmark = pytest.mark.slow

TINY = ("train.steps=2", "train.global_batch_size=2", "train.seq_len=16", "train.log_every=1",
        "data.max_bytes=20000", "model.n_layers=1", "model.dim=32", "model.n_heads=2", "model.n_kv_heads=2",
        "tracking.system_metrics_interval=1")


def _runs(uri: str) -> list:
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("meshflow")
    assert experiment is not None, "no run was logged"
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # the model-training view
    return client.search_runs([experiment.experiment_id])


def _sweep(tmp_path, *args: str):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = run_cli(["--multirun", *TINY, *args, f"tracking.tracking_uri={uri}"], cwd=tmp_path, timeout=600)
    runs = _runs(uri)
    parents = [r for r in runs if r.data.tags.get("meshflow.sweep") == "parent"]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return proc, parents, children


def test_a_two_value_multirun_is_one_parent_with_two_children(tmp_path):
    proc, parents, children = _sweep(tmp_path, "optim.lr=1e-3,3e-3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("done: steps 1..2") == 2  # both jobs ran, not only the first
    (parent,) = parents
    assert parent.info.status == "FINISHED" and len(children) == 2
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parent.info.run_id}
    assert sorted(c.data.params["optim.lr"] for c in children) == ["0.001", "0.003"]
    assert sorted(c.info.run_name for c in children) == ["single-1-job0", "single-1-job1"]
    assert all(c.info.status == "FINISHED" for c in children)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    jobs = json.loads(Path(client.download_artifacts(parent.info.run_id, "sweep.json", str(tmp_path))).read_text())
    finals = {job["run_id"]: job["final_loss"] for job in jobs}
    for child in children:  # the parent's table holds each child's last logged loss
        history = client.get_metric_history(child.info.run_id, "loss")
        assert finals[child.info.run_id] == pytest.approx(max(history, key=lambda m: m.step).value)
    assert parent.data.metrics["best_final_loss"] == pytest.approx(min(finals.values()))
    # the console's table: each child's run ID beside its final loss, and the winner's run link
    for child in children:
        (row,) = [line.split() for line in proc.stdout.splitlines() if child.info.run_id in line.split()]
        assert float(row[1]) == pytest.approx(finals[child.info.run_id], abs=1e-4)
    best = min(finals, key=finals.get)
    (winner,) = [line for line in proc.stdout.splitlines() if line.startswith("sweep: best job ")]
    assert f"final loss {finals[best]:.4f}, the lowest of 2; run http" in winner and best in winner
    for child in children:  # system metrics, the data as an input, the plan and the job log
        assert any(key.startswith("system/cpu_utilization") for key in child.data.metrics)
        assert child.inputs.dataset_inputs and child.inputs.dataset_inputs[0].dataset.name.startswith("text:")
        artifacts = {a.path for a in client.list_artifacts(child.info.run_id)}
        assert {"config.yaml", "config_changes.yaml", "plan.txt", "logs"} <= artifacts, artifacts


def test_an_optuna_sweep_runs_its_trials_as_children(tmp_path):
    proc, parents, children = _sweep(tmp_path, "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2",
                                     "hydra.sweeper.sampler.seed=0", "optim.lr=interval(1e-4,1e-2)")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (parent,) = parents
    assert parent.data.tags["sweeper"] == "optuna" and len(children) == 2
    lrs = [float(c.data.params["optim.lr"]) for c in children]
    assert all(1e-4 <= lr <= 1e-2 for lr in lrs) and lrs[0] != lrs[1]  # values Optuna chose
    # Optuna minimised what the jobs returned: their final losses, as the parent run has them too
    # the sweep's files in its own folder (hydra.sweep.dir), where the next sweep does not overwrite them
    assert not (tmp_path / "optimization_results.yaml").exists()
    (sweep_dir,) = (tmp_path / "multirun").iterdir()
    result = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert f"its files (optimization_results.yaml) go to multirun/{sweep_dir.name}" in proc.stdout
    assert proc.stdout.count("sweep: job ") == 2
    assert f"final loss {result['best_value']:.4f} (Optuna's objective)" in proc.stdout
    assert result["best_value"] == pytest.approx(parent.data.metrics["best_final_loss"])
    assert result["best_params"]["optim.lr"] == pytest.approx(lrs[[c.data.metrics["loss"] for c in children].index(
        min(c.data.metrics["loss"] for c in children))])


def test_a_failing_job_fails_the_sweep_but_the_others_run(tmp_path):
    proc, parents, children = _sweep(tmp_path, "+parallel=dp", "mesh=[2],[3]")
    # a batch of 2 does not split over 3 ranks: that job is refused, the other one trains
    assert proc.returncode != 0
    assert proc.stdout.count("done: steps 1..2") == 1, proc.stdout[-3000:]
    (parent,) = parents
    assert parent.info.status == "FAILED" and len(children) == 1


def test_no_param_tag_or_config_artifact_holds_a_secret(tmp_path):
    store = tmp_path / "vault-4f1b9"
    store.mkdir()
    uri = f"sqlite:///{store / 'mlflow.db'}"
    proc = run_cli([*TINY, f"tracking.tracking_uri={uri}", "+tracking.tags.api_token=tok-77ab",
                    "+tracking.tags.origin=https://alice:pw-9c2e@example.com/repo", "train.checkpoint.save_final=true"],
                   cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run,) = _runs(uri)
    client = MlflowClient(tracking_uri=uri)
    config = Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))).read_text()
    shown = json.dumps(run.data.params) + json.dumps(run.data.tags) + config
    for secret in (uri, "vault-4f1b9", "tok-77ab", "pw-9c2e"):
        assert secret not in shown, secret
    assert run.data.tags["origin"] == "https://***@example.com/repo" and run.data.tags["api_token"] == "***"
    assert run.data.tags["preset"] == "single" and run.info.run_name == "single-1"
    # with a checkpoint, the final weights are in the run: the same tensors as the checkpoint's model
    from safetensors.torch import load_file

    from trainer.export.weights import load_checkpoint_model

    weights = load_file(client.download_artifacts(run.info.run_id, "model/model.safetensors", str(tmp_path)))
    model, _, _ = load_checkpoint_model(tmp_path / "checkpoints" / "step_00000002")
    assert weights.keys() == model.state_dict().keys()
    assert all(weights[k].equal(v) for k, v in model.state_dict().items())
