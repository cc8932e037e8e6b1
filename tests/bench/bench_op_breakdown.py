"""Where a published row's predicted compute goes: one micro-batch on the busiest pp rank, per unit kind
(a block, the head, the embedding, the final norm) and op kind (GEMM, flash attention, the rest).

    python tests/bench/bench_op_breakdown.py megatron2024-h100-177B
    python tests/bench/bench_op_breakdown.py korthikanti2022-530B-seqsel --ops   # also the costliest ops

The row is written as bench_profiles.py writes it; every op is priced as
:func:`trainer.planner.cost.device.device_unit_costs` prices it (the same :class:`_Pricer`), and the
achieved rate of each GEMM kind is printed beside its seconds, so a profile's GEMM share, its size
curve and wave quantisation can be read at the row's own shapes.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_profiles  # noqa: E402
import published  # noqa: E402

from parallel.plan.resolve import resolve_plan  # noqa: E402
from trainer.models import build_model  # noqa: E402
from trainer.planner.cost.device import DeviceCost, _Pricer  # noqa: E402
from trainer.planner.cost.speed import DeviceSpeed  # noqa: E402
from trainer.planner.cost.model import _FLASH_CPU, unit_pass  # noqa: E402
from trainer.planner.cost.reference import rank_units  # noqa: E402


def breakdown(name: str) -> tuple[dict, dict, list[str]]:
    """``({(unit kind, op kind): [seconds, FLOPs]}, {(unit kind, phase, op): [seconds, FLOPs, calls]},
    the busiest rank's units)`` of one micro-batch of row ``name``."""
    row = next(r for r in published.rows() if r.name == name)
    cfg = bench_profiles.row_config(row)
    model = build_model(cfg.model, device="meta")
    plan = resolve_plan(cfg.parallel, cfg.mesh, model)
    speed = DeviceSpeed.of(cfg.hardware, cfg.train.precision, compiled=cfg.train.compile)
    kinds: dict = defaultdict(lambda: [0.0, 0.0])
    ops: dict = defaultdict(lambda: [0.0, 0.0, 0])

    class Recorder(_Pricer):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            unit, phase = self.where()
            cost = self.costs[unit]
            before = (cost.forward_s + cost.backward_s, cost.forward_flops + cost.backward_flops)
            out = super().__torch_dispatch__(func, types, args, kwargs)
            seconds = cost.forward_s + cost.backward_s - before[0]
            flops = cost.forward_flops + cost.backward_flops - before[1]
            if seconds:
                kind = "block" if unit in plan.blocks else unit
                op = "flash" if func in _FLASH_CPU else "gemm" if flops else "other"
                kinds[(kind, op)][0] += seconds
                kinds[(kind, op)][1] += flops
                entry = ops[(kind, phase, func.overloadpacket.__name__)]
                entry[0], entry[1], entry[2] = entry[0] + seconds, entry[1] + flops, entry[2] + 1
            return out

    costs: dict = defaultdict(DeviceCost)
    unit_pass(cfg, plan, cfg.micro_batch_size, lambda where: Recorder(costs, speed, where), model=model)
    held = max(rank_units(plan), key=lambda units: sum(costs[u].forward_s + costs[u].backward_s for u in units))
    blocks = sum(u in plan.blocks for u in held)
    scale = {k: (blocks / max(1, len(plan.blocks)) if k[0] == "block" else float(k[0] in held)) for k in kinds}
    return {k: [v[0] * scale[k], v[1] * scale[k]] for k, v in kinds.items() if scale[k]}, dict(ops), held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("row", help="a row name of tests/bench/published.py")
    parser.add_argument("--ops", action="store_true", help="also list the costliest ops (all blocks together)")
    args = parser.parse_args()
    kinds, ops, held = breakdown(args.row)
    total = sum(s for s, _ in kinds.values())
    blocks = sum(u.startswith("layers.") for u in held)
    print(f"{args.row}: one micro-batch on the busiest pp rank ({blocks} blocks + "
          f"{[u for u in held if not u.startswith('layers.')]})")
    for (unit, op), (seconds, flops) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        rate = f"{flops / seconds / 1e12:7.1f} TFLOP/s" if flops else ""
        print(f"  {unit:>14} {op:>6} {seconds * 1e3:10.3f} ms {seconds / total:6.1%} {rate}")
    print(f"  {'total':>21} {total * 1e3:10.3f} ms")
    if args.ops:
        for (unit, phase, op), (seconds, _flops, calls) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:20]:
            print(f"  {unit:>14} {phase:>8} {op:>52} x{calls:<4} {seconds * 1e3:9.3f} ms")


if __name__ == "__main__":
    main()
