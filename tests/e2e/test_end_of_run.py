"""Nothing lost at the end of a run: a second run in the same directory leaves the first one's
checkpoints as they were (refused, with fixes that work as printed), and a failure after the last
step (here the final model's export) leaves the run's exit code its training's, reported in one line
and recorded on the MLflow run.

    python -m pytest tests/e2e/test_end_of_run.py -q

Launched in-process on one device (a tiny model, a few steps each): the launcher's own road.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainer.config.compose import compose_dict
from trainer.launch.launcher import launch
from trainer.launch.outcome import EXIT_CONFIG, EXIT_OK
from trainer.tracking.end_of_run import ERRORS_TAG
from trainer.validate.checks import validate_config

TINY = ["train.steps=2", "train.global_batch_size=2", "train.seq_len=16", "train.log_every=1", "data.max_bytes=20000",
        "model.n_layers=1", "model.dim=32", "model.n_heads=2", "model.n_kv_heads=2", "tracking.pictures=false",
        "train.print_config=false"]


def _launch(*overrides: str):
    return launch(validate_config(compose_dict([*TINY, *overrides])))


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_second_run_in_the_same_directory_leaves_the_first_runs_checkpoints(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert _launch("tracking=none").exit_code == EXIT_OK
    first = _files(tmp_path / "checkpoints")
    assert "step_00000002/COMPLETE" in first and any(name.endswith(".distcp") for name in first)
    capsys.readouterr()

    again = _launch("tracking=none", "optim.lr=0.01")  # another run, as docs/getting-started.md's next command
    err = capsys.readouterr().err
    assert again.exit_code == EXIT_CONFIG, err
    assert ("train.checkpoint.dir: 'checkpoints' already holds another run's checkpoints (step_00000002)" in err), err
    assert _files(tmp_path / "checkpoints") == first  # bytes equal: nothing replaced, nothing pruned

    fixes = re.findall(r"train\.checkpoint\.\w+=\S+?(?=[,)]|$)", err.split("(", 2)[-1])
    assert fixes == ["train.checkpoint.resume=auto", "train.checkpoint.dir=checkpoints-2"], err
    for fix in fixes:  # each fix, typed as printed, starts the run; the first run's files stay as they were
        assert _launch("tracking=none", "optim.lr=0.01", fix).exit_code == EXIT_OK, capsys.readouterr()
        assert _files(tmp_path / "checkpoints") == first
    assert (tmp_path / "checkpoints-2" / "step_00000002" / "COMPLETE").is_file()


def test_an_export_failure_after_the_last_step_is_reported_and_recorded_and_the_run_finishes(tmp_path, monkeypatch,
                                                                                             capsys):
    from mlflow.tracking import MlflowClient

    import trainer.run.final_model as final_model

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(final_model, "export_model", disk_full)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    outcome = _launch(f"tracking.tracking_uri={uri}", "tracking.system_metrics=false")
    out = capsys.readouterr().out
    assert outcome.exit_code == EXIT_OK, out
    error = "the final model (MLflow model/): OSError: [Errno 28] No space left on device"
    assert f"after training: {error} (the training itself finished)" in out.splitlines(), out
    assert f"  not done after training: {error}" in out.splitlines()  # the summary says it again
    assert "Traceback" not in out
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(outcome.run_id)
    assert run.info.status == "FINISHED" and run.data.tags[ERRORS_TAG] == error
    assert outcome.details["end_of_run_errors"] == [error] and len(outcome.losses) == 2
    assert client.list_artifacts(run.info.run_id, "model") == []

    # asked for explicitly (tracking.log_model=true): the same failure fails the run
    with pytest.raises(OSError, match="No space left"):
        _launch(f"tracking.tracking_uri={uri}", "tracking.system_metrics=false", "tracking.log_model=true",
                "train.checkpoint.dir=again")
    failed = [r for r in client.search_runs([run.info.experiment_id]) if r.info.run_id != run.info.run_id]
    assert [r.info.status for r in failed] == ["FAILED"]


def test_the_final_model_is_logged_as_safetensors_and_a_hugging_face_directory(tmp_path, monkeypatch):
    """Gathered in the run (no checkpoint read: save_final off), the weights equal the trained model's."""
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    import trainer.run.final_model as final_model

    trained = {}
    gather = final_model.full_state_on_rank0
    monkeypatch.setattr(final_model, "full_state_on_rank0",
                        lambda module: trained.update(module.state_dict()) or gather(module))
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    outcome = _launch(f"tracking.tracking_uri={uri}", "tracking.system_metrics=false",
                      "train.checkpoint.save_final=false")
    assert outcome.exit_code == EXIT_OK and not (tmp_path / "checkpoints").exists()
    client = MlflowClient(tracking_uri=uri)
    assert sorted(a.path for a in client.list_artifacts(outcome.run_id, "model/hf")) == [
        "model/hf/config.json", "model/hf/model.safetensors"]
    weights = load_file(client.download_artifacts(outcome.run_id, "model/model.safetensors", str(tmp_path)))
    assert weights.keys() == trained.keys() and all(weights[k].equal(v) for k, v in trained.items())
