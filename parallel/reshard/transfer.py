"""Mesh-to-mesh reshard: a tensor laid out as (mesh A, placements A) becomes (mesh B, placements B).

PaddlePaddle's cross-mesh ``reshard``, which torch lacks (``DTensor.redistribute`` refuses a
different mesh). The two meshes may have any shapes and any sets and orders of global ranks:
overlapping, disjoint or the same. Placements are DTensor's ``Shard(d)``, ``Replicate()`` and
``Partial()`` (sum), with DTensor's shard sizes (uneven allowed). Two pipeline stages with their
own layouts hand activations across this way::

    from torch.distributed.tensor import Partial, Replicate, Shard
    from parallel.reshard.transfer import MeshLayout, reshard

    src = MeshLayout([0, 1], (Shard(0),))                   # stage 0: rows split over ranks 0, 1
    dst = MeshLayout([[2, 3], [4, 5]], (Replicate(), Shard(1)))
    out = reshard(local if rank in (0, 1) else None, global_shape=(8, 6), dtype=torch.float32,
                  src=src, dst=dst)                       # ranks 2..5: their (8, 3) piece; 0, 1: None

Every rank of ``src`` or ``dst`` must call it (point-to-point, so other ranks may call it and get
None, or not call it at all). Each rank computes the same plan (:mod:`parallel.reshard.transfer_plan`),
which moves the analytic minimum of bytes without Partial sources; every pair of ranks exchanges at
most one contiguous buffer, all pairs at once through ``dist.batch_isend_irecv``. With NCCL the
first point-to-point batch on a group is collective over the group: warm it up on every rank.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.distributed as dist

from parallel.reshard.transfer_plan import Box, MeshLayout, ReshardPlan, Transfer, minimum_bytes, plan_reshard

__all__ = ["MeshLayout", "ReshardPlan", "Transfer", "Box", "minimum_bytes", "plan_reshard", "reshard"]


def reshard(
    local: torch.Tensor | None,
    *,
    global_shape: Sequence[int],
    dtype: torch.dtype,
    src: MeshLayout,
    dst: MeshLayout,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor | None:
    """This rank's piece of the tensor in the ``dst`` layout.

    Args:
        local: this rank's piece in the ``src`` layout (shape as DTensor's local tensor); None on
            ranks outside ``src``.
        global_shape: the full tensor's shape.
        dtype: the tensor's dtype; ranks outside ``src`` allocate with it, others check ``local``.
        src, dst: the layouts; ranks are global ranks.
        group: the process group the point-to-point ops use (default: the world).
        device: where the result lives; default ``local``'s device, else CPU.

    Returns:
        The ``dst`` local tensor on ``dst`` ranks (zeros on those that are not value holders of a
        Partial axis, see :mod:`parallel.reshard.transfer_plan`), None elsewhere.
    """
    rank = dist.get_rank()
    itemsize = torch.empty((), dtype=dtype).element_size()
    plan = plan_reshard(global_shape=global_shape, src=src, dst=dst, itemsize=itemsize)
    if device is None:
        device = local.device if local is not None else torch.device("cpu")
    if rank in plan.src_boxes:
        _check_local(local, plan.src_boxes[rank], dtype, rank)
    outgoing: dict[int, list[Transfer]] = defaultdict(list)
    incoming: dict[int, list[Transfer]] = defaultdict(list)
    for transfer in plan.transfers:
        if transfer.is_local:
            continue
        if transfer.src_rank == rank:
            outgoing[transfer.dst_rank].append(transfer)
        if transfer.dst_rank == rank:
            incoming[transfer.src_rank].append(transfer)

    ops = []
    for peer, transfers in outgoing.items():
        assert local is not None, "a sender is in the source mesh, so _check_local saw its piece"
        src_box = plan.src_boxes[rank]
        buffer = torch.cat([local[t.box.slices_within(src_box)].reshape(-1) for t in transfers])
        ops.append(dist.P2POp(dist.isend, buffer, peer, group))
    received = {peer: torch.empty(sum(t.box.numel for t in transfers), dtype=dtype, device=device)
                for peer, transfers in incoming.items()}
    ops.extend(dist.P2POp(dist.irecv, buffer, peer, group) for peer, buffer in received.items())
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    if rank not in plan.dst_boxes:
        return None
    return _assemble(plan, rank, local, received, dtype=dtype, device=device)


def _check_local(local: torch.Tensor | None, box: Box, dtype: torch.dtype, rank: int) -> None:
    if local is None:
        raise ValueError(f"rank {rank} is in the source mesh: pass its local piece of shape {box.shape}, not None")
    if tuple(local.shape) != box.shape or local.dtype != dtype:
        raise ValueError(f"rank {rank}: local piece is {tuple(local.shape)} {local.dtype}; the source layout "
                         f"gives this rank {box.shape} {dtype}")


def _assemble(plan: ReshardPlan, rank: int, local: torch.Tensor | None, received: dict[int, torch.Tensor], *,
              dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """The destination piece from local copies and received buffers, in plan order (the order
    the senders packed their buffers in)."""
    dst_box = plan.dst_boxes[rank]
    out = torch.zeros(dst_box.shape, dtype=dtype, device=device)
    read_offset: dict[int, int] = defaultdict(int)
    for transfer in plan.transfers:
        if transfer.dst_rank != rank:
            continue
        if transfer.is_local:
            assert local is not None, "a local transfer's source is this rank, which holds a piece"
            piece = local[transfer.box.slices_within(plan.src_boxes[rank])]
        else:
            start = read_offset[transfer.src_rank]
            read_offset[transfer.src_rank] = start + transfer.box.numel
            piece = received[transfer.src_rank][start:start + transfer.box.numel].view(transfer.box.shape)
        target = out[transfer.box.slices_within(dst_box)]
        # Partial source: each contribution of a region arrives separately and is summed here;
        # otherwise the pieces tile the region exactly once.
        if plan.sum_contributions:
            target.add_(piece)
        else:
            target.copy_(piece)
    return out
