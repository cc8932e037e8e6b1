"""When a run evaluates before step 1 (``train.eval_at_start``): explicitly, or on auto (null) when
weights are loaded and the run does not resume (:func:`trainer.run.loop._eval_at_start`).

Run: ``python -m pytest tests/unit/test_eval_at_start.py -q``
"""

from __future__ import annotations

import pytest

from trainer.config.schema import HFModelConfig, RunConfig, TrainConfig
from trainer.run.loop import _eval_at_start


def config(tmp_path, *, weights: bool = False, init_from: bool = False, eval_at_start: bool | None = None) -> RunConfig:
    (tmp_path / "config.json").write_text("{}")  # only the safetensors files count
    if weights:
        (tmp_path / "model.safetensors").write_bytes(b"")
    return RunConfig(model=HFModelConfig(path=str(tmp_path)), train=TrainConfig(
        eval_at_start=eval_at_start, init_from=str(tmp_path / "w.safetensors") if init_from else None))


@pytest.mark.parametrize(("weights", "init_from", "resumed", "want"), [
    (True, False, False, True),    # a Hugging Face directory with its weights
    (False, True, False, True),    # train.init_from
    (False, False, False, False),  # random init from config.json: nothing to compare against
    (True, False, True, False),    # resumed: the first run evaluated its start
    (False, True, True, False),
])
def test_auto(tmp_path, weights, init_from, resumed, want):
    assert _eval_at_start(config(tmp_path, weights=weights, init_from=init_from), resumed=resumed) is want


@pytest.mark.parametrize("resumed", [False, True])
@pytest.mark.parametrize("weights", [False, True])
def test_explicit_value_wins(tmp_path, weights, resumed):
    assert _eval_at_start(config(tmp_path, weights=weights, eval_at_start=True), resumed=resumed) is True
    assert _eval_at_start(config(tmp_path, weights=weights, eval_at_start=False), resumed=resumed) is False
