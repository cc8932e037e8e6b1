"""Tied parameters (one parameter registered in several modules, e.g. a language model's input
embedding and output head) kept tied while a model part is sharded and materialised.

``Module.to_empty`` gives every module its own new tensor, so a meta model's tie does not survive
materialisation: the head would keep its own (random) values while the embedding is trained and
loaded. :func:`tied_groups` records the ties before a part is changed; :func:`retie` registers the
first name's parameter under the others again, and refuses a tie that sharding split into two
differently placed parameters (the plan must place a tie's names alike).

    groups = tied_groups(part)          # [["model.embed_tokens.weight", "lm_head.weight"]]
    part.to_empty(device=device)
    retie(part, groups)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TypeVar

from torch import nn

V = TypeVar("V")


def tied_groups(module: nn.Module) -> list[list[str]]:
    """The names of every parameter registered under more than one name, first name first (the
    one ``named_parameters()`` reports; the others are its aliases)."""
    names: dict[int, list[str]] = defaultdict(list)
    for name, param in module.named_parameters(remove_duplicate=False):
        names[id(param)].append(name)
    return [group for group in names.values() if len(group) > 1]


def placed_alike(placements: Mapping[str, V], groups: Sequence[Sequence[str]]) -> dict[str, V]:
    """``placements`` (FQN -> placements) with every name of a tied group placed as its placed name: a plan
    names a tied parameter once (its first name), but every module holding it must place it alike (each is
    distributed on its own, then tied again), and a pipeline stage may hold the other end only."""
    out = dict(placements)
    for group in groups:
        placed = next((out[n] for n in group if n in out), None)
        if placed is not None:
            out.update({n: placed for n in group if n not in out})
    return out


def alias_names(module: nn.Module) -> set[str]:
    """The names under which a tied parameter is registered again: a state dict without them
    holds every tensor once (what a safetensors file and an export write)."""
    return {alias for _, *aliases in tied_groups(module) for alias in aliases}


def first_names(groups: list[list[str]]) -> dict[str, str]:
    """``{alias: first name}`` of tied groups (first name first, as :func:`tied_groups` gives them)."""
    return {alias: names[0] for names in groups for alias in names[1:]}


def _layout(param: nn.Parameter) -> tuple[object, ...]:
    """Shape, mesh and placements (a DTensor's; none for a plain tensor)."""
    return tuple(param.shape), getattr(param, "device_mesh", None), tuple(getattr(param, "placements", ()))


def retie(module: nn.Module, groups: list[list[str]]) -> None:
    """Register each group's first parameter under its other names again (those ``module`` still
    holds: a pipeline stage may hold one end only). Raises ValueError when the ends were placed
    differently, which would train two different tensors where the model has one."""
    for first, *aliases in groups:
        try:
            keep = module.get_parameter(first)
        except AttributeError:
            continue
        for alias in aliases:
            owner, _, attr = alias.rpartition(".")
            try:
                holder = module.get_submodule(owner)
            except AttributeError:
                continue
            current = getattr(holder, attr, None)
            if current is keep or current is None:
                continue
            if _layout(current) != _layout(keep):
                raise ValueError(f"{alias} is tied to {first} (one parameter in the model) but they were placed "
                                 f"differently ({_layout(current)[2]} vs {_layout(keep)[2]}); place both alike")
            setattr(holder, attr, keep)
