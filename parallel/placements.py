"""The placement grammar of the config: ``Shard(d)``, ``Replicate`` and ``Partial``.

A placement says how one tensor lies along one mesh axis, as in OneFlow's SBP
(split / broadcast / partial-sum) and DTensor's ``Shard`` / ``Replicate`` / ``Partial``.
The config writes them as strings; :func:`parse_placement` turns a string into a
:class:`PlacementSpec`, which converts to the DTensor placement with :meth:`to_torch`.

    >>> parse_placement("Shard(0)")
    Shard(0)
    >>> parse_placement("Replicate").to_torch()
    Replicate()
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeVar

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

_SHARD = re.compile(r"^\s*(?:S|Shard)\s*\(\s*(-?\d+)\s*\)\s*$", re.IGNORECASE)
_REPLICATE = re.compile(r"^\s*(?:R|Replicate)\s*(?:\(\s*\))?\s*$", re.IGNORECASE)
_PARTIAL = re.compile(r"^\s*(?:P|Partial)\s*(?:\(\s*(?:['\"]?(sum|avg|max|min)['\"]?)?\s*\))?\s*$", re.IGNORECASE)

PLACEMENT_GRAMMAR = "Shard(<tensor dim>), Replicate or Partial (e.g. Shard(0))"

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class PlacementSpec:
    """One placement on one mesh axis.

    Args:
        kind: ``"shard"``, ``"replicate"`` or ``"partial"``.
        dim: the tensor dimension split over the mesh axis (``shard`` only).
        reduce_op: how partial values combine (``partial`` only; default ``sum``).
    """

    kind: Literal["shard", "replicate", "partial"]
    dim: int | None = None
    reduce_op: str = "sum"

    def __repr__(self) -> str:
        if self.kind == "shard":
            return f"Shard({self.dim})"
        if self.kind == "partial":
            return "Partial()" if self.reduce_op == "sum" else f"Partial({self.reduce_op})"
        return "Replicate()"

    __str__ = __repr__

    @property
    def is_shard(self) -> bool:
        return self.kind == "shard"

    def to_torch(self) -> Placement:
        """The matching ``torch.distributed.tensor`` placement."""
        from torch.distributed.tensor import Partial, Replicate, Shard

        if self.kind == "shard":
            assert self.dim is not None, "a shard placement has a dim"
            return Shard(self.dim)
        if self.kind == "partial":
            return Partial(self.reduce_op)
        return Replicate()


def parse_placement(text: object) -> PlacementSpec:
    """Parse ``Shard(d)`` / ``Replicate`` / ``Partial``; raise ``ValueError`` otherwise."""
    if isinstance(text, PlacementSpec):
        return text
    if not isinstance(text, str):
        raise ValueError(f"expected a placement string ({PLACEMENT_GRAMMAR}), got {text!r}")
    if m := _SHARD.match(text):
        return PlacementSpec("shard", dim=int(m.group(1)))
    if _REPLICATE.match(text):
        return PlacementSpec("replicate")
    if m := _PARTIAL.match(text):
        return PlacementSpec("partial", reduce_op=(m.group(1) or "sum").lower())
    raise ValueError(f"{text!r} is not a placement; write {PLACEMENT_GRAMMAR}")


# A table: per key (a parameter's or module's FQN), its placements per mesh axis. The plan, the
# topology and the planner read whole tables of them, so the questions below take a table and
# answer for every row in one call, rather than one call per placement.


def placement_texts(table: Mapping[K, Mapping[str, PlacementSpec]]) -> dict[K, dict[str, str]]:
    """Every row's placements as the config writes them (``{"tp": "Shard(0)"}``): a table to write out."""
    return {key: {axis: repr(placement) for axis, placement in axes.items()} for key, axes in table.items()}


def parse_placement_table(table: Mapping[K, Mapping[str, object]]) -> dict[K, dict[str, PlacementSpec]]:
    """:func:`parse_placement` of every placement of every row (the inverse of :func:`placement_texts`)."""
    return {key: {axis: parse_placement(text) for axis, text in axes.items()} for key, axes in table.items()}


def sharding_axes(table: Mapping[K, Mapping[str, PlacementSpec]]) -> dict[K, tuple[str, ...]]:
    """Every row's mesh axes whose placement is ``Shard``, in the row's order."""
    return {key: tuple(axis for axis, placement in axes.items() if placement.is_shard)
            for key, axes in table.items()}
