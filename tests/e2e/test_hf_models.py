"""Hugging Face Llama-family models end to end: a tiny LlamaForCausalLM written with
`save_pretrained` in the test, trained through the CLI on several layouts with one device's
losses, and exported back to a directory that `transformers` loads with the trainer's logits.

    pytest tests/e2e/test_hf_models.py -q -s      # about 3 minutes on 2 cores
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_cli
from tests.hf_assets import write_tiny_llama

pytestmark = pytest.mark.slow

COMMON = ["data=synthetic", "train.steps=5", "train.global_batch_size=8", "train.seq_len=32", "train.log_every=1"]
LAYOUTS = {"3d": ["+parallel=3d", "mesh=[2,2,2]"], "fsdp": ["+parallel=fsdp", "mesh=[2]"],
           "tp_sp": ["+parallel=tp_sp", "mesh=[2]"]}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-tiny")
    write_tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def single(hf_dir, tmp_path_factory):
    return _run(tmp_path_factory.mktemp("single"), hf_dir, [])


def _run(cwd, hf_dir, extra: list[str]) -> list[float]:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{cwd / 'mlflow.db'}"
    proc = run_cli(["model=hf", f"model.path={hf_dir}", *COMMON, *extra, f"tracking.tracking_uri={uri}"],
                   cwd=cwd, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("meshflow").experiment_id])
    return [m.value for m in sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)]


def _logits_of_export(directory, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()(tokens).logits


def _logits_of_checkpoint(checkpoint, tokens: torch.Tensor, tmp_path) -> torch.Tensor:
    """The trainer's own model, loaded from the checkpoint through its safetensors export."""
    from pydantic import TypeAdapter

    from trainer.checkpoint import read_extra
    from trainer.config import ModelConfig
    from trainer.export import export_checkpoint, load_weights
    from trainer.models import build_model

    export_checkpoint(checkpoint, tmp_path / "weights.safetensors")
    model = build_model(TypeAdapter(ModelConfig).validate_python(read_extra(checkpoint)["model_config"]), seed=123)
    load_weights(model, tmp_path / "weights.safetensors")
    with torch.no_grad():
        return model.eval()(tokens)


def test_step0_logits_equal_transformers(hf_dir):
    from transformers import AutoModelForCausalLM

    from trainer.config import HFModelConfig
    from trainer.models import build_model

    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    ours = build_model(HFModelConfig(path=str(hf_dir)), seed=7)  # the seed must not matter: weights come from the file
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(tokens).logits
        assert (ours(tokens) - theirs).abs().max() <= 1e-5


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_losses_equal_one_device(layout, hf_dir, single, tmp_path):
    extra = LAYOUTS[layout]
    if layout == "3d":  # also leave a checkpoint to export below
        extra = [*extra, "train.checkpoint.save_final=true", f"train.checkpoint.dir={tmp_path / 'ckpt'}"]
    losses = _run(tmp_path, hf_dir, extra)
    print(f"{layout}: {losses}\nsingle: {single}")
    assert len(losses) == 5 and max(abs(a - b) / abs(b) for a, b in zip(losses, single)) <= 1e-5
    if layout == "3d":
        out = tmp_path / "exported"
        proc = run_cli_export(tmp_path / "ckpt" / "step_00000005", out, tmp_path)
        assert proc.returncode == 0, proc.stderr
        tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
        diff = (_logits_of_export(out, tokens) - _logits_of_checkpoint(tmp_path / "ckpt" / "step_00000005", tokens, tmp_path))
        assert diff.abs().max() <= 1e-5


def run_cli_export(checkpoint, out, cwd):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "trainer.export", str(checkpoint), "--format", "hf", "--out", str(out)],
                          cwd=cwd, capture_output=True, text=True, timeout=300)


def test_builtin_llama_exports_to_transformers(tmp_path):
    """The built-in decoder (interleaved RoPE) exported with q/k permuted: transformers gives its logits."""
    proc = run_cli(["tracking=none", "data=synthetic", "train.steps=2", "train.global_batch_size=4", "train.seq_len=32",
                    "train.checkpoint.save_final=true", f"train.checkpoint.dir={tmp_path / 'ckpt'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoint = tmp_path / "ckpt" / "step_00000002"
    assert run_cli_export(checkpoint, tmp_path / "exported", tmp_path).returncode == 0
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    diff = _logits_of_export(tmp_path / "exported", tokens) - _logits_of_checkpoint(checkpoint, tokens, tmp_path)
    assert diff.abs().max() <= 1e-5
