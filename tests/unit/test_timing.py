"""tests/timing.py, the deadline scaling every wall-clock limit of the tests goes through."""

from __future__ import annotations

import pytest

import timing


def test_a_fixed_factor_from_the_environment_scales_every_deadline(monkeypatch):
    monkeypatch.setenv(timing.ENV_VAR, "3")
    assert timing.slowness() == 3.0
    assert timing.scaled(20) == 60.0
    deadline = timing.Deadline(10)
    assert deadline.seconds_scaled == 30.0 and 29.0 < deadline.left() <= 30.0 and not deadline.expired()
    monkeypatch.setenv(timing.ENV_VAR, "0.5")  # a factor below 1 would shorten the written figures: floor
    assert timing.scaled(20) == 20.0


def test_a_bad_factor_says_what_to_set(monkeypatch):
    monkeypatch.setenv(timing.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="MESHFLOW_TEST_SLOWNESS='fast' is not a number"):
        timing.slowness()


def test_the_measured_factor_is_a_floor_of_one_and_bounded(monkeypatch):
    monkeypatch.delenv(timing.ENV_VAR, raising=False)
    factor = timing.measure_slowness()
    assert 1.0 <= factor <= timing.MAX_SLOWNESS
    assert timing.Deadline(0).expired()
