"""The one rule for a REST job's paths (service.confine): relative, no `..`, real path inside the job's
workdir or the workspace's read-only datasets/ and models/ areas.

    python -m pytest tests/unit/test_confine.py -q
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.confine import confine_glob, confine_path
from service.submit import confine


@pytest.fixture
def workspace(tmp_path) -> Path:
    ws = tmp_path / "ws"
    for folder in ("datasets/corpus", "models", "jobs/mine", "jobs/other"):
        (ws / folder).mkdir(parents=True)
    (ws / "meshflow.db").write_text("the job store")
    (ws / "datasets" / "to-store").symlink_to(ws)             # an operator's careless link
    (ws / "jobs" / "mine" / "escape").symlink_to(ws / "jobs" / "other")
    (ws / "models" / "init.safetensors").symlink_to(ws / "meshflow.db")  # a file link out of models/
    return ws


CASES = [  # (value, read_only_ok, "=" + where it resolves in the workspace, or a word of the refusal)
    ("checkpoints", False, "=jobs/mine/checkpoints"),
    (".", True, "=jobs/mine"),
    ("datasets/corpus", True, "=datasets/corpus"),
    ("models/tiny.safetensors", True, "=models/tiny.safetensors"),
    ("datasets/corpus", False, "=jobs/mine/datasets/corpus"),   # outputs never go to the read-only areas
    ("/etc/shadow", True, "absolute"),
    ("~/.ssh/id_rsa", True, "absolute"),
    ("../other/job.log", True, "`..`"),
    ("../../meshflow.db", True, "`..`"),
    ("datasets/../meshflow.db", True, "`..`"),
    ("datasets/to-store/meshflow.db", True, "symbolic link"),
    ("escape/job.log", True, "symbolic link"),
    ("models/init.safetensors", True, "symbolic link"),
]


@pytest.mark.parametrize("value, read_only_ok, expected", CASES, ids=[f"{v}-{r}" for v, r, _ in CASES])
def test_the_path_rule(workspace, value, read_only_ok, expected):
    resolved, issue = confine_path(value, "train.init_from", workspace=workspace, workdir=workspace / "jobs" / "mine",
                                   read_only_ok=read_only_ok)
    if expected.startswith("="):
        assert issue is None and resolved == os.path.realpath(workspace / expected[1:])
    else:
        assert resolved is None and issue.path == "train.init_from" and expected in issue.reason
        assert "relative path" in issue.fix


def test_globs_stay_in_their_area(workspace):
    common = dict(workspace=workspace, workdir=workspace / "jobs" / "mine")
    (workspace / "datasets" / "corpus" / "a.txt").write_text("a")
    assert confine_glob("datasets/corpus/*.txt", "data.paths[0]", **common)[1] is None
    assert "symbolic link" in confine_glob("datasets/*/meshflow.db*", "data.paths[0]", **common)[1].reason
    assert "`..`" in confine_glob("datasets/**/../../meshflow.db", "data.paths[0]", **common)[1].reason


def test_confine_refuses_every_path_field_and_never_keeps_a_refused_init_from(workspace):
    raw = {"train": {"init_from": "/etc/shadow", "checkpoint": {"dir": "../other", "resume": "/tmp/x"}},
           "data": {"kind": "text", "root": "../other", "glob": "meshflow.db*"},
           "model": {"arch": "hf", "path": "/srv/models"}, "launch": {"log_dir": "../../"}}
    out, issues = confine(raw, workspace=workspace, workdir=workspace / "jobs" / "mine", tracking_uri="sqlite://",
                          run_id=None)
    assert {i.path for i in issues} == {"train.init_from", "train.checkpoint.dir", "train.checkpoint.resume",
                                        "data.root", "model.path", "launch.log_dir"}
    assert out["train"]["init_from"] is None  # the validator would ask the filesystem about it
    linked = {"train": {"init_from": "models/init.safetensors"}}  # a link in the models/ area to the job store
    out, issues = confine(linked, workspace=workspace, workdir=workspace / "jobs" / "mine", tracking_uri="sqlite://",
                          run_id=None)
    assert [i.path for i in issues] == ["train.init_from"] and "symbolic link" in issues[0].reason
    assert out["train"]["init_from"] is None
    glob_only = {"data": {"kind": "text", "root": "datasets/corpus", "glob": "../../meshflow.db*"}}
    _, issues = confine(glob_only, workspace=workspace, workdir=workspace / "jobs" / "mine", tracking_uri="sqlite://",
                        run_id=None)
    assert [i.path for i in issues] == ["data.glob"]


def test_chat_data_paths_tokenizer_and_template_file_are_confined(workspace):
    (workspace / "datasets" / "corpus" / "chats.jsonl").write_text("{}")
    common = dict(workspace=workspace, workdir=workspace / "jobs" / "mine", tracking_uri="sqlite://", run_id=None)
    raw = {"data": {"kind": "chat", "paths": ["/etc/*.conf"], "val_paths": ["../other/*.jsonl"],
                    "tokenizer": "/srv/tok", "template": "/etc/passwd"}}
    _, issues = confine(raw, **common)
    assert {i.path for i in issues} == {"data.paths[0]", "data.val_paths[0]", "data.tokenizer", "data.template"}
    fine = {"data": {"kind": "chat", "paths": ["datasets/corpus/*.jsonl"], "template": "chatml"}}
    out, issues = confine(fine, **common)
    assert issues == [] and out["data"]["template"] == "chatml" and "cache_dir" not in out["data"]
    assert out["data"]["paths"] == [os.path.realpath(workspace / "datasets" / "corpus") + "/*.jsonl"]
