"""Checks of :func:`parallel.reshard.transfer.reshard` that run inside the 8 worker processes of one launch
(see ``dist_harness``; the parent test is ``test_reshard.py``).

Every rank draws the same cases from one seeded RNG: random meshes (1-D, 2-D, 3-D, 1 to 8 ranks,
random subsets and orders of the world, size-1 axes included), random placements (Shard on any
dim, Replicate, Partial) and uneven shapes, dims smaller than the number of shards and empty dims
included. Values are small integers in float32, so Partial sums are exact and a destination piece
can be compared bit for bit with the one computed here, independently of the plan, by chunking the
full tensor the way DTensor does (:func:`reference_piece`, itself checked against
``distribute_tensor`` in :func:`dtensor_parity`).
"""

from __future__ import annotations

import math
import random

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from parallel.reshard.transfer import MeshLayout, plan_reshard, reshard

SEED = 20240611
NUM_RANDOM_CASES = 1200


def reference_piece(full: torch.Tensor, mesh_shape, coordinate, placements) -> torch.Tensor:
    """The local piece DTensor keeps at ``coordinate``: mesh axes in order, each Shard(d) takes
    chunk ``coordinate[axis]`` of ``torch.chunk`` along d, empty when torch.chunk makes fewer
    chunks than ranks (DTensor pads the list with empty shards)."""
    piece = full
    for axis, placement in enumerate(placements):
        if isinstance(placement, Shard):
            chunks = torch.chunk(piece, mesh_shape[axis], dim=placement.dim) if piece.size(placement.dim) else ()
            index = coordinate[axis]
            piece = chunks[index] if index < len(chunks) else piece.narrow(placement.dim, 0, 0)
    return piece


class ByteCounter:
    """Wraps ``dist.batch_isend_irecv`` to count the bytes this rank really posts to send and
    receive, so the test measures the wire and does not read the plan back."""

    def __init__(self) -> None:
        self.sent = self.received = 0
        self._original = dist.batch_isend_irecv

        def counting(ops):
            for op in ops:
                nbytes = op.tensor.numel() * op.tensor.element_size()
                if op.op is dist.irecv:
                    self.received += nbytes
                else:
                    self.sent += nbytes
            return self._original(ops)

        dist.batch_isend_irecv = counting

    def reset(self) -> None:
        self.sent = self.received = 0

    def close(self) -> None:
        dist.batch_isend_irecv = self._original


def _random_mesh_shape(rng: random.Random, num_ranks: int) -> tuple[int, ...]:
    ndim = rng.choice([1, 2, 3])
    shape = [1] * ndim
    for prime in (2, 2, 2, 3, 5, 7):  # the prime factors of 1..8, each given to a random axis
        if num_ranks % prime == 0:
            num_ranks //= prime
            shape[rng.randrange(ndim)] *= prime
    return tuple(shape)


def _random_layout(rng: random.Random, world_size: int, ndim: int) -> MeshLayout:
    num_ranks = rng.randint(1, world_size)
    mesh_shape = _random_mesh_shape(rng, num_ranks)
    ranks = torch.tensor(rng.sample(range(world_size), num_ranks)).reshape(mesh_shape)
    kinds = [Replicate(), Partial()] + [Shard(d) for d in range(ndim)]
    return MeshLayout(ranks, tuple(rng.choice(kinds) for _ in mesh_shape))


def _random_shape(rng: random.Random) -> tuple[int, ...]:
    return tuple(0 if rng.random() < 0.04 else rng.randint(1, 9) for _ in range(rng.randint(1, 3)))


def _coordinate(layout: MeshLayout, rank: int) -> tuple[int, ...]:
    return layout.coordinates()[layout.flat_ranks.index(rank)]


def _contributions(generator: torch.Generator, shape, layout: MeshLayout) -> list[torch.Tensor]:
    """One full tensor per partial index of ``layout`` (one when it has no Partial axis)."""
    count = math.prod(layout.mesh_shape[axis] for axis in layout.axes_of(Partial))
    return [torch.randint(-50, 50, shape, generator=generator).float() for _ in range(count)]


def _partial_index(layout: MeshLayout, coordinate) -> int:
    index = 0
    for axis in layout.axes_of(Partial):
        index = index * layout.mesh_shape[axis] + coordinate[axis]
    return index


def run_case(rank: int, global_shape, src: MeshLayout, dst: MeshLayout, seed: int, counter: ByteCounter) -> str | None:
    """Reshard one case; None when this rank's result and byte counts are right, else why not."""
    generator = torch.Generator().manual_seed(seed)
    contributions = _contributions(generator, global_shape, src)
    local = None
    if rank in src.flat_ranks:
        coordinate = _coordinate(src, rank)
        local = reference_piece(contributions[_partial_index(src, coordinate)], src.mesh_shape, coordinate,
                                src.placements).clone()
    counter.reset()
    out = reshard(local, global_shape=global_shape, dtype=torch.float32, src=src, dst=dst)
    plan = plan_reshard(global_shape=global_shape, src=src, dst=dst, itemsize=4)
    if (counter.received, counter.sent) != (plan.bytes_received_by(rank), plan.bytes_sent_by(rank)):
        return f"bytes received/sent {counter.received}/{counter.sent}, plan {plan.bytes_received_by(rank)}/{plan.bytes_sent_by(rank)}"
    if rank not in dst.flat_ranks:
        return None if out is None else "a rank outside dst got a tensor"
    coordinate = _coordinate(dst, rank)
    expected = reference_piece(torch.stack(contributions).sum(0), dst.mesh_shape, coordinate, dst.placements)
    if any(coordinate[axis] for axis in dst.axes_of(Partial)):
        expected = torch.zeros_like(expected)  # Partial destination: the value lives on coordinate 0
    if out is None or out.shape != expected.shape or out.dtype != expected.dtype:
        return f"got {None if out is None else (tuple(out.shape), out.dtype)}, expected {tuple(expected.shape)}"
    if not torch.equal(out.contiguous().view(torch.int32), expected.contiguous().view(torch.int32)):
        return "values differ"
    return None


def random_cases(*, rank: int, world_size: int) -> dict:
    """NUM_RANDOM_CASES seeded cases; counts of what this rank checked and the first failures."""
    rng = random.Random(SEED)
    counter = ByteCounter()
    failures, num_dst, num_partial_src, num_partial_dst, num_disjoint = [], 0, 0, 0, 0
    try:
        for case in range(NUM_RANDOM_CASES):
            global_shape = _random_shape(rng)
            src, dst = _random_layout(rng, world_size, len(global_shape)), _random_layout(rng, world_size, len(global_shape))
            if rank not in src.flat_ranks and rank not in dst.flat_ranks:
                continue  # ranks in neither mesh need not call: they skip, as callers may
            error = run_case(rank, global_shape, src, dst, SEED + case, counter)
            if error is not None:
                failures.append(f"case {case}: {global_shape} {src} -> {dst}: {error}")
            num_dst += rank in dst.flat_ranks
            num_partial_src += bool(src.axes_of(Partial))
            num_partial_dst += bool(dst.axes_of(Partial))
            num_disjoint += not set(src.flat_ranks) & set(dst.flat_ranks)
    finally:
        counter.close()
    return {"num_cases": NUM_RANDOM_CASES, "num_dst_checks": num_dst, "num_failures": len(failures),
            "failures": failures[:5], "num_partial_src": num_partial_src, "num_partial_dst": num_partial_dst,
            "num_disjoint": num_disjoint}


def dtensor_parity(*, rank: int, world_size: int) -> dict:
    """On the world mesh (1-D, 2-D, 3-D), reshard gives DTensor.redistribute's local tensor, and
    :func:`reference_piece` gives distribute_tensor's (so the reference is DTensor's semantics)."""
    rng = random.Random(SEED + 1)
    meshes = [init_device_mesh("cpu", shape) for shape in ((world_size,), (2, world_size // 2), (2, 2, world_size // 4))]
    num_checked, mismatches = 0, []
    for case in range(24):
        mesh = meshes[case % 3]
        global_shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3)))
        kinds = [Replicate()] + [Shard(d) for d in range(len(global_shape))]
        src_placements = tuple(rng.choice(kinds + [Partial()]) for _ in range(mesh.ndim))
        dst_placements = tuple(rng.choice(kinds) for _ in range(mesh.ndim))  # DTensor's Partial target divides
        src = MeshLayout.from_device_mesh(mesh, src_placements)
        dst = MeshLayout.from_device_mesh(mesh, dst_placements)
        coordinate = tuple(mesh.get_coordinate())
        full = torch.randint(-50, 50, global_shape, generator=torch.Generator().manual_seed(case)).float()
        if src.axes_of(Partial):
            # Each partial index holds a different contribution; the value is their sum.
            contributions = _contributions(torch.Generator().manual_seed(case), global_shape, src)
            local = reference_piece(contributions[_partial_index(src, coordinate)], mesh.shape, coordinate, src_placements)
            sharded = DTensor.from_local(local, mesh, src_placements, run_check=False, shape=torch.Size(global_shape),
                                         stride=torch.empty(global_shape).stride())
        else:
            sharded = distribute_tensor(full, mesh, src_placements, src_data_rank=None)
            if not torch.equal(sharded.to_local(), reference_piece(full, mesh.shape, coordinate, src_placements)):
                mismatches.append(f"reference piece != distribute_tensor for {global_shape} {src}")
        expected = sharded.redistribute(mesh, dst_placements).to_local()
        out = reshard(sharded.to_local(), global_shape=global_shape, dtype=torch.float32, src=src, dst=dst)
        if not torch.equal(out, expected):
            mismatches.append(f"{global_shape} {src} -> {dst}: reshard != DTensor.redistribute")
        num_checked += 1
    return {"num_checked": num_checked, "mismatches": mismatches}


SUITES = {"eight_rank": [("random_cases", random_cases), ("dtensor_parity", dtensor_parity)]}
