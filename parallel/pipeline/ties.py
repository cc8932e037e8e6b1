"""A tied parameter whose names fall in different pipeline stages: the input embedding on the first
stage and the output head on the last (``tie_word_embeddings``).

A stage is a copy of the model (:mod:`parallel.pipeline.schedule`), so the stages holding a tie's
names each hold their own copy of the one parameter. Megatron-LM's way keeps them equal: both
copies start from the same values, their gradients are summed between the holders before every
optimizer step (the model's gradient is the sum of both uses), and the optimizer then makes the
same update on both. Only the first name's copy counts in the gradient norm, and a checkpoint
holds the first name only (:mod:`trainer.checkpoint.tied_keys`).

    ties = StageTies.build(groups, parts, holders)   # groups from tied_groups(whole model)
    ties.copy_values()                                # once the values are in (init or a load)
    ties.sum_grads()                                  # once per optimizer step, before clipping

Two ways to pair copies across ranks:
* one mesh with a pp axis (``"shards"``): every stage has the same layout, so the holders of a
  tie at the same coordinate off the pp axis hold the same shard: an all-reduce of the local
  shards over that pair is the sum (Megatron's embedding group);
* per-stage layouts (``"whole"``): the stages' layouts may differ, so each holder gathers its
  copy's gradient whole inside its stage, the lane's holders all-reduce it, and each keeps its
  own block again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from parallel.plan.spec import ParallelPlan

Pairing = Literal["shards", "whole"]


@dataclass
class _Tie:
    names: list[str]  # the model's names of the parameter, first name first
    copies: list[tuple[str, nn.Parameter]]  # this rank's copies: (a name it is held under, the parameter)
    group: dist.ProcessGroup | None  # the holders to sum with (None: every copy is on this rank)
    source: int | None  # the global rank whose copy gives the values (the first name's holder)


@dataclass
class StageTies:
    """The ties split between stages, as this rank holds them."""

    ties: list[_Tie] = field(default_factory=list)
    pairing: Pairing = "shards"

    @classmethod
    def build(cls, groups: Sequence[Sequence[str]], parts: Sequence[nn.Module], holders: Mapping[str, Sequence[int]],
              *, pairing: Pairing) -> StageTies:
        """``groups``: the whole model's tied names (:func:`parallel.sharding.ties.tied_groups`);
        ``parts``: this rank's stage modules; ``holders``: for each name, the global ranks, one per
        pairing set, that hold it, in the same order for every name (:func:`holders_on_mesh`).

        A collective: every rank creates the same process groups in the same order."""
        ties = []
        me = dist.get_rank()
        for names in groups:
            per_name = [list(holders[name]) for name in names]
            # The sets of ranks that sum one tie's copies together: the i-th holder of every name.
            pairs = [sorted(set(ranks)) for ranks in zip(*per_name)]
            group = None
            if any(len(pair) > 1 for pair in pairs):
                group, _ = dist.new_subgroups_by_enumeration(pairs)  # type: ignore[no-untyped-call]  # torch
            copies = _local_copies(names, parts)
            if group is None and len(_distinct(copies)) < 2:
                continue  # one parameter on this rank: retie already made the names one
            source = next((ranks[0] for ranks in zip(*per_name) if me in ranks), None)
            ties.append(_Tie(list(names), copies, group, source))
        return cls(ties, pairing)

    @property
    def alias_copies(self) -> set[int]:
        """``id`` of every copy held under a name other than its tie's first (counted once: not in a norm)."""
        return {id(p) for tie in self.ties for name, p in tie.copies if name != tie.names[0]
                and all(p is not q for n, q in tie.copies if n == tie.names[0])}

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Every copy's gradient becomes the sum over all copies (call once per optimizer step)."""
        for tie in self.ties:
            grads = [p.grad for _, p in _distinct(tie.copies)]
            if all(not p.requires_grad for _, p in _distinct(tie.copies)):
                continue  # frozen (LoRA's base weights): no gradient on any stage
            if any(g is None for g in grads):
                raise RuntimeError(f"the tied parameter {tie.names} has no gradient on one of its stages")
            held = [g for g in grads if g is not None]  # all of them, as just checked
            if self.pairing == "shards":
                total = _local(held[0]).clone()
                for g in held[1:]:
                    total += _local(g)
                if tie.group is not None:
                    dist.all_reduce(total, group=tie.group)
                for g in held:
                    _local(g).copy_(total)
            else:
                total = cast(torch.Tensor, sum(_whole(g) for g in held))  # not 0: a tie has copies
                if tie.group is not None:
                    dist.all_reduce(total, group=tie.group)
                for g in held:
                    _local(g).copy_(_block(total, g))

    @torch.no_grad()
    def copy_values(self) -> None:
        """Every copy takes the first name's values (after initialisation or a load that filled
        the first name only)."""
        for tie in self.ties:
            params = [p for _, p in _distinct(tie.copies)]
            first = next((p for n, p in tie.copies if n == tie.names[0]), None)
            if self.pairing == "shards":
                value = _local(first).clone() if first is not None else torch.empty_like(_local(params[0]))
                if tie.group is not None:
                    dist.broadcast(value, src=tie.source, group=tie.group)
                for p in params:
                    _local(p).copy_(value)
            else:
                value = _whole(first) if first is not None else torch.empty(params[0].shape, dtype=params[0].dtype,
                                                                             device=_local(params[0]).device)
                if tie.group is not None:
                    dist.broadcast(value, src=tie.source, group=tie.group)
                for p in params:
                    _local(p).copy_(_block(value, p))


def holders_on_mesh(groups: Sequence[Sequence[str]], plan: ParallelPlan, mesh: DeviceMesh) -> dict[str, list[int]]:
    """For each tied name, the global ranks holding its stage on one mesh with a pp axis, ordered
    by the coordinate off the pp axis (so the ``i``-th holders of every name hold the same shard)."""
    pp = plan.pipeline
    assert pp is not None and mesh.mesh_dim_names is not None, "a pipeline's mesh, with named axes"
    axis = mesh.mesh_dim_names.index(pp.dim)
    rows = torch.movedim(mesh.mesh, axis, -1).reshape(-1, mesh.size(axis))  # [coordinate off pp, pp rank]
    return {name: rows[:, pp.stage_ranks[plan.stage_of(name)]].tolist() for names in groups for name in names}


def _local_copies(names: Sequence[str], parts: Sequence[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    copies = []
    for part in parts:
        held = dict(part.named_parameters(remove_duplicate=False))
        copies += [(name, held[name]) for name in names if name in held]
    return copies


def _distinct(copies: list[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
    seen: set[int] = set()
    out = []
    for name, p in copies:
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The full value (a collective over the tensor's stage mesh when it is a DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _block(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's block of ``full`` in ``like``'s layout (a local slice: no communication)."""
    if not isinstance(like, DTensor):
        return full
    replicated = DTensor.from_local(full, like.device_mesh, [Replicate()] * like.device_mesh.ndim, run_check=False)
    return replicated.redistribute(like.device_mesh, like.placements).to_local()
