"""Calibrate the cost model on this host: how fast its workers compute and communicate.

A short probe (10-30 s) runs as many worker processes as a run will start on this host, at the
same time (on CPU they share the cores, so one worker's throughput depends on how many run), and
measures, each as ``time = latency + size / rate`` fitted over several sizes:

* matmul throughput per compute dtype (fp32; bf16 where the device supports it natively), at
  shapes like a decoder's projections;
* elementwise throughput (norms, activations, AdamW: bytes read and written per second);
* all_reduce, all_gather, reduce_scatter per group size the candidate meshes need, and send/recv
  between two ranks (gloo on CPU, nccl on GPUs).

The result is cached as JSON per host, device and worker count (``~/.cache/meshflow/calibration``,
or ``$MESHFLOW_CACHE_DIR``), so only the first plan on a host pays for it::

    python -m trainer.calibrate mesh=[8]            # probe with 8 workers (or read the cache)
    python -m trainer.calibrate mesh=[8] --force    # probe again

    cal = load_or_probe(workers=8, group_sizes=[2, 4, 8])
    cal.matmul_time("fp32", 2 * 512 * 64 * 172)     # seconds for one such matmul on one worker
    cal.collective_time("all_reduce", 4, 2**20)     # seconds to all-reduce 1 MiB over 4 ranks
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import socket
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from trainer.config.compose import compose_dict
from trainer.config.schema import RunConfig
from trainer.planner.calibration.framework import (
    pipeline_costs,
    probe_dtensor,
    probe_framework,
    probe_reference,
    probe_steps,
    reference_prediction,
    step_efficiency,
)
from trainer.planner.calibration.processes import RESULT, run_bound
from trainer.planner.calibration.timing import MIN_SECONDS, timed, timed_together
from trainer.planner.cost.calibration import COLLECTIVES, SCHEMA_VERSION, Calibration, Fit, fit_line

# (m, k, n) of the probe's matmuls: a decoder's projections from tiny (dim 64) to small (dim 512, ffn 1376),
# m being the tokens of a micro-batch; small ones measure the per-call overhead, large ones the throughput.
MATMUL_SHAPES = ((256, 64, 64), (512, 64, 172), (512, 256, 256), (1024, 512, 512), (1024, 512, 1376))
ELEMENTWISE_NUMEL = (2**12, 2**16, 2**20)
COLLECTIVE_BYTES = (2**12, 2**16, 2**20, 2**22)


# ------------------------------------------------------------------------- the probe


def bf16_supported(device: torch.device) -> bool:
    """Native bf16 matmuls: a GPU that has them, or a CPU with AVX512-BF16 / AMX (oneDNN's check)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _probe_compute(device: torch.device, dtypes: list[str]) -> dict:
    out: dict = {"matmul": {}, "elementwise": None}
    for name in dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        flops, secs = [], []
        for m, k, n in MATMUL_SHAPES:
            a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
            flops.append(2.0 * m * k * n)
            secs.append(timed(lambda: torch.mm(a, b)))
        out["matmul"][name] = (flops, secs)
    nbytes, secs = [], []
    for numel in ELEMENTWISE_NUMEL:
        x, y = torch.randn(numel, device=device), torch.randn(numel, device=device)
        nbytes.append(3.0 * 4 * numel)  # two reads, one write
        secs.append(timed(lambda: torch.add(x, y)))
    out["elementwise"] = (nbytes, secs)

    out["framework"] = probe_framework(device)
    out["reference_s"] = probe_reference(device)
    return out


def _probe_collectives(rank: int, workers: int, group_sizes: list[int], device: torch.device) -> dict:
    """Every group of a size runs at once (blocks of consecutive ranks), as a mesh axis's groups do."""
    import torch.distributed as dist

    out: dict = {op: {} for op in COLLECTIVES}
    for size in group_sizes:
        groups = [dist.new_group(list(range(start, start + size))) for start in range(0, workers, size)]
        group = groups[rank // size]
        for op in COLLECTIVES:
            if op == "send_recv" and size != 2:
                continue  # point to point: one pair is all it needs
            secs = []
            for nbytes in COLLECTIVE_BYTES:
                numel = nbytes // 4
                full = torch.zeros(numel - numel % size, device=device)
                part = torch.zeros(full.numel() // size, device=device)
                peer = rank ^ 1  # pairs (0, 1), (2, 3), ...

                def call(op=op):
                    if op == "all_reduce":
                        dist.all_reduce(full, group=group)
                    elif op == "all_gather":
                        dist.all_gather_into_tensor(full, part, group=group)
                    elif op == "reduce_scatter":
                        dist.reduce_scatter_tensor(part, full, group=group)
                    elif rank % 2 == 0:  # one message each way, so both ranks time the same work
                        dist.send(full, peer), dist.recv(full, peer)
                    else:
                        dist.recv(full, peer), dist.send(full, peer)

                seconds = timed_together(call, min_s=MIN_SECONDS / 2)
                secs.append(seconds / (2 if op == "send_recv" else 1))
            out[op][size] = (list(COLLECTIVE_BYTES), secs)
    return out


def _worker(rank: int, tmp: str, workers: int, group_sizes: list[int], dtypes: list[str], device_type: str) -> None:
    import warnings

    import torch.distributed as dist

    store_path, result_path = str(Path(tmp) / "store"), str(Path(tmp) / RESULT)

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch renames *_tensor collectives: noise here
    torch.set_num_threads(1)  # as the launcher's workers run (trainer.launch.worker_main)
    device = (torch.device(device_type, rank % max(1, torch.cuda.device_count())) if device_type == "cuda"
              else torch.device("cpu"))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store_path}",
                            rank=rank, world_size=workers)
    try:
        dist.barrier()  # every worker computes at the same time: that is what they share
        compute = _probe_compute(device, dtypes)

        compute["dtensor"] = probe_dtensor(device, workers)
        compute["steps"] = probe_steps(device, workers)
        comm = _probe_collectives(rank, workers, group_sizes, device) if workers > 1 else {}
        gathered: list = [None] * workers
        dist.all_gather_object(gathered, (compute, comm))
        if rank == 0:
            Path(result_path).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def _median_fit(per_rank: list[tuple[list, list]]) -> Fit:
    sizes = per_rank[0][0]
    return fit_line(sizes, [statistics.median(r[1][i] for r in per_rank) for i in range(len(sizes))])


def probe(workers: int, group_sizes: list[int], *, device_type: str = "cpu") -> Calibration:
    """Run the probe with ``workers`` processes (spawned, and ending with this one:
    :mod:`trainer.planner.calibration.processes`; one in this process) and fit it."""
    began = time.monotonic()
    device = torch.device("cuda" if device_type == "cuda" else "cpu")
    dtypes = ["fp32"] + (["bf16"] if bf16_supported(device) else [])
    sizes = sorted({g for g in group_sizes if 1 < g <= workers and workers % g == 0} | ({2} if workers % 2 == 0
                                                                                        else set()))
    if workers == 1:  # one device trains in the launcher's own process, with its default threads
        rows: list[tuple[dict, dict]] = [(_probe_compute(device, dtypes), {})]
    else:
        rows = json.loads(run_bound(_worker, nprocs=workers, args=(workers, sizes, dtypes, device_type)))
    compute = [r[0] for r in rows]
    collectives = {op: {int(g): _median_fit([r[1][op][g] for r in rows]) for g in rows[0][1][op]}
                   for op in COLLECTIVES} if workers > 1 else {op: {} for op in COLLECTIVES}
    cal = Calibration(
        host=socket.gethostname(), device=_device_name(device), workers=workers,
        matmul={d: _median_fit([c["matmul"][d] for c in compute]) for d in dtypes},
        elementwise=_median_fit([c["elementwise"] for c in compute]), collectives=collectives,
        op_latency_s=statistics.median(c["framework"][0] for c in compute),
        optimizer_tensor_s=statistics.median(c["framework"][1] for c in compute),
        dtensor_linear_s=statistics.median(c["dtensor"][0] for c in compute) if workers > 1 else 0.0,
        optimizer_dtensor_tensor_s=statistics.median(c["dtensor"][1] for c in compute) if workers > 1 else 0.0,
        cores=len(os.sched_getaffinity(0)) if device.type == "cpu" else 0,
        probe_s=time.monotonic() - began, created=time.time())

    measured = statistics.median(c["reference_s"] for c in compute)
    cal = replace(cal, compute_efficiency=measured / reference_prediction(cal))
    steps = {f: statistics.median(c["steps"][f] for c in compute) for f in compute[0].get("steps", {})}
    cal = replace(cal, step_efficiency=step_efficiency(cal, steps))  # the pipelines' residue is taken after it
    action_s, tp_collective_s = pipeline_costs(cal, steps)
    return replace(cal, schedule_action_s=action_s, pipelined_tp_collective_s=tp_collective_s,
                   probe_s=time.monotonic() - began)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(0)}"
    return f"cpu:{torch.backends.cpu.get_cpu_capability()}x{len(os.sched_getaffinity(0))}"


# ------------------------------------------------------------------------- the cache


def cache_dir() -> Path:
    return Path(os.environ.get("MESHFLOW_CACHE_DIR") or Path.home() / ".cache" / "meshflow") / "calibration"


def cache_path(workers: int, device_type: str = "cpu", root: Path | None = None) -> Path:
    device = _device_name(torch.device("cuda" if device_type == "cuda" else "cpu")).replace(":", "-").replace(" ", "_")
    return (root or cache_dir()) / f"{socket.gethostname()}-{device}-w{workers}.json"


@contextmanager
def _one_probe_at_a_time(root: Path) -> Iterator[None]:
    """Hold this cache's probe lock: the probes of one host share its cores, so two at once would
    measure each other, and an identical request waiting here reads the first one's result instead
    of probing beside it. The kernel drops the lock with its process, however that process ends."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".probe.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _cached(path: Path, group_sizes: list[int], workers: int) -> tuple[Calibration | None, list[int]]:
    """The calibration at ``path`` when it answers every group size, else None; and the group sizes
    a new probe should measure (``group_sizes`` and those the cached one had)."""
    try:
        cal = Calibration.from_json(path.read_text())
    except FileNotFoundError:
        return None, group_sizes
    except (ValueError, KeyError, TypeError):
        return None, group_sizes  # an older schema or a broken file: probe again
    needed = {g for g in group_sizes if 1 < g <= workers and workers % g == 0}
    if cal.schema == SCHEMA_VERSION and needed <= set(cal.collectives["all_reduce"]):
        return cal, group_sizes
    return None, sorted(set(group_sizes) | set(cal.collectives["all_reduce"]))


def load_or_probe(workers: int, group_sizes: list[int], *, device_type: str = "cpu", force: bool = False,
                  root: Path | None = None) -> Calibration:
    """The cached calibration for this host, device and worker count, probing (and caching) when
    there is none, when it lacks one of ``group_sizes``, or with ``force``. One probe at a time per
    cache; the file is replaced whole, so a probe cut off (a plan's time limit) leaves the old one or none."""
    path = cache_path(workers, device_type, root)
    if not force and (cal := _cached(path, group_sizes, workers)[0]) is not None:
        return cal
    with _one_probe_at_a_time(path.parent):
        cal, group_sizes = _cached(path, group_sizes, workers)
        if cal is not None and not force:
            return cal  # probed while this one waited for the lock
        cal = probe(workers, group_sizes, device_type=device_type)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(cal.to_json())
        os.replace(partial, path)
    return cal


def describe(cal: Calibration) -> str:
    lines = [f"calibration: {cal.host}, {cal.device}, {cal.workers} worker(s) at once, probe {cal.probe_s:.1f} s"]
    for dtype, fit in cal.matmul.items():
        lines.append(f"  matmul {dtype}: {fit.rate / 1e9:.2f} GFLOP/s per worker, "
                     f"{fit.latency_s * 1e6:.1f} us per call")
    lines.append(f"  elementwise: {cal.elementwise.rate / 1e9:.2f} GB/s per worker, "
                 f"{cal.elementwise.latency_s * 1e6:.1f} us per op")
    lines.append(f"  framework: {cal.op_latency_s * 1e6:.1f} us per op in a module's forward + backward, "
                 f"{cal.optimizer_tensor_s * 1e6:.0f} us per parameter tensor in the optimizer step")
    lines.append(f"  DTensor: +{cal.dtensor_linear_s * 1e6:.0f} us per Linear forward + backward, "
                 f"{cal.optimizer_dtensor_tensor_s * 1e6:.0f} us per parameter in the optimizer step; "
                 f"{cal.cores} cores")
    lines.append(f"  a small decoder's forward + backward takes {cal.compute_efficiency:.2f}x what the fits above "
                 "predict: every prediction is scaled by it")
    if cal.step_efficiency:
        lines.append("  its whole training step, over all workers, takes " + ", ".join(
            f"{r:.2f}x (dp {f})" if f != "tp" else f"{r:.2f}x (tp)" for f, r in cal.step_efficiency.items())
            + " the predicted step: a layout pays each to the share of its degree it uses")
    if cal.schedule_action_s or cal.pipelined_tp_collective_s:
        lines.append(f"  a pipeline's step takes {cal.schedule_action_s * 1e3:.1f} ms more than predicted per "
                     f"schedule action, and {cal.pipelined_tp_collective_s * 1e3:.1f} ms per tp all-reduce of a stage")
    for op, by_size in cal.collectives.items():
        for g, fit in sorted(by_size.items()):
            lines.append(f"  {op} over {g}: {fit.latency_s * 1e6:.0f} us + bytes / {fit.rate / 1e6:.0f} MB/s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Calibrate the auto-planner's cost model on this host.")
    parser.add_argument("--force", action="store_true", help="probe again even when a cached calibration exists")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides naming the run, e.g. mesh=[8]")
    args = parser.parse_args(argv)

    raw = compose_dict(args.overrides)
    mesh = raw.get("mesh")
    world = RunConfig.model_validate({"mesh": mesh}).world_size if mesh is not None else 1
    nnodes = int((raw.get("launch") or {}).get("nnodes", 1))
    device_type = "cuda" if raw.get("device") == "cuda" or (raw.get("device") == "auto"
                                                            and torch.cuda.is_available()) else "cpu"
    workers = max(1, world // nnodes)
    cal = load_or_probe(workers, [g for g in range(2, world + 1) if world % g == 0], device_type=device_type,
                        force=args.force)
    print(describe(cal))
    print(f"cached at {cache_path(workers, device_type)}")


if __name__ == "__main__":
    main()
