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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Hugging Face model directory as an instruction-tuned model ships: tokenizer, its chat template
    in chat_template.jinja (not tokenizer_config.json), generation_config.json, special_tokens_map.json."""
    from tests.hf_assets import CHATML, write_chat_tokenizer, write_tiny_llama

    path = tmp_path_factory.mktemp("smol")
    write_tiny_llama(path, vocab_size=256)
    write_chat_tokenizer(path, vocab_size=256)
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text(CHATML)
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "</s>"}))
    assert (path / "generation_config.json").is_file()
    return path


def _hf_checkpoint(tmp_path: Path, model_dir: Path, *, lora: bool = False, **data) -> Path:
    """A fine-tune's checkpoint of the model in ``model_dir`` (values moved off the pretrained ones)."""
    from pydantic import TypeAdapter

    from trainer.config.schema import ModelConfig
    from trainer.models import build_model

    config = {"arch": "hf", "path": str(model_dir), **({"lora": {"rank": 4}} if lora else {})}
    model = build_model(TypeAdapter(ModelConfig).validate_python(config), seed=0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.01)
    return save_checkpoint(tmp_path / "ckpt", 3, model=model, optimizer=torch.optim.AdamW(model.parameters()),
                           extra={"step": 3, "model_config": config, "data_config": {"kind": "chat", **data}}, keep=1)


def test_an_export_copies_no_file_the_checkpoint_names_outside_itself(model_dir, tmp_path, capsys):
    secret = tmp_path / "home" / "id_rsa"
    secret.parent.mkdir()
    secret.write_text("PRIVATE KEY")
    path = _hf_checkpoint(tmp_path, model_dir, tokenizer=str(secret))
    out = tmp_path / "exported"
    assert export_main([str(path), "--format", "hf", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"names the tokenizer {str(secret)!r}, outside the checkpoint" in err and \
        f"--tokenizer {secret}" in err, err
    assert not (out / "tokenizer.json").exists()

    (path / "tok").mkdir()  # a tokenizer directory inside the checkpoint whose file links outside
    (path / "tok" / "tokenizer.json").symlink_to(secret)
    _rewrite_extra(path, data_config={"kind": "chat", "tokenizer": str(path / "tok")})
    assert export_main([str(path), "--format", "hf", "--out", str(out)]) == 2
    assert "leads outside the checkpoint" in capsys.readouterr().err and not out.exists()
    _rewrite_extra(path, data_config={"kind": "chat", "tokenizer": str(path / "tok" / "tokenizer.json")})
    assert not out.exists()

    (path / "tok" / "tokenizer.json").unlink()  # the checkpoint's own copy, and what the user names, are shipped
    (path / "tok" / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes()[:-1] + b" ")
    assert export_main([str(path), "--format", "hf", "--out", str(out)]) == 0
    assert (out / "tokenizer.json").read_bytes() == (path / "tok" / "tokenizer.json").read_bytes()
    _rewrite_extra(path, data_config={"kind": "chat", "tokenizer": str(secret)})
    assert export_main([str(path), "--format", "hf", "--out", str(out), "--tokenizer", str(secret)]) == 0
    assert (out / "tokenizer.json").read_text() == "PRIVATE KEY"


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora_merged"])
def test_a_chat_fine_tune_leaves_with_its_template_and_generation_config(model_dir, tmp_path, lora):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path = _hf_checkpoint(tmp_path, model_dir, lora=lora, tokenizer=str(model_dir))
    out = tmp_path / "exported"
    assert export_main([str(path), "--format", "hf", "--out", str(out)]) == 0
    for name in ("chat_template.jinja", "generation_config.json", "special_tokens_map.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (model_dir / name).read_bytes(), name
    chat = [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi."}]
    rendered = AutoTokenizer.from_pretrained(out).apply_chat_template(chat, tokenize=False)
    assert rendered == "<|im_start|>user\nHello?<|im_end|>\n<|im_start|>assistant\nHi.<|im_end|>\n"
    assert GenerationConfig.from_pretrained(out).to_dict() == GenerationConfig.from_pretrained(model_dir).to_dict()
    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == 256


def test_the_run_s_own_template_leaves_with_the_export(model_dir, tmp_path, capsys):
    """``data.template=chatml`` (a built-in) is what the model trained with: it ships as chat_template.jinja;
    a template file the checkpoint names outside itself is refused like a tokenizer."""
    from transformers import AutoTokenizer

    from trainer.config.chat_data import TEMPLATES

    path = _hf_checkpoint(tmp_path, model_dir, template="chatml")
    out = tmp_path / "exported"
    assert export_main([str(path), "--format", "hf", "--out", str(out)]) == 0
    assert (out / "chat_template.jinja").read_text() == TEMPLATES["chatml"]
    assert AutoTokenizer.from_pretrained(out).chat_template == TEMPLATES["chatml"]
    secret = tmp_path / "notes.txt"
    secret.write_text("{{ 'secret' }}")
    _rewrite_extra(path, data_config={"kind": "chat", "template": str(secret)})
    assert export_main([str(path), "--format", "hf", "--out", str(tmp_path / "again")]) == 2
    assert f"--template {secret}" in capsys.readouterr().err
    assert not (tmp_path / "again" / "chat_template.jinja").exists()
