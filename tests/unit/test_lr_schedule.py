"""The learning-rate multiplier (:func:`trainer.run.loop.lr_lambda`): linear warm-up from a count of
steps or a fraction of the run, then cosine, linear or constant, on values worked out by hand.

Run: ``python -m pytest tests/unit/test_lr_schedule.py -q``
"""

from __future__ import annotations

import math

import pytest
import torch

from trainer.config.schema import DEFAULT_WARMUP_STEPS, OptimConfig
from trainer.run.loop import lr_lambda


def factors(optim: OptimConfig, total_steps: int) -> list[float]:
    factor = lr_lambda(optim, total_steps)
    return [factor(step) for step in range(total_steps)]


def test_default_warmup_is_ten_steps():
    assert OptimConfig().warmup_steps_for(1000) == DEFAULT_WARMUP_STEPS == 10
    f = factors(OptimConfig(), 100)
    assert f[:3] == pytest.approx([1 / 11, 2 / 11, 3 / 11]) and f[9] == pytest.approx(10 / 11)
    assert f[10] == pytest.approx(1.0)  # the peak: warm-up over, no decay yet


@pytest.mark.parametrize(("fraction", "total", "warmup"), [
    (0.03, 1000, 30), (0.1, 100, 10), (0.03, 100, 3), (0.03, 10, 1), (0.5, 7, 4), (0.0, 50, 0)])
def test_warmup_fraction_of_the_steps_rounded_up(fraction, total, warmup):
    """ceil(fraction * steps): any positive fraction warms up at least one step; 0.1 * 100 is 10, not 11."""
    assert OptimConfig(warmup_fraction=fraction).warmup_steps_for(total) == warmup


def test_warmup_steps_win_over_the_fraction():
    """A count given after a recipe's fraction (``+recipe=finetune optim.warmup_steps=50``) is the one used."""
    optim = OptimConfig(warmup_steps=50, warmup_fraction=0.03)
    assert optim.warmup_steps_for(1000) == 50
    assert factors(optim, 1000) == factors(OptimConfig(warmup_steps=50), 1000)


def test_warmup_fraction_then_cosine_values():
    """30 warm-up steps of 1000 (fraction 0.03): (s+1)/31, then cosine from 1 to min_lr_ratio over 970 steps."""
    optim = OptimConfig(warmup_fraction=0.03, schedule="cosine", min_lr_ratio=0.1)
    f = factors(optim, 1000)
    assert f[0] == pytest.approx(1 / 31) and f[29] == pytest.approx(30 / 31)
    assert f[30] == pytest.approx(1.0)
    mid = 30 + 485  # half-way through the decay: cos(pi/2) = 0, so halfway between 1 and 0.1
    assert f[mid] == pytest.approx(0.1 + 0.9 * 0.5)
    assert f[100] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 70 / 970)))
    assert lr_lambda(optim, 1000)(1000) == pytest.approx(0.1)  # the end of the run: min_lr_ratio
    assert all(a <= b for a, b in zip(f[:30], f[1:31])) and all(a >= b for a, b in zip(f[30:], f[31:]))


def test_warmup_fraction_linear_and_constant():
    linear = factors(OptimConfig(warmup_fraction=0.1, schedule="linear", min_lr_ratio=0.0), 100)
    assert linear[10] == pytest.approx(1.0) and linear[55] == pytest.approx(0.5)
    constant = factors(OptimConfig(warmup_fraction=0.1, schedule="constant"), 100)
    assert constant[:10] == pytest.approx([(s + 1) / 11 for s in range(10)]) and set(constant[10:]) == {1.0}


def test_scheduler_gives_the_optimizer_these_rates():
    """The loop's LambdaLR over the multiplier: the lr at each step is peak * factor(step)."""
    optim = OptimConfig(lr=2e-5, warmup_fraction=0.03)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=optim.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(optim, 200))
    seen = []
    for _ in range(8):
        seen.append(scheduler.get_last_lr()[0])
        opt.step()
        scheduler.step()
    assert seen == pytest.approx([2e-5 * f for f in factors(optim, 200)[:8]])
    assert seen[:6] == pytest.approx([2e-5 * (s + 1) / 7 for s in range(6)])  # ceil(0.03 * 200) = 6 warm-up steps


@pytest.mark.parametrize("bad", [{"warmup_fraction": 1.0}, {"warmup_fraction": -0.1}, {"warmup_steps": -1}])
def test_warmup_out_of_range_is_refused(bad):
    with pytest.raises(ValueError):
        OptimConfig(**bad)
