"""Hugging Face Llama-family models end to end, as docs/models-and-data.md
types it: a tiny LlamaForCausalLM written with `save_pretrained` in the test, its directory
holding a tokenizer trained here with `tokenizers`, and a jsonl corpus (plus a separate
validation file) tokenized by `data=files`. Trained through the CLI on several layouts with one
device's losses and validation losses, resumed from a 3d checkpoint on another mesh, exported
back to a directory that `transformers` loads with the trainer's logits, and sampled from.

    pytest tests/e2e/test_hf_models.py -q -s      # about 4 minutes on 2 cores
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import run_cli
from tests.hf_assets import documents, write_jsonl, write_tiny_llama, write_tokenizer
from timing import scaled

pytestmark = pytest.mark.slow

VOCAB = 320
LAYOUTS = {"3d": ["+parallel=3d", "mesh=[2,2,2]"], "fsdp": ["+parallel=fsdp", "mesh=[2]"],
           "tp_sp": ["+parallel=tp_sp", "mesh=[2]"]}
# before step 1 (weights loaded: train.eval_at_start), train.eval_every=2, after the last step
EVAL_STEPS = [0, 2, 4, 5]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-tiny")
    write_tiny_llama(path, vocab_size=VOCAB)
    write_tokenizer(path, vocab_size=VOCAB)
    return path


@pytest.fixture(scope="module")
def common(hf_dir, tmp_path_factory) -> list[str]:
    corpus = tmp_path_factory.mktemp("corpus")
    docs = documents(400, seed=5)
    write_jsonl(corpus / "part-0.jsonl", docs[:200])
    write_jsonl(corpus / "part-1.jsonl", docs[200:380])
    (corpus / "val").mkdir()
    write_jsonl(corpus / "val" / "held-out.jsonl", docs[380:])
    return ["data=files", f"data.paths=[{corpus}/*.jsonl]", "data.text_field=text", f"data.tokenizer={hf_dir}",
            f"data.val_paths=[{corpus}/val/*.jsonl]", f"data.cache_dir={corpus / 'cache'}", "train.eval_every=2",
            "train.steps=5", "train.global_batch_size=8", "train.seq_len=32", "train.log_every=1"]


@pytest.fixture(scope="module")
def single(hf_dir, common, tmp_path_factory):
    return _run(tmp_path_factory.mktemp("single"), hf_dir, common)


def _run(cwd, hf_dir, args: list[str]) -> dict[str, dict[int, float]]:
    """{"loss": {step: value}, "val_loss": {step: value}} of the run's MLflow metrics."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{cwd / 'mlflow.db'}"
    proc = run_cli(["model=hf", f"model.path={hf_dir}", *args, f"tracking.tracking_uri={uri}"], cwd=cwd, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("meshflow").experiment_id])
    return {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
            for key in ("loss", "val_loss")}


def _assert_same(got: dict[int, float], want: dict[int, float], steps) -> None:
    assert sorted(got) == list(steps), got
    assert max(abs(got[s] - want[s]) / abs(want[s]) for s in steps) <= 1e-5, (got, want)


def _logits_of_export(directory, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()(tokens).logits


def _logits_of_checkpoint(checkpoint, tokens: torch.Tensor, tmp_path) -> torch.Tensor:
    """The trainer's own model, loaded from the checkpoint through its safetensors export."""
    from pydantic import TypeAdapter

    from trainer.checkpoint.dcp import read_extra
    from trainer.config.schema import ModelConfig
    from trainer.export.weights import export_checkpoint, load_weights
    from trainer.models import build_model

    export_checkpoint(checkpoint, tmp_path / "weights.safetensors")
    model = build_model(TypeAdapter(ModelConfig).validate_python(read_extra(checkpoint)["model_config"]), seed=123)
    load_weights(model, tmp_path / "weights.safetensors")
    with torch.no_grad():
        return model.eval()(tokens)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_step0_logits_equal_transformers(model_type, hf_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from trainer.config.schema import HFModelConfig
    from trainer.models import build_model

    if model_type != "llama":
        hf_dir = tmp_path / model_type
        write_tiny_llama(hf_dir, model_type=model_type, vocab_size=VOCAB)
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    ours = build_model(HFModelConfig(path=str(hf_dir)), seed=7)  # the seed must not matter: weights come from the file
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(tokens).logits
        assert (ours(tokens) - theirs).abs().max() <= 1e-5


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_losses_equal_one_device(layout, hf_dir, common, single, tmp_path):
    extra = LAYOUTS[layout]
    ckpt = tmp_path / "ckpt"
    if layout == "3d":  # also leave checkpoints to resume, export and sample from below
        extra = [*extra, "train.checkpoint.every=2", "train.checkpoint.save_final=true", f"train.checkpoint.dir={ckpt}"]
    got = _run(tmp_path, hf_dir, [*common, *extra])
    print(f"{layout}: {got}\nsingle: {single}")
    assert sorted(single["val_loss"]) == EVAL_STEPS
    _assert_same(got["loss"], single["loss"], range(1, 6))
    _assert_same(got["val_loss"], single["val_loss"], EVAL_STEPS)
    if layout != "3d":
        return
    # The data position saved on dp 2 x pp 2 x tp 2 continues at the same sample on dp 2 alone.
    (tmp_path / "resumed").mkdir()
    resumed = _run(tmp_path / "resumed", hf_dir, [*common, "+parallel=dp", "mesh=[2]",
                                                  f"train.checkpoint.resume={ckpt / 'step_00000002'}"])
    _assert_same(resumed["loss"], single["loss"], range(3, 6))
    out = tmp_path / "exported"
    proc = run_cli_export(ckpt / "step_00000005", out, tmp_path)
    assert proc.returncode == 0, proc.stderr
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    diff = (_logits_of_export(out, tokens) - _logits_of_checkpoint(ckpt / "step_00000005", tokens, tmp_path))
    assert diff.abs().max() <= 1e-5
    assert (out / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    _assert_generate_is_greedy_decoding(ckpt / "step_00000005", out, hf_dir)


def _assert_generate_is_greedy_decoding(checkpoint, exported, hf_dir) -> None:
    """`python -m trainer.generate` at temperature 0 prints what transformers' greedy search on
    the exported model decodes to, with the run's tokenizer."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    proc = subprocess.run([sys.executable, "-m", "trainer.generate", str(checkpoint), "--prompt", "the mesh shards",
                           "--temperature", "0", "--max-new-tokens", "12"], capture_output=True, text=True,
                          timeout=scaled(300))
    assert proc.returncode == 0, proc.stderr
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    prompt = torch.tensor([tok.encode("the mesh shards", add_special_tokens=False).ids])
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    ids = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=tok.token_to_id("</s>"),
                         pad_token_id=tok.token_to_id("</s>"))[0]
    assert proc.stdout.rstrip("\n") == tok.decode(ids.tolist(), skip_special_tokens=False)
    assert proc.stdout.startswith("the mesh shards") and len(ids) > prompt.shape[1]


def run_cli_export(checkpoint, out, cwd):
    return subprocess.run([sys.executable, "-m", "trainer.export", str(checkpoint), "--format", "hf", "--out",
                           str(out)],
                          cwd=cwd, capture_output=True, text=True, timeout=scaled(300))


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
