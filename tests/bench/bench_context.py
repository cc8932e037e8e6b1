"""Context parallelism on 8 workers: the longest sequence each cp size trains under a memory budget,
tokens/s at a fixed length, and the K/V bytes a cp rank sends against the plan's.

    python tests/bench/bench_context.py              # 393-751 s on 2 cores shared with other jobs
    python tests/bench/bench_context.py --cp 2 8     # some cp sizes

The model is gpt_debug (4 layers, dim 64, 4 query heads over 2 kv heads, fp32), the workers 8, the
layout dp x cp with one row per data-parallel group (a long-context run: ``8 / cp`` rows a step):
cp 1 is fsdp [8], cp 2 fsdp x cp [4, 2], cp 4 [2, 4], cp 8 cp [8] (FSDP over dp x cp in all).

* longest: the trainer's own budget check (``launch.memory_budget_gb``, the plan's predicted peak
  per worker) bisected over ``train.seq_len`` in steps of ``STEP`` tokens; then that length trains
  3 steps for real (``python -m trainer``), which prints its measured peak per worker.
* tokens/s and K/V bytes: one launch of 8 gloo processes builds each layout at ``FIXED`` tokens with
  the trainer's ``build_parallel_model``, runs 3 steps on seeded random rows (each rank its dp rows,
  its cp chunks), times steps 2-3, and counts the bytes each rank sends on the cp axis by point-to-point
  (the ring's K/V hops and their gradients: FSDP over cp moves its shards by collectives, counted
  apart) with ``bench_parallel``'s counter; the plan's figure is ``trainer.planner.numbers``'s
  ``cp K/V`` traffic.

Recorded 2026-11-27 on the 2-core machine, load average 5-7 from other jobs the whole time (so
tokens/s is noise-bound; memory is not), budget 0.15 GiB per worker, bisection in steps of 1,024 (393 s)::

     cp rows longest seq_len trained predicted MiB peak MiB tokens/s  K/V MiB plan MiB
      1    8           3,072     yes           144      122    4,060     0.00     0.00
      2    4           7,168     yes           147      146    4,534     8.00     8.00
      4    2          14,336     yes           147      150    5,010    10.00    10.00
      8    1          29,696     yes           152      153    2,919    11.00    11.00

Each row trained its 3 steps at its longest length under the budget; a rank's tokens are ``8 / cp``
rows of ``seq_len / cp``, so the longest row doubles with cp. The measured peak is within 2% of the
prediction for cp 2-8 (cp 1, fsdp [8] at 3,072 tokens, is 15% under it). The K/V bytes counted equal
the plan's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from tempfile import TemporaryDirectory

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "bench")]
from bench_parallel import CommCounter  # noqa: E402  (tests/bench is on sys.path now)
from ports import free_port  # noqa: E402

WORLD, BUDGET_GB, STEP, FIXED, STEPS = 8, 0.15, 1024, 4096, 3
BASE = ["model=gpt_debug", "data=synthetic", "tracking=none", "train.checkpoint.save_final=false",
        "train.eval_at_start=false", f"train.steps={STEPS}"]


def layout(cp: int, seq_len: int) -> list[str]:
    """Overrides of the dp x cp layout with one row per data-parallel group, at ``seq_len`` tokens."""
    dp = WORLD // cp
    mesh = {1: ["+parallel=fsdp", f"mesh=[{WORLD}]"], WORLD: ["+parallel=cp", f"mesh=[{WORLD}]"]}.get(
        cp, ["+parallel=fsdp_cp", f"mesh=[{dp},{cp}]"])
    return [*BASE, *mesh, f"train.global_batch_size={dp}", f"train.seq_len={seq_len}", f"model.max_seq_len={seq_len}"]


def fits(cp: int, seq_len: int) -> bool:
    """Whether the trainer's validation (its memory budget check included) accepts the layout."""
    from parallel.errors import ConfigError
    from trainer.config.compose import compose_dict
    from trainer.validate.checks import validate_config

    try:
        validate_config(compose_dict([*layout(cp, seq_len), f"launch.memory_budget_gb={BUDGET_GB}"]))
        return True
    except ConfigError as err:
        if "memory_budget_gb" not in str(err):
            raise
        return False


def longest(cp: int) -> int:
    """The longest multiple of ``STEP`` tokens the budget takes (doubling, then bisection)."""
    low, high = 0, STEP
    while fits(cp, high):
        low, high = high, 2 * high
    while high - low > STEP:
        middle = (low + high) // 2 // STEP * STEP
        low, high = (middle, high) if fits(cp, middle) else (low, middle)
    return low


def train(cp: int, seq_len: int) -> dict:
    """3 steps of ``python -m trainer`` at ``seq_len``: finished or not, the peak and tokens/s it printed."""
    began = time.time()
    run = subprocess.run([sys.executable, "-m", "trainer", *layout(cp,
                                                                   seq_len), f"launch.memory_budget_gb={BUDGET_GB}"],
                         cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    text = run.stdout + run.stderr
    peak = re.findall(r"peak ([\d,]+) MiB", text)
    predicted = re.findall(r"predicted peak ([\d,]+) MiB", text)
    return {"ok": run.returncode == 0 and "done: steps 1..3" in text, "wall_s": time.time() - began,
            "peak_mib": float(peak[-1].replace(",", "")) if peak else None,
            "predicted_mib": float(predicted[-1].replace(",", "")) if predicted else None}


# ------------------------------------------------------------------------ tokens/s and K/V bytes


def _steps(cp_sizes: list[int]) -> dict:
    """On this rank: per cp size, the seconds of each step and the bytes sent on the cp axis by p2p."""
    from parallel.context import shard_sequence
    from trainer.config.compose import compose_dict
    from trainer.models import loss_fn_for
    from trainer.run.build import build_parallel_model
    from trainer.validate.checks import validate_config

    out = {}
    for cp in cp_sizes:
        cfg = validate_config(compose_dict(layout(cp, FIXED)), check_model=False)
        torch.manual_seed(cfg.train.seed)
        pm = build_parallel_model(cfg, torch.device("cpu"))
        optimizer = torch.optim.AdamW(list(pm.parameters()), lr=cfg.optim.lr)
        counter = CommCounter(pm.mesh)  # this layout's axes; the first wraps c10d, later ones take its records over
        counter.install()
        g = torch.Generator().manual_seed(1234)
        rows = torch.randint(0, cfg.model.vocab_size, (STEPS, cfg.train.global_batch_size, FIXED + 1), generator=g)
        times, sent = [], []
        for step in range(STEPS):
            batch = rows[step, pm.dp_rank:pm.dp_rank + 1]
            inputs, targets = (shard_sequence(x, dim=1, cp_rank=pm.cp_rank, cp_size=pm.cp_size)
                               for x in (batch[:, :-1], batch[:, 1:]))
            dist.barrier()
            counter.records.clear()
            counter.active = True
            began = time.perf_counter()
            pm.forward_backward(inputs, targets, loss_fn_for(cfg.model))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - began)
            counter.active = False
            sent.append(sum(b for (axis, op), (_, b) in counter.records.items() if axis == "cp" and op == "send"))
        out[cp] = {"step_s": times, "kv_sent": sent}
        dist.barrier()
    return out


def _entry(rank: int, port: int, cp_sizes: list[int], out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=600))
    try:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(_steps(cp_sizes)))
    finally:
        dist.destroy_process_group()


def measured(cp_sizes: list[int]) -> list[dict]:
    with TemporaryDirectory() as out:
        mp.start_processes(_entry, args=(free_port(), cp_sizes, out), nprocs=WORLD, join=True, start_method="spawn")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]


def planned_kv(cp: int) -> float:
    """The plan's K/V bytes a cp rank sends per step at ``FIXED`` tokens (the dry run's ``cp K/V`` line)."""
    from parallel.plan.resolve import resolve_plan
    from trainer.config.compose import compose_dict
    from trainer.models import build_model
    from trainer.planner.numbers import plan_numbers
    from trainer.validate.checks import validate_config

    cfg = validate_config(compose_dict(layout(cp, FIXED)), check_model=False)
    plan = resolve_plan(cfg.parallel, cfg.mesh, build_model(cfg.model, device="meta"))
    return plan_numbers(cfg, plan).comm.get("cp K/V", 0.0)


def main(cp_sizes: list[int]) -> None:
    began = time.time()
    rows = []
    for cp in cp_sizes:
        length = longest(cp)
        rows.append({"cp": cp, "longest": length, **train(cp, length)})
        print(f"cp {cp}: longest {length} tokens under {BUDGET_GB} GiB: {rows[-1]}", flush=True)
    ranks = measured(cp_sizes)
    print(f"\nmodel gpt_debug, {WORLD} workers, dp x cp with one row per dp group, budget {BUDGET_GB} GiB per worker; "
          f"tokens/s and K/V at {FIXED} tokens (steps 2-3), K/V sent per rank and step")
    print(f"{'cp':>3} {'rows':>4} {'longest seq_len':>15} {'trained':>7} {'predicted MiB':>13} {'peak MiB':>8} "
          f"{'tokens/s':>8} {'K/V MiB':>8} {'plan MiB':>8}")
    for row in rows:
        cp = row["cp"]
        step_s = max(sum(r[str(cp)]["step_s"][1:]) / (STEPS - 1) for r in ranks)  # the slowest rank's
        kv = max(r[str(cp)]["kv_sent"][-1] for r in ranks) / 2**20
        tokens = WORLD // cp * FIXED / step_s
        print(f"{cp:>3} {WORLD // cp:>4} {row['longest']:>15,} {'yes' if row['ok'] else 'NO':>7} "
              f"{row['predicted_mib'] or float('nan'):>13,.0f} {row['peak_mib'] or float('nan'):>8,.0f} "
              f"{tokens:>8,.0f} {kv:>8.2f} {planned_kv(cp) / 2**20:>8.2f}")
    print(f"({time.time() - began:.0f} s in all)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4, 8])
    main(parser.parse_args().cp)
