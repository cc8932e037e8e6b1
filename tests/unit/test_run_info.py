"""What a run tells MLflow: names, tags, readable params, redaction, the UI link, the summary.

Run: ``pytest tests/unit/test_run_info.py -q`` (no MLflow store, no process).
"""

from __future__ import annotations

import json

import pytest

from trainer.config.compose import compose_dict
from trainer.config.schema import RunConfig
from trainer.tracking.mlflow_tracker import readable_params
from trainer.tracking.run_info import MASK, public_config, redact, run_name, run_tags, run_url, ui_command
from trainer.tracking.run_record import dataset_identity, log_lines, summary
from trainer.tracking.tracker import NullTracker


def _cfg(*overrides: str) -> RunConfig:
    return RunConfig.model_validate(compose_dict(list(overrides)))


def test_urls_lose_their_credentials():
    assert redact("postgresql://meshflow:hunter2@db:5432/mlflow") == "postgresql://***@db:5432/mlflow"
    assert redact("https://token@mlflow.example.com/x and http://u:p@h") == "https://***@mlflow.example.com/x and http://***@h"
    assert redact("sqlite:///mlflow.db") == "sqlite:///mlflow.db"  # nothing to hide


def test_public_config_never_holds_the_tracking_uri_or_a_secret():
    uri = "postgresql://meshflow:hunter2@db:5432/mlflow"
    raw = {"tracking": {"tracking_uri": uri, "run_id": "abc", "experiment": "x",
                        "tags": {"hf_token": "hf_abcdef", "team": "nlp"}},
           "model": {"path": "https://user:pw@host/models/llama", "api_key": "sk-123"},
           "data": {"paths": ["s3://key:secret@bucket/a.jsonl"]}}
    public = public_config(raw)
    text = json.dumps(public)
    for secret in ("hunter2", "hf_abcdef", "sk-123", ":pw@", "secret@", "abc"):
        assert secret not in text, secret
    assert "tracking_uri" not in public["tracking"] and "run_id" not in public["tracking"]
    assert public["tracking"]["tags"] == {"hf_token": MASK, "team": "nlp"}
    assert public["model"] == {"path": "https://***@host/models/llama", "api_key": MASK}
    assert public["data"]["paths"] == ["s3://***@bucket/a.jsonl"]


def test_counts_and_text_tokens_are_shown_secrets_stay_masked():
    raw = compose_dict(["data=synthetic", "data.num_tokens=4096"])
    public = public_config(RunConfig.model_validate(raw).model_dump(mode="json"))
    assert public["data"]["num_tokens"] == 4096  # a count of tokens, not a credential (it was "***")
    tags = {"eos_token": "</s>", "pad_token_id": 0, "max_tokens_per_s": 9.5, "tokenizer": "models/tok", "author": "ann",
            "hf_token": "hf_abc", "HF_TOKEN": "hf_def", "apiKey": "k1", "AWS_SECRET_ACCESS_KEY": "k2",
            "db_password": "pw", "auth": "basic x", "access_key": "k3"}
    shown = public_config({"t": tags})["t"]
    assert {k: v for k, v in shown.items() if v != MASK} == {k: tags[k] for k in list(tags)[:5]}
    assert [k for k, v in shown.items() if v == MASK] == list(tags)[5:]


def test_params_are_readable_globs_stay_one_json_value():
    raw = compose_dict(["+parallel=3d", "mesh=[2,2,2]"])
    raw["parallel"]["placements"] = {"layers.*.attn.w[qkv].weight": {"tp": "Shard(0)"}}
    cfg = RunConfig.model_validate(raw)
    params = readable_params(public_config(cfg.model_dump(mode="json")))
    assert json.loads(params["parallel.placements"]) == {"layers.*.attn.w[qkv].weight": {"tp": "Shard(0)"}}
    assert params["parallel.pipeline.schedule"] == "1F1B" and params["mesh"] == "[2, 2, 2]"
    assert params["parallel.dims"] == '["dp", "pp", "tp"]'
    assert not any("_.attn" in key for key in params)  # no mangled glob keys
    assert not any("tracking_uri" in key for key in params)


@pytest.mark.parametrize(("overrides", "name", "preset"), [
    ((), "single-1", "single"),
    (("+parallel=3d", "mesh=[2,2,2]"), "3d-2x2x2", "3d"),
    (("+examples=unordered_rank_ids",), "unordered_rank_ids-2x3", "unordered_rank_ids"),
    (("+parallel=fsdp", "mesh=[4]", "tracking.run_name=mine"), "mine", "fsdp"),
])
def test_run_name_and_tags_come_from_preset_and_mesh(overrides, name, preset):
    cfg = _cfg(*overrides)
    assert run_name(cfg) == name
    tags = run_tags(cfg)
    assert tags["preset"] == preset and tags["world_size"] == str(cfg.world_size)
    assert json.loads(tags["mesh"]) == (cfg.mesh if cfg.mesh is not None else [1])
    assert tags["precision"] == "fp32" and tags["model"] == cfg.model.arch and tags["user"] and tags["host"]
    assert tags["mlflow.user"] == tags["user"]
    assert "git_commit" not in tags or len(tags["git_commit"].removesuffix("-dirty")) == 40


def test_sweep_jobs_are_numbered_and_children_of_the_parent(monkeypatch):
    monkeypatch.setenv("MESHFLOW_SWEEP_PARENT_RUN", "parent123")
    cfg = _cfg("+tracking.tags.sweep_job=1")
    assert run_name(cfg) == "single-1-job1"
    assert run_tags(cfg)["mlflow.parentRunId"] == "parent123"


def test_run_url_points_at_the_server_or_the_local_ui(tmp_path, monkeypatch):
    view = "?workflowType=machine_learning"  # MLflow 3.17's model-training view, whatever the browser chose last
    assert run_url("http://127.0.0.1:5005", "3", "ab") == f"http://127.0.0.1:5005/#/experiments/3/runs/ab{view}"
    # a link carries no credentials, and works where the browser signs in
    assert run_url("https://u:p@mlflow.example.com/", "3",
                   "ab") == f"https://mlflow.example.com/#/experiments/3/runs/ab{view}"
    assert run_url("sqlite:///mlflow.db", "3", "ab") == f"http://127.0.0.1:5000/#/experiments/3/runs/ab{view}"
    assert run_url("sqlite:///mlflow.db", None, "ab") is None
    # the store's command serves it where its links point (the port is the link's), from any directory
    monkeypatch.chdir(tmp_path)
    assert ui_command("sqlite:///x.db") == f"mlflow ui --backend-store-uri sqlite:///{tmp_path}/x.db --port 5000"
    assert (ui_command("sqlite:////srv/x.db?timeout=20")
            == "mlflow ui --backend-store-uri 'sqlite:////srv/x.db?timeout=20' --port 5000")
    assert ui_command("sqlite:////home/a b/.meshflow/mlflow.db") == \
        "mlflow ui --backend-store-uri 'sqlite:////home/a b/.meshflow/mlflow.db' --port 5000"
    assert ui_command("http://h:5000") is None


def test_tracking_ui_url_makes_every_link_and_the_serve_command():
    ui, x = "http://127.0.0.1:5055/", "sqlite:////srv/x.db"
    assert run_url(x, "3", "ab", ui) == "http://127.0.0.1:5055/#/experiments/3/runs/ab?workflowType=machine_learning"
    assert ui_command(x, ui) == "mlflow ui --backend-store-uri sqlite:////srv/x.db --port 5055"
    assert ui_command(x, "https://mlflow.example.com") == "mlflow ui --backend-store-uri sqlite:////srv/x.db"
    # a server reached at one address and shown at another (a port-forward): the link is the UI's
    assert run_url("http://mlflow:5000", "3", "ab", "http://localhost:5000").startswith("http://localhost:5000/#/")
    assert ui_command("http://mlflow:5000", "http://localhost:5000") is None
    cfg = _cfg("train.seq_len=8", "train.global_batch_size=2", f"tracking.tracking_uri={x}",
               f"tracking.ui_url={ui}")
    tracker = type("Run", (), {"run_id": "ab", "experiment_id": "3"})()
    text = summary(cfg, {"losses": [3.0], "step_times": [1.0], "tokens_per_step": 16}, tracker, wall_s=1.0)
    assert ("  mlflow run: http://127.0.0.1:5055/#/experiments/3/runs/ab?workflowType=machine_learning  "
            "(serve it: mlflow ui --backend-store-uri sqlite:////srv/x.db --port 5055)") in text.splitlines()


def test_the_default_store_is_the_users_not_the_working_directorys(monkeypatch, tmp_path):
    from trainer.config.tracking_schema import default_tracking_uri, meshflow_home

    monkeypatch.setenv("MESHFLOW_HOME", str(tmp_path / "mf"))
    assert default_tracking_uri() == f"sqlite:///{tmp_path}/mf/mlflow.db"
    assert _cfg().tracking.tracking_uri == f"sqlite:///{tmp_path}/mf/mlflow.db"  # what a composed run gets
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MESHFLOW_HOME", "rel")  # made absolute: the same store from every directory
    assert meshflow_home() == tmp_path / "rel"
    monkeypatch.delenv("MESHFLOW_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "alice"))
    assert default_tracking_uri() == f"sqlite:///{tmp_path}/alice/.meshflow/mlflow.db"
    # a store of one's own stays one override away, as the dashboards' command names it
    assert _cfg("tracking.tracking_uri=sqlite:///mlflow.db").tracking.tracking_uri == "sqlite:///mlflow.db"
    assert not (tmp_path / "alice").exists() and not (tmp_path / "rel").exists()  # composing writes nothing


def test_dataset_identity_names_source_and_digest(tmp_path):
    (tmp_path / "corpus").mkdir()
    files = _cfg("data=files", f"data.paths=[{tmp_path}/corpus/*.txt]")
    name, source, digest = dataset_identity(files)
    assert source == str(tmp_path / "corpus") and name.startswith("files:") and len(digest) == 16
    synthetic = _cfg("data=synthetic")
    assert dataset_identity(synthetic)[1] is None  # generated in code
    assert dataset_identity(synthetic)[2] != dataset_identity(_cfg("data=synthetic", "data.seed=7"))[2]


def test_summary_reports_time_speed_best_loss_and_where_things_are(tmp_path):
    cfg = _cfg("train.seq_len=8", "train.global_batch_size=2")
    ranks = tmp_path / "attempt_0"
    for rank in (0, 1):
        for name in ("stdout.log", "stderr.log"):
            (ranks / str(rank)).mkdir(parents=True, exist_ok=True)
            (ranks / str(rank) / name).write_text("")
    outcome = {"losses": [3.0, 2.0, 2.5], "first_step": 4, "val_loss": None, "step_times": [9.0, 0.5, 0.25],
               "tokens_per_step": 16, "last_checkpoint": "/ck/step_7", "pictures": {"timeline": "/p/timeline.png"},
               "last_window": {"first": 6, "last": 7, "loss": 2.25, "tokens_per_s": 42.67}}
    text = summary(cfg, outcome, NullTracker(), wall_s=12.34, log_dir=tmp_path)
    lines = text.splitlines()
    assert lines[0] == "done: steps 5..7, loss 3.0000 -> 2.5000 (single steps)"
    assert lines[1] == "  wall time 12.3 s | final loss 2.5000 | best 2.0000 at step 6"
    # the whole run's mean (2 * 16 tokens / 0.75 s, the first step left out) beside the last step line's numbers
    assert lines[2] == ("  mean 43 tok/s over steps 6-7 (step 5 left out: start-up) | "
                        "last step line (steps 6-7): loss 2.2500, 43 tok/s")
    assert "  last checkpoint: /ck/step_7" in lines
    assert (f"  logs: {ranks}/ holds a folder per rank, 0..1, each with stderr.log, stdout.log; "
            f"rank 0: {ranks}/0/stdout.log") in lines
    assert "  timeline: /p/timeline.png" in lines


def test_the_log_lines_name_paths_that_exist(tmp_path):
    """One device: its one log file; a restarted run: the last attempt, saying so; no placeholders."""
    one = tmp_path / "one"
    (one / "attempt_0" / "0").mkdir(parents=True)
    (one / "attempt_0" / "0" / "stdout.log").write_text("x")
    assert log_lines(one) == [f"  log: {one}/attempt_0/0/stdout.log"]
    restarted = tmp_path / "restarted"
    for attempt in (0, 1, 10):
        for rank in (0, 1, 2):
            (restarted / f"attempt_{attempt}" / str(rank)).mkdir(parents=True)
            (restarted / f"attempt_{attempt}" / str(rank) / "stdout.log").write_text("")
    (line,) = log_lines(restarted)
    assert line == (f"  logs: {restarted}/attempt_10/ (the last of 3 attempts) holds a folder per rank, "
                    "0..2, each with "
                    f"stdout.log; rank 0: {restarted}/attempt_10/0/stdout.log")
    assert "<" not in line


def test_the_config_s_tags_never_replace_the_reserved_ones():
    """On the CLI a user's mlflow.* tag cannot replace the trainer's own; in a run the control plane made
    for the job (tracking.run_id) no reserved tag comes from the config, and mlflow.user stays its creator's."""
    hostile = "+tracking.tags={meshflow.owner: bob, meshflow.job_id: not-mine, mlflow.user: bob, team: nlp}"
    own = run_tags(_cfg(hostile))
    assert own["mlflow.user"] == own["user"] != "bob" and own["team"] == "nlp"
    assert own["meshflow.owner"] == "bob"  # the user's own store: a tag like any other
    served = run_tags(_cfg(hostile, "tracking.run_id=abc123"))
    assert not any(key.startswith(("meshflow.", "mlflow.user")) for key in served), served
    assert served["team"] == "nlp" and served["mlflow.source.name"] == "python -m trainer"
