"""A tied-embedding checkpoint (SmolLM2's shape: tie_word_embeddings, 9 heads over 3 kv heads,
rope_theta 1e5) through the CLI: a pipeline's run and its checkpoint resumed on pure tensor
parallelism give one device's losses, the final checkpoint is the run's MLflow model, and its
export loads tied in transformers with the trainer's logits. (Every layout kind against one
device, in one process group each: tests/dist/test_tied.py.)

    pytest tests/e2e/test_tied_models.py -q -m slow
"""

from __future__ import annotations

import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.e2e.test_hf_models import _assert_same, _logits_of_checkpoint, _logits_of_export, _run, run_cli_export
from tests.hf_assets import write_tied_llama

pytestmark = pytest.mark.slow

COMMON = ["data=synthetic", "train.steps=3", "train.global_batch_size=6", "train.seq_len=32", "train.log_every=1"]


def test_tied_model_on_a_pipeline_then_tp3_equals_one_device_and_exports_tied(tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir = tmp_path / "smol"
    write_tied_llama(hf_dir)
    (tmp_path / "single").mkdir()
    single = _run(tmp_path / "single", hf_dir, COMMON)
    (tmp_path / "pp").mkdir()
    pp = _run(tmp_path / "pp", hf_dir,
              [*COMMON, "+parallel=pp", "mesh=[2]", "parallel.pipeline.microbatches=2", "train.checkpoint.every=2",
                                        f"train.checkpoint.dir={tmp_path / 'pp_ckpt'}"])
    _assert_same(pp["loss"], single["loss"], range(1, 4))
    # The pipeline's step-2 checkpoint (the tie stored once, from the first stage) resumed on tp 3.
    ckpt = tmp_path / "ckpt"
    (tmp_path / "tp").mkdir()
    tp = _run(tmp_path / "tp", hf_dir, [*COMMON, "+parallel=tp", "mesh=[3]", "train.checkpoint.save_final=true",
                                        f"train.checkpoint.resume={tmp_path / 'pp_ckpt' / 'step_00000002'}",
                                        f"train.checkpoint.dir={ckpt}"])
    _assert_same(tp["loss"], single["loss"], [3])

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'tp' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("meshflow").experiment_id])
    assert run.info.status == "FINISHED"
    assert "model" in [a.path for a in client.list_artifacts(run.info.run_id)]

    out = tmp_path / "exported"
    proc = run_cli_export(ckpt / "step_00000003", out, tmp_path)
    assert proc.returncode == 0, proc.stderr
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert exported.config.tie_word_embeddings
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    diff = _logits_of_export(out, tokens) - _logits_of_checkpoint(ckpt / "step_00000003", tokens, tmp_path)
    assert diff.abs().max() <= 1e-5
