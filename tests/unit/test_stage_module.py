"""A pipeline stage is a copy of the model keeping only its units, parameter names unchanged
(:func:`parallel.pipeline.schedule.build_stage_module`): blocks in an ``nn.ModuleDict`` lose the other
stages' keys, a top-level piece another stage holds becomes ``None``, and blocks in an ``nn.ModuleList``
(whose deletion would renumber, and so rename, the later blocks) are refused with the way out."""

from __future__ import annotations

import pytest
from torch import nn

from parallel.pipeline.schedule import build_stage_module


class _Blocks(nn.Module):
    def __init__(self, container: type[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Linear(2, 4)
        blocks = [nn.Linear(4, 4) for _ in range(3)]
        self.layers = nn.ModuleDict({str(i): b for i, b in enumerate(blocks)}) if container is nn.ModuleDict \
            else nn.ModuleList(blocks)
        self.head = nn.Linear(4, 2)


UNITS = ["embed", "layers.0", "layers.1", "layers.2", "head"]


def test_a_stage_keeps_its_units_under_their_own_names():
    model = _Blocks(nn.ModuleDict)
    stage = build_stage_module(model, ["layers.1", "layers.2", "head"], UNITS)
    assert [n for n, _ in stage.named_parameters()] == [
        "layers.1.weight", "layers.1.bias", "layers.2.weight", "layers.2.bias", "head.weight", "head.bias"]
    assert stage.embed is None and list(stage.layers.keys()) == ["1", "2"]
    assert stage.layers["1"].weight is not model.layers["1"].weight  # a copy: the model itself keeps every unit
    assert len(model.layers) == 3 and model.embed is not None


def test_blocks_in_a_module_list_are_refused_with_the_way_out():
    with pytest.raises(ValueError, match=r"layers holds its blocks in an nn.ModuleList.*nn.ModuleDict keyed"):
        build_stage_module(_Blocks(nn.ModuleList), ["layers.1", "layers.2", "head"], UNITS)
