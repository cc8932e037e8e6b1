"""Tied parameters (input embedding = output head) stay one parameter through materialisation and
go out once: parallel/sharding/ties.py and the export's state dict."""

import pytest
import torch
from torch import nn

from parallel.sharding.ties import alias_names, retie, tied_groups
from trainer.export.weights import unique_state_dict


def _tied(device: str = "cpu") -> nn.Module:
    with torch.device(device):
        model = nn.ModuleDict({"embed": nn.Embedding(10, 4), "norm": nn.LayerNorm(4),
                               "head": nn.Linear(4, 10, bias=False)})
    model["head"].weight = model["embed"].weight
    return model


def test_the_tie_is_found_under_both_names():
    model = _tied()
    assert tied_groups(model) == [["embed.weight", "head.weight"]]
    assert alias_names(model) == {"head.weight"}
    assert list(unique_state_dict(model)) == ["embed.weight", "norm.weight", "norm.bias"]


def test_materialising_a_meta_model_keeps_the_tie_once_retied():
    model = _tied("meta")
    groups = tied_groups(model)
    model.to_empty(device="cpu")
    assert model["head"].weight is not model["embed"].weight  # what to_empty does to a tie
    retie(model, groups)
    assert model["head"].weight is model["embed"].weight
    with torch.no_grad():
        model["embed"].weight.fill_(2.0)
    assert torch.equal(model["head"].weight, torch.full((10, 4), 2.0))
    assert sum(1 for _ in model.parameters()) == 3  # the optimizer sees the tied weight once


def test_a_stage_holding_one_end_only_is_left_alone():
    model = _tied()
    groups = tied_groups(model)
    del model["head"]
    retie(model, groups)
    assert list(dict(model.named_parameters())) == ["embed.weight", "norm.weight", "norm.bias"]


def test_ends_placed_differently_are_refused():
    model = _tied()
    groups = tied_groups(model)
    model["head"].weight = nn.Parameter(torch.zeros(5, 4))  # what a different shard would leave
    with pytest.raises(ValueError, match="head.weight is tied to embed.weight .* placed differently"):
        retie(model, groups)
