"""Which link each mesh axis's collectives cross, and what a collective costs on it.

    link = group_link(mesh_shape=[8, 4, 8], dim_names=["dp", "pp", "tp"], axes=["tp"], devices_per_node=8)
    link.kind                                       # "intra": tp's 8 ranks share a node
    collective_seconds(profile, "all_reduce", link, nbytes=64e6)

**Placement.** Torch's rank is the row-major position in the mesh and the launcher gives node ``k``
ranks ``k * devices_per_node ..``, so rank ``r`` lives on node ``r // devices_per_node``: the
innermost dims stay inside a node (tp innermost, as Megatron-LM and torchtitan place it). A group
is the ranks that differ only along ``axes``; :func:`group_link` counts, for every group, how many
of its members share each node: ``local`` members per node on ``nodes`` nodes. A group spread
unevenly (members per node differ) is priced as the finest even split that covers it (``local`` =
the gcd of its per-node counts, ``nodes = group_size / local``), and the worst group of the axis
(the smallest ``local``) stands for all.

**Prices** (``g`` = group_size, ``l`` = local, ``n`` = nodes, ``S`` = nbytes as
:class:`trainer.planner.cost.comm.CommOp` means it: all_reduce's tensor, all_gather's gathered output,
reduce_scatter's full input, send_recv's message, all_to_all's whole send buffer; ``B`` a link's
bandwidth_gb_s * 1e9, ``L`` its latency_us * 1e-6; the faster algorithm is taken):

- *ring* (NCCL's Ring): all_reduce takes ``2(g-1)`` steps, all_gather and reduce_scatter ``g-1``; of
  them ``2(n-1)`` (``n-1``) cross a node boundary and cost ``L_inter``, the others ``L_intra``. Each
  rank moves ``2(g-1)/g * S`` (``(g-1)/g * S``) at the ring's bus bandwidth: ``B_intra`` inside one
  node; across nodes ``min(B_intra, l * B_inter)``, since NCCL runs one ring per NIC and a node's
  ``l`` members use ``l`` NICs in parallel (one NIC per GPU), so the ring goes at the slower link's
  pace. These are the bus-bandwidth factors of nccl-tests (doc/PERFORMANCE.md: busbw = algbw *
  2(n-1)/n for all_reduce, (n-1)/n for all_gather and reduce_scatter), which is what a link's
  bandwidth_gb_s states.
- *tree* (all_reduce only; NCCL's Tree across nodes): latency ``2((l-1) L_intra + ceil(log2 n) L_inter)``,
  bandwidth ``S / (0.46 * bus)``: NCCL's tuning model (src/graph/tuning.cc) gives Tree all_reduce an
  algorithm bandwidth of ``0.5 * 0.92 * busBw`` (each byte goes up and down the tree, at 92%).
  Inside one node NCCL's tree is a chain, no faster than the ring.
- *hierarchical* (a group with ``l > 1`` and ``n > 1``): a reduce-scatter among a node's ``l``
  members, the inter-node collective among ``n`` nodes on ``1/l`` of the data over the ``l`` NICs
  at once, an all-gather back among the ``l`` (all_gather: inter-node first, then intra;
  reduce_scatter: intra first, then inter): the phases' ring costs add.
- *send_recv*: ``L + S / B`` of the link the message crosses; a group whose members span nodes
  (a pipeline whose neighbours sit on other nodes) crosses ``inter_node`` at its worst hop.
- *all_to_all*: pairwise exchanges, ``l-1`` peers on the node and ``g-l`` off it; each rank sends
  ``S/g`` to every peer, the on-node part over NVLink while the off-node part goes through its one
  NIC: ``(l-1) L_intra + (g-l) L_inter + max((l-1)/g * S / B_intra, (g-l)/g * S / B_inter)``.

Latency per step is NCCL's per-hop hardware latency of the Simple protocol (the one large messages
use); its fixed per-call base (8.4 us) is left out. Sources: NCCL's environment and tuning docs,
nccl-tests' doc/PERFORMANCE.md, src/graph/tuning.cc (github.com/NVIDIA/nccl).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from trainer.config.hardware import HardwareProfile, Link

OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all")
TREE_EFFICIENCY = 0.5 * 0.92  # NCCL Tree all_reduce: algBw = busBw * 0.92 (tree refinement) * 0.5 (up and down)


@dataclass(frozen=True)
class AxisLink:
    """Where one process group over mesh ``axes`` lives: ``local`` members on each of ``nodes`` nodes."""

    axes: tuple[str, ...]
    group_size: int
    local: int
    nodes: int

    @property
    def kind(self) -> str:
        """``intra`` (one node), ``inter`` (one member per node) or ``hierarchical`` (both > 1)."""
        if self.nodes == 1:
            return "intra"
        return "inter" if self.local == 1 else "hierarchical"


def group_link(mesh_shape: Sequence[int], dim_names: Sequence[str], axes: Sequence[str],
               devices_per_node: int) -> AxisLink:
    """The :class:`AxisLink` of the groups over ``axes`` (several dims: one group over all of them) in a
    row-major mesh of ``mesh_shape`` with ``devices_per_node`` ranks per node (the ranks a node runs:
    world size / launch.nnodes, at most the profile's devices_per_node)."""
    unknown = [a for a in axes if a not in dim_names]
    if unknown or not axes:
        raise ValueError(f"axes {list(axes)} must be a non-empty subset of the mesh dims {list(dim_names)}")
    if devices_per_node < 1:
        raise ValueError(f"devices_per_node must be >= 1, got {devices_per_node}")
    dims = tuple(sorted({list(dim_names).index(a) for a in axes}))
    local, nodes = _placement(tuple(int(s) for s in mesh_shape), dims, int(devices_per_node))
    return AxisLink(axes=tuple(axes), group_size=local * nodes, local=local, nodes=nodes)


@lru_cache(maxsize=4096)
def _placement(shape: tuple[int, ...], dims: tuple[int, ...], per_node: int) -> tuple[int, int]:
    """(local, nodes) of the worst group along ``dims``: see the module docstring."""
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    group_offsets = [0]
    for d in dims:  # every member's offset from the group's first rank
        group_offsets = [o + k * strides[d] for o in group_offsets for k in range(shape[d])]
    other = [i for i in range(len(shape)) if i not in dims]
    starts = [0]
    for d in other:  # the first rank of every group
        starts = [s + k * strides[d] for s in starts for k in range(shape[d])]
    g = len(group_offsets)
    local = g
    for start in starts:
        counts = Counter((start + o) // per_node for o in group_offsets).values()
        local = min(local, math.gcd(*counts))
        if local == 1:
            break
    return local, g // local


def collective_seconds(profile: HardwareProfile, op: str, link: AxisLink, nbytes: float) -> float:
    """Seconds one ``op`` of ``nbytes`` takes over ``link`` on ``profile``'s links (formulas: module docstring)."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; known: {list(OPS)}")
    if profile.intra_node is None or (link.nodes > 1 and profile.inter_node is None):
        raise ValueError(f"hardware profile {profile.name!r} states no intra_node / inter_node link")
    g, local, nodes = link.group_size, link.local, link.nodes
    if g <= 1 or nbytes <= 0:
        return 0.0
    # Only multi-node groups read ``inter``, and for them the check above found it: a single node's stands in.
    intra = profile.intra_node
    inter = profile.inter_node if profile.inter_node is not None else intra
    if op == "send_recv":
        hop = intra if nodes == 1 else inter
        return _lat(hop) + nbytes / _bw(hop)
    if op == "all_to_all":
        off_node = g - local
        bandwidth = max((local - 1) / g * nbytes / _bw(intra), off_node / g * nbytes / _bw(inter) if off_node else 0.0)
        return (local - 1) * _lat(intra) + (off_node * _lat(inter) if off_node else 0.0) + bandwidth
    candidates = [_ring(op, g, nodes, nbytes, intra, inter, local)]
    if op == "all_reduce" and nodes > 1:
        bus = min(_bw(intra), local * _bw(inter))
        latency = 2 * ((local - 1) * _lat(intra) + math.ceil(math.log2(nodes)) * _lat(inter))
        candidates.append(latency + nbytes / (TREE_EFFICIENCY * bus))
    if local > 1 and nodes > 1:
        candidates.append(_hierarchical(op, local, nodes, nbytes, intra, inter))
    return min(candidates)


def _ring(op: str, g: int, nodes: int, nbytes: float, intra: Link, inter: Link, local: int) -> float:
    """A flat ring over ``g`` ranks on ``nodes`` nodes (``local`` per node)."""
    factor = 2 if op == "all_reduce" else 1
    steps, inter_steps = factor * (g - 1), factor * (nodes - 1)
    bus = _bw(intra) if nodes == 1 else min(_bw(intra), local * _bw(inter))
    latency = (steps - inter_steps) * _lat(intra) + (inter_steps * _lat(inter) if inter_steps else 0.0)
    return latency + factor * (g - 1) / g * nbytes / bus


def _hierarchical(op: str, local: int, nodes: int, nbytes: float, intra: Link, inter: Link) -> float:
    """Intra-node phase(s) among ``local`` ranks, the inter-node phase among ``nodes`` on 1/local of the data."""
    inside = 2 if op == "all_reduce" else 1  # all_reduce: reduce-scatter before, all-gather after
    intra_s = inside * ((local - 1) * _lat(intra) + (local - 1) / local * nbytes / _bw(intra))
    factor = 2 if op == "all_reduce" else 1
    inter_s = factor * (nodes - 1) * _lat(inter) + factor * (nodes - 1) / nodes * (nbytes / local) / _bw(inter)
    return intra_s + inter_s


def _bw(link: Link) -> float:
    return link.bandwidth_gb_s * 1e9


def _lat(link: Link) -> float:
    return link.latency_us * 1e-6
