"""Mesh-to-mesh reshard (``parallel.reshard``) in 8 real gloo processes: bytes on the wire beside
the analytic minimum, the most one rank sends, and seconds per reshard (DTensor.redistribute's
seconds too where both layouts share one mesh, the only case DTensor can do).

    PYTHONPATH=. python tests/bench/bench_reshard.py          # ~1 minute on 2 cores

Bytes are counted on the wire (every ``batch_isend_irecv`` send, summed over ranks), not read from
the plan; the minimum is :func:`parallel.reshard.transfer_plan.minimum_bytes`. Seconds: the median of
``REPEATS`` reshards after one warm-up, each timed from a barrier to the slowest rank's return,
float32 tensors, 8 processes on 2 shared cores over loopback (so time tracks bytes and message
count, not a network). Measured (2 cores shared with other jobs):

    case                                                                           MiB moved  MiB min ratio max sent/rank MiB      s DTensor s
    [0..3] S(0) -> [4..7] R, (1024, 1024)                                              16.00    16.00  1.00              4.00  0.020         -
    [0..3] S(1) -> [4..7] S(1) (stage handoff), (1024, 1024)                            4.00     4.00  1.00              1.00  0.011         -
    [0..7] S(0) -> [0..7] S(1), (1024, 1024)                                            3.50     3.50  1.00              0.44  0.029     0.078
    [0..7] S(0) -> [0..7] R, (1024, 1024)                                              28.00    28.00  1.00              3.50  0.034     0.040
    [[0,1],[2,3]] (S(0),S(1)) -> [0..3] S(0), (1024, 1024)                              2.00     2.00  1.00              0.50  0.009         -
    [0..3] R -> [4..7] S(0), (1024, 1024)                                               4.00     4.00  1.00              1.00  0.011         -
    [[0..3],[4..7]] (S(0),R) -> [[7,6],[5,4],[3,2],[1,0]] (R,S(1)), (1024, 1024)        8.00     8.00  1.00              1.00  0.020         -
    [2,2,2] (S(0),S(1),R) -> [8] S(0), uneven, (1000, 999)                              1.91     1.91  1.00              0.24  0.011         -
    [0..7] S(0) -> [2,5,1] S(1), uneven, (1000, 999)                                    3.33     3.33  1.00              0.48  0.015         -
    [0..3] P -> [4..7] R, (1024, 1024)                                                 64.00    64.00  1.00             16.00  0.174         -
    [0..7] P -> [0..7] S(0), (1024, 1024)                                              28.00    28.00  1.00              3.50  0.028     0.045

Every plan reaches its minimum (ratio 1.00), which for a Partial source is the one-hop minimum:
``[0..3] P -> [4..7] R`` ships all four contributions to each destination (64 MiB, and 16 MiB from
each source); reducing on the source side first (a reduce-scatter, then each rank sending its
reduced quarter) would move 12 + 16 = 28 MiB. DTensor's Shard(0) -> Shard(1) on gloo falls back to
all-gather + chunk (gloo has no all-to-all), hence its slower time.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from tempfile import TemporaryDirectory

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]
from ports import free_port  # noqa: E402  (tests/ is on sys.path now)

from parallel.reshard.transfer import MeshLayout, minimum_bytes, plan_reshard, reshard  # noqa: E402

WORLD_SIZE = 8
REPEATS = 5
S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial()
ALL = list(range(8))
CASES = [  # (name, global shape, src, dst)
    ("[0..3] S(0) -> [4..7] R", (1024, 1024), MeshLayout([0, 1, 2, 3], (S0,)), MeshLayout([4, 5, 6, 7], (R,))),
    ("[0..3] S(1) -> [4..7] S(1) (stage handoff)", (1024, 1024), MeshLayout([0, 1, 2, 3], (S1,)),
     MeshLayout([4, 5, 6, 7], (S1,))),
    ("[0..7] S(0) -> [0..7] S(1)", (1024, 1024), MeshLayout(ALL, (S0,)), MeshLayout(ALL, (S1,))),
    ("[0..7] S(0) -> [0..7] R", (1024, 1024), MeshLayout(ALL, (S0,)), MeshLayout(ALL, (R,))),
    ("[[0,1],[2,3]] (S(0),S(1)) -> [0..3] S(0)", (1024, 1024),
     MeshLayout([[0, 1], [2, 3]], (S0, S1)), MeshLayout([0, 1, 2, 3], (S0,))),
    ("[0..3] R -> [4..7] S(0)", (1024, 1024), MeshLayout([0, 1, 2, 3], (R,)), MeshLayout([4, 5, 6, 7], (S0,))),
    ("[[0..3],[4..7]] (S(0),R) -> [[7,6],[5,4],[3,2],[1,0]] (R,S(1))", (1024, 1024),
     MeshLayout([[0, 1, 2, 3], [4, 5, 6, 7]], (S0, R)), MeshLayout([[7, 6], [5, 4], [3, 2], [1, 0]], (R, S1))),
    ("[2,2,2] (S(0),S(1),R) -> [8] S(0), uneven", (1000, 999),
     MeshLayout([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], (S0, S1, R)), MeshLayout(ALL, (S0,))),
    ("[0..7] S(0) -> [2,5,1] S(1), uneven", (1000, 999), MeshLayout(ALL, (S0,)), MeshLayout([2, 5, 1], (S1,))),
    ("[0..3] P -> [4..7] R", (1024, 1024), MeshLayout([0, 1, 2, 3], (P,)), MeshLayout([4, 5, 6, 7], (R,))),
    ("[0..7] P -> [0..7] S(0)", (1024, 1024), MeshLayout(ALL, (P,)), MeshLayout(ALL, (S0,))),
]


def _local_piece(rank: int, global_shape, layout: MeshLayout) -> torch.Tensor | None:
    boxes = plan_reshard(global_shape=global_shape, src=layout, dst=layout, itemsize=4).src_boxes
    return torch.ones(boxes[rank].shape) if rank in boxes else None


def _timed(fn) -> float:
    """Median seconds of ``fn`` over REPEATS, each from a barrier until every rank has returned."""
    fn()  # warm-up: plan cache, gloo pairs
    seconds = []
    for _ in range(REPEATS):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
                            timeout=timedelta(seconds=300))
    sent = [0]
    original = dist.batch_isend_irecv

    def counting(ops):
        sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return original(ops)

    dist.batch_isend_irecv = counting
    rows = []
    for _name, shape, src, dst in CASES:
        local = _local_piece(rank, shape, src)
        sent[0] = 0
        reshard(local, global_shape=shape, dtype=torch.float32, src=src, dst=dst)
        sent_once = sent[0]
        seconds = _timed(lambda: reshard(local, global_shape=shape, dtype=torch.float32, src=src, dst=dst))
        dtensor_seconds = None
        if src.ranks == dst.ranks and src.flat_ranks == tuple(ALL):  # DTensor: one mesh, here the world's
            mesh = init_device_mesh("cpu", src.mesh_shape)
            sharded = DTensor.from_local(local, mesh, src.placements, run_check=False, shape=torch.Size(shape),
                                         stride=torch.empty(shape).stride())
            dtensor_seconds = _timed(lambda: sharded.redistribute(mesh, dst.placements).to_local())
        rows.append({"sent": sent_once, "seconds": seconds, "dtensor_seconds": dtensor_seconds})
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.barrier()
    os._exit(0)  # as tests/dist/dist_harness.py: skip gloo's teardown


def main() -> None:
    with TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(free_port(), out_dir), nprocs=WORLD_SIZE, join=True, start_method="spawn")
        per_rank = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    mib = 2**20
    header = f"{'case':<78} {'MiB moved':>9} {'MiB min':>8} {'ratio':>5} {'max sent/rank MiB':>17} {'s':>6} {'DTensor s':>9}"
    print(header)
    for index, (name, shape, src, dst) in enumerate(CASES):
        rows = [r[index] for r in per_rank]
        moved = sum(r["sent"] for r in rows)
        minimum = minimum_bytes(global_shape=shape, src=src, dst=dst, itemsize=4)
        ratio = f"{moved / minimum:.2f}" if minimum else "-"
        dtensor = rows[0]["dtensor_seconds"]
        print(f"{name + ', ' + str(shape):<78} {moved / mib:>9.2f} {minimum / mib:>8.2f} {ratio:>5} "
              f"{max(r['sent'] for r in rows) / mib:>17.2f} {rows[0]['seconds']:>6.3f} "
              f"{'-' if dtensor is None else f'{dtensor:.3f}':>9}")


if __name__ == "__main__":
    main()
