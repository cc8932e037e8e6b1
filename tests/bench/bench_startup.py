"""Time to the first step: the README's main command against the floor of any 8-worker job (run by
hand, not part of the default test run).

    python tests/bench/bench_startup.py                 # 3 rounds, 8 workers, MLflow on (a SQLite store)
    python tests/bench/bench_startup.py --rounds 5 --tracking none

Each round runs, one after the other,

- the floor: ``torchrun --standalone --nproc_per_node 8`` of a script that imports torch, joins a
  gloo process group and all-reduces one tensor; timed to rank 0's line after the all-reduce;
- the trainer: ``python -m trainer +parallel=3d mesh=[2,2,2] train.steps=1``, timed to its
  ``step 1/1`` line, with the time of each earlier line kept (its start-up phases).

Both are timed from the process start, in the same working directory (its MLflow store is made
by the first round and reused by the others, as a user's second run does). The table gives each
round's seconds and the ratio trainer / floor; the lines below it, the trainer's phases in the
last round (seconds at which each line appeared; no line means a silent stretch).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLOOR = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
if dist.get_rank() == 0:
    print(f"all_reduce done: {t.item():.0f}", flush=True)
dist.destroy_process_group()
"""
TRAINER = ["+parallel=3d", "mesh=[2,2,2]", "train.steps=1", "train.log_every=1"]


def timed(cmd: list[str], cwd: Path, until: str) -> tuple[float, list[tuple[float, str]]]:
    """Seconds from start to the first line containing ``until``, and every line before it (with its time)."""
    began = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    found = None
    for line in proc.stdout:
        lines.append((time.monotonic() - began, line.rstrip()))
        if found is None and until in line:
            found = lines[-1][0]
    proc.wait()
    if found is None or proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode} without {until!r}:\n"
                         + "\n".join(text for _, text in lines[-30:]))
    return found, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tracking", choices=["mlflow", "none"], default="mlflow")
    args = parser.parse_args()
    trainer = [sys.executable, "-m", "trainer", *TRAINER, *(["tracking=none"] if args.tracking == "none" else [])]
    with tempfile.TemporaryDirectory(prefix="meshflow-startup-") as tmp:
        cwd = Path(tmp)
        (cwd / "floor.py").write_text(FLOOR)
        floor_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "8", "floor.py"]
        rows, phases = [], []
        for r in range(1, args.rounds + 1):
            floor_s, _ = timed(floor_cmd, cwd, "all_reduce done")
            # each round its own checkpoint directory: a run refuses to start over another run's checkpoints
            first_step_s, phases = timed([*trainer, f"train.checkpoint.dir=checkpoints-{r}"], cwd, "step 1/1")
            rows.append((r, floor_s, first_step_s))
            print(f"round {r}: floor {floor_s:.1f} s, trainer {first_step_s:.1f} s", file=sys.stderr, flush=True)
    print(f"time to the first step, 8 workers on {len(os.sched_getaffinity(0))} cores, tracking={args.tracking}")
    print(f"{'round':>5} {'floor s':>8} {'trainer s':>10} {'ratio':>6}")
    for r, floor_s, first_step_s in rows:
        print(f"{r:>5} {floor_s:>8.1f} {first_step_s:>10.1f} {first_step_s / floor_s:>6.2f}")
    floor_m, step_m = statistics.median(f for _, f, _ in rows), statistics.median(s for _, _, s in rows)
    print(f"{'median':>5} {floor_m:>8.1f} {step_m:>10.1f} {step_m / floor_m:>6.2f}")
    print("\nthe trainer's lines in the last round (s from start):")
    for at, text in phases:
        print(f"{at:>7.1f}  {text[:110]}")


if __name__ == "__main__":
    main()
