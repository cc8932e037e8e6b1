"""Fine-tuning a pretrained model with ``+recipe=finetune``, as docs/fine-tuning.md
types it: a tiny LlamaForCausalLM written with ``save_pretrained`` in the test, trained
through the CLI on byte-level text with a held-out split. Weights are loaded, so the validation
loss is evaluated before step 1 and logged at step 0: it equals the loss ``transformers`` computes
with the untouched weights on the same validation batches, and differs from the last step's.

    pytest tests/e2e/test_finetune_recipe.py -q -s      # about 30 s on 2 cores
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from tests.hf_assets import documents, write_tiny_llama

pytestmark = pytest.mark.slow

STEPS = 4
RUN = ["train.steps=4", "train.global_batch_size=4", "train.seq_len=32", "train.log_every=1", "train.eval_batches=2",
       "data=text", "data.glob=*.txt", "data.val_fraction=0.2", "tracking.pictures=false",
       "tracking.system_metrics=false", "tracking.log_model=false"]


@pytest.fixture(scope="module")
def finetune(tmp_path_factory):
    """(the run's overrides, its MLflow metrics {key: {step: value}}, its console output)."""
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("finetune")
    write_tiny_llama(root / "llama-tiny", vocab_size=256)
    (root / "corpus").mkdir()
    for i, doc in enumerate(documents(60, seed=3)):
        (root / "corpus" / f"doc-{i:02d}.txt").write_text(doc + "\n")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    overrides = ["+recipe=finetune", "model=hf", f"model.path={root / 'llama-tiny'}", *RUN,
                 f"data.root={root / 'corpus'}", f"train.checkpoint.dir={root / 'checkpoints'}"]
    proc = run_cli([*overrides, f"tracking.tracking_uri={uri}"], cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("meshflow").experiment_id])
    metrics = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
               for key in ("loss", "val_loss", "val_perplexity", "lr")}
    return overrides, metrics, proc.stdout + proc.stderr


def _untrained_val_loss(overrides: list[str]) -> float:
    """The validation loss of the directory's weights, by ``transformers`` on the batches the run
    evaluates (the trainer's data pipeline, the model not the trainer's)."""
    from transformers import AutoModelForCausalLM

    from trainer.config.compose import compose_dict
    from trainer.data import build_splits
    from trainer.data.loader import ValidationRows
    from trainer.models import decoder_config
    from trainer.validate.checks import validate_config

    cfg = validate_config(compose_dict(overrides))
    t = cfg.train
    val = build_splits(cfg.data, seq_len=t.seq_len, model_cfg=decoder_config(cfg.model) or cfg.model).val
    rows = ValidationRows(val, global_batch_size=t.global_batch_size, max_batches=t.eval_batches, dp_rank=0,
                          dp_size=1, seed=t.seed).indices  # each evaluated row once
    inputs, targets = (torch.stack(column) for column in zip(*(val[i] for i in rows)))
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(inputs).logits
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)))


def test_val_loss_at_step_0_is_the_pretrained_models(finetune):
    overrides, metrics, output = finetune
    val = metrics["val_loss"]
    assert sorted(val) == [0, STEPS]  # before step 1 (weights loaded: eval_at_start on) and after the last step
    want = _untrained_val_loss(overrides)
    print(f"\nval_loss: step 0 {val[0]:.6f} (transformers: {want:.6f}), step {STEPS} {val[STEPS]:.6f}")
    assert val[0] == pytest.approx(want, rel=1e-5)
    assert metrics["val_perplexity"][0] == pytest.approx(math.exp(val[0]), rel=1e-6)
    assert val[STEPS] != val[0] and math.isfinite(val[STEPS])
    assert f"step 0/{STEPS} | val_loss {val[0]:.4f}" in output


def test_recipe_learning_rate_warms_up_then_decays(finetune):
    """lr 2e-5, warm-up ceil(0.03 * 4) = 1 step, then cosine down to 0.1 of the peak."""
    lr = finetune[1]["lr"]
    assert lr[1] == pytest.approx(2e-5 / 2)  # the first step: (0 + 1) / (1 + 1) of the peak
    assert lr[2] == pytest.approx(2e-5)
    assert lr[2] > lr[3] > lr[4] > 2e-6


def test_recipe_saves_the_final_checkpoint(finetune):
    overrides, _, output = finetune  # save_final: true, and no checkpoint.every
    ckpt_dir = next(o.split("=", 1)[1] for o in overrides if o.startswith("train.checkpoint.dir="))
    saved = sorted(p.name for p in Path(ckpt_dir).glob("step_*"))
    assert [int(name.removeprefix("step_")) for name in saved] == [STEPS] and saved[0] in output
