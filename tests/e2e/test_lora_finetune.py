"""LoRA fine-tuning as a user types it: ``model.lora.rank=8`` on a tiny LlamaForCausalLM written in the
test, an adapters-only checkpoint, a resume, and both exports: ``--format peft`` loaded by ``peft`` on
the ``transformers`` model gives the trainer's logits, ``--format hf`` holds base + scaling * B @ A.

    pytest tests/e2e/test_lora_finetune.py -q -m slow      # two short runs, about a minute on 2 cores
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import run_cli
from tests.hf_assets import write_tiny_llama
from timing import scaled

pytestmark = pytest.mark.slow

RUN = ["model=hf", "model.lora.rank=8", "model.lora.alpha=16",
       'model.lora.targets=["model.layers.*.self_attn.[qv]_proj"]',
       "data=synthetic", "train.seq_len=32", "train.global_batch_size=4", "optim.lr=1e-2", "tracking=none",
       "tracking.pictures=false", "train.checkpoint.save_final=true"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(root, the resumed run's last checkpoint, both runs' console output)."""
    root = tmp_path_factory.mktemp("lora")
    write_tiny_llama(root / "llama")
    common = [*RUN, f"model.path={root / 'llama'}", f"train.checkpoint.dir={root / 'ckpt'}"]
    first = run_cli([*common, "train.steps=2"], cwd=root)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    second = run_cli([*common, "train.steps=3", "train.checkpoint.resume=auto"], cwd=root)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    return root, root / "ckpt" / "step_00000003", first.stdout + second.stdout


def _export(ckpt, fmt: str, out) -> None:
    proc = subprocess.run([sys.executable, "-m", "trainer.export", str(ckpt), "--format", fmt, "--out", str(out)],
                          capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_checkpoint_holds_the_adapters_only_and_resumes(trained):
    from trainer.checkpoint.dcp import stored_model_keys

    root, ckpt, output = trained
    keys = stored_model_keys(ckpt)
    assert keys == {f"model.layers.{i}.self_attn.{p}_proj.lora_{x}.weight" for i in range(4) for p in "qv"
                    for x in "AB"}
    assert "resumed from" in output and "step_00000002" in output


def test_peft_export_gives_the_trainers_logits(trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.export.weights import load_checkpoint_model

    root, ckpt, _ = trained
    _export(ckpt, "peft", tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (8, 16, ["q_proj", "v_proj"])
    model, _, _ = load_checkpoint_model(ckpt)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(root / "llama", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        ours, theirs = model(tokens), peft_model(tokens).logits
        untouched = AutoModelForCausalLM.from_pretrained(root / "llama", dtype=torch.float32)(tokens).logits
    assert float((ours - theirs).abs().max()) <= 1e-5
    assert float((ours - untouched).abs().max()) > 1e-3  # the adapters trained: a missing one would show


def test_merged_export_is_base_plus_scaled_update(trained, tmp_path):
    from safetensors.torch import load_file

    from trainer.export.weights import load_checkpoint_model

    root, ckpt, _ = trained
    _export(ckpt, "hf", tmp_path / "merged")
    merged, base = load_file(tmp_path / "merged" / "model.safetensors"), load_file(root / "llama" / "model.safetensors")
    model, _, _ = load_checkpoint_model(ckpt)
    assert merged.keys() == base.keys()
    q = model.model.layers["1"].self_attn.q_proj
    want = base["model.layers.1.self_attn.q_proj.weight"] + 2.0 * q.lora_B.weight.detach() @ q.lora_A.weight.detach()
    assert torch.allclose(merged["model.layers.1.self_attn.q_proj.weight"], want, atol=1e-6)
    assert torch.equal(merged["model.layers.1.self_attn.k_proj.weight"], base["model.layers.1.self_attn.k_proj.weight"])
    assert not torch.equal(merged["model.layers.1.self_attn.q_proj.weight"],
                           base["model.layers.1.self_attn.q_proj.weight"])
