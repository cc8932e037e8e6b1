"""Shard-by-shard initialisation: every block of a parameter equals the same block of its full value."""

from __future__ import annotations

import itertools

import pytest
import torch

from trainer.models import init as init_mod
from trainer.models.init import init_parameter, initial_block

SHAPES = [(5,), (16,), (17,), (40,), (3, 7), (64, 172), (172, 64), (257, 33), (4, 6, 10), (1000, 3)]


def _blocks(shape):
    """Row ranges, column ranges and both, the way Shard(0), Shard(1) and a 2-D mesh cut them."""
    for parts0, parts1 in itertools.product((1, 2, 3), (1, 2) if len(shape) > 1 else (1,)):
        rows = torch.arange(shape[0]).chunk(parts0)
        cols = torch.arange(shape[1]).chunk(parts1) if len(shape) > 1 else [None]
        for r, c in itertools.product(rows, cols):
            offset = [int(r[0])] + ([int(c[0])] if c is not None else []) + [0] * (len(shape) - 1 - (c is not None))
            local = [len(r)] + ([len(c)] if c is not None else []) + list(shape[1 + (c is not None):])
            yield tuple(offset), tuple(local)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunk", [16, 48, 1 << 20])
def test_every_block_equals_the_slice_of_the_full_value(shape, chunk, monkeypatch):
    monkeypatch.setattr(init_mod, "_CHUNK", chunk)  # small chunks: rows straddle pieces, the tail is redrawn
    full = init_parameter(shape, "layers.0.w.weight", seed=3, std=0.5)
    for offset, local in _blocks(shape):
        block = initial_block(shape, offset, local, "layers.0.w.weight", seed=3, std=0.5)
        expected = full[tuple(slice(o, o + k) for o, k in zip(offset, local))]
        assert torch.equal(block, expected), (shape, offset, local)


def test_ones_and_zeros_and_empty_blocks():
    assert torch.equal(initial_block((8, 4), (4, 0), (4, 4), "n.weight", 0, 0.0, kind="ones"), torch.ones(4, 4))
    assert torch.equal(initial_block((8,), (0,), (8,), "b.bias", 0, 0.0, kind="zeros"), torch.zeros(8))
    assert initial_block((3, 4), (3, 0), (0, 4), "x", 0, 1.0).shape == (0, 4)  # an uneven shard's empty tail


def test_a_row_block_never_draws_the_whole_tensor(monkeypatch):
    """The first rows of a large parameter stop the stream early: at most one chunk past them."""
    drawn = []
    real = torch.normal

    def counting(*args, size, **kwargs):
        drawn.append(size[0])
        return real(*args, size=size, **kwargs)

    monkeypatch.setattr(init_mod, "_CHUNK", 1024)
    monkeypatch.setattr(torch, "normal", counting)
    block = initial_block((4096, 64), (0, 0), (512, 64), "big", seed=1, std=1.0)
    assert block.shape == (512, 64) and sum(drawn) == 512 * 64 and max(drawn) == 1024
