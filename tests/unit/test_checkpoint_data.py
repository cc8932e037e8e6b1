"""A checkpoint is data: the code it names is never imported, the files it names outside itself never
copied, unless the user names them on the command line (``--builder``, ``--tokenizer``).

Run: ``python -m pytest tests/unit/test_checkpoint_data.py -q``
"""

from __future__ import annotations

import json
import shlex
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer.checkpoint.dcp import read_extra, save_checkpoint
from trainer.checkpoint.extra_state import serialize, write_extra_state
from trainer.export.generate import main as generate_main
from trainer.export.weights import main as export_main

NET = textwrap.dedent('''
    from torch import nn


    def build(vocab=64, width=8):
        return nn.Sequential(nn.Embedding(vocab, width), nn.Linear(width, vocab))
''')


@pytest.fixture
def custom_checkpoint(tmp_path, monkeypatch):
    """A custom model's checkpoint (builder ``meshflow_test_net:build``), as a run saves it."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "meshflow_test_net.py").write_text(NET)
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    sys.modules.pop("meshflow_test_net", None)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64))
    config = {"arch": "custom", "builder": "meshflow_test_net:build", "kwargs": {"vocab": 64, "width": 8}}
    path = save_checkpoint(tmp_path / "ckpt", 1, model=model, optimizer=torch.optim.AdamW(model.parameters()),
                           extra={"step": 1, "model_config": config}, keep=1)
    return path, model


def _rewrite_extra(path: Path, **changes) -> None:
    extra = read_extra(path)
    extra.update(changes)
    write_extra_state(path, serialize(extra))


def test_a_checkpoint_naming_os_system_runs_nothing(custom_checkpoint, tmp_path, capsys):
    path, _ = custom_checkpoint
    marker = tmp_path / "pwned"
    _rewrite_extra(path, model_config={"arch": "custom", "builder": "os:system",
                                       "kwargs": {"command": f"touch {shlex.quote(str(marker))}"}})
    assert export_main([str(path), "--out", str(tmp_path / "x.safetensors")]) == 2
    assert generate_main([str(path), "--prompt", "hello"]) == 2
    assert not marker.exists(), "the checkpoint's builder ran"
    errors = [line for line in capsys.readouterr().err.splitlines() if " failed: " in line]
    assert len(errors) == 2, errors
    for error in errors:
        assert "names the model builder 'os:system'" in error and "--builder os:system" in error, error
    assert not (tmp_path / "x.safetensors").exists()


def test_the_user_names_the_builder_on_the_command_line(custom_checkpoint, tmp_path, capsys):
    path, model = custom_checkpoint
    assert export_main([str(path), "--out", str(tmp_path / "refused.safetensors")]) == 2
    assert "--builder meshflow_test_net:build" in capsys.readouterr().err
    assert export_main([str(path), "--out", str(tmp_path / "x.safetensors"), "--builder",
                        "meshflow_test_net:build"]) == 0
    exported = load_file(str(tmp_path / "x.safetensors"))
    assert set(exported) == {"0.weight", "1.weight", "1.bias"}
    assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items())
    assert json.loads(_header(tmp_path / "x.safetensors")["model_config"])["builder"] == "meshflow_test_net:build"


def _header(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata()
