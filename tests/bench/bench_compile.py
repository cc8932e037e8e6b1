"""Seconds per optimizer step with ``train.compile=true`` against eager, one device, fsdp [2] and
3d [2,2,2], and what compiling costs each process.

    python tests/bench/bench_compile.py                      # ~6-8 minutes on 2 cores (cold Inductor cache)
    python tests/bench/bench_compile.py single fsdp --steps 20 --warm-cache

Each preset is one launch (the trainer's own launcher, as ``bench_checkpoint.py`` does; one
device runs in this process). Every rank builds the model twice with the trainer's
``build_parallel_model``, eager and ``train.compile=true``, from the same config: the default
model (gpt_debug) and train settings (global batch 16 x 128 tokens, AdamW, grad clip 1.0) on
seeded random tokens. Both take ``WARMUP`` steps (the compiled model compiles in its first), then
``--steps`` more *alternately* (eager, compiled, eager, ...), so both see the same load from
whatever else the machine runs and the ratio comes from one run; as a check, their losses are
compared (they must agree within fp32 rounding). Reported: median s/step of the alternating steps (slowest rank),
compiled / eager, and per process what compiling cost: the first compiled step's extra seconds over a steady
step, and the seconds spent in the compiler (fastest and slowest rank). Every process computes
on one thread: ``trainer.launch`` sets that for workers, and the one-device run follows by
default (``--threads``): on a busy 2-core machine two OpenMP threads mostly wait for each other.

Inductor caches compiled graphs on disk (/tmp/torchinductor_$USER): by default every launch gets
a fresh, empty cache directory so the compile time is the cold one a new machine pays;
``--warm-cache`` uses the default cache instead (a repeated run's compile time).

Measured on the 2-core development machine while another job kept it busy (load 6-11), three cold
runs: compiled / eager 0.74-0.80x one device, 0.81-0.87x fsdp, 0.43-0.50x 3d (eager tensor
parallelism pays DTensor's Python dispatch on every op; the compiled block has none); in the
compiler per process 31-97 s one device, 49-75 s fsdp, 34-44 s 3d (8 at once); with the cache
warm 3 s, 7-8 s and 20-34 s (Dynamo still traces each block every run; the cache saves the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

PRESETS = {"single": [], "fsdp": ["+parallel=fsdp", "mesh=[2]"], "3d": ["+parallel=3d", "mesh=[2,2,2]"]}
WARMUP = 2  # the first compiled step compiles; the second settles allocations on both sides


def _worker(cfg_json: str, out_dir: str, steps: int, threads: int) -> None:
    import torch
    import torch.distributed as dist

    from trainer.config.schema import RunConfig
    from trainer.models import loss_fn_for
    from trainer.run.build import build_parallel_model

    cfg = RunConfig.model_validate_json(cfg_json)
    distributed = "RANK" in os.environ
    torch.set_num_threads(threads)
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    runs = {}
    for label, compiled in (("eager", False), ("compiled", True)):
        run_cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile": compiled})})
        pm = build_parallel_model(run_cfg, torch.device("cpu"))
        optimizer = torch.optim.AdamW(list(pm.parameters()), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
        runs[label] = (pm, optimizer)
    t = cfg.train
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (t.global_batch_size // runs["eager"][0].dp_size, t.seq_len + 1),
                           generator=g)
    loss_fn = loss_fn_for(cfg.model)

    losses: dict[str, list[float]] = {"eager": [], "compiled": []}

    def step(label: str) -> float:
        pm, optimizer = runs[label]
        began = time.perf_counter()
        loss = pm.forward_backward(tokens[:, :-1], tokens[:, 1:], loss_fn)
        pm.clip_grad_norm_(t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - began
        losses[label].append(pm.reduce_loss(loss))  # outside the timing: one more all-reduce
        return seconds

    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    warmup = {label: [step(label) for _ in range(WARMUP)] for label in ("eager", "compiled")}
    for _ in range(steps):
        for label in ("eager", "compiled"):
            times[label].append(step(label))
    # Both models train the same batch from the same initial values: the same losses, as a check.
    loss_rel = max(abs(c - e) / abs(e) for e, c in zip(losses["eager"], losses["compiled"], strict=True))
    # Seconds this process spent compiling: Dynamo + AOTAutograd + Inductor for the forward, and
    # the backward compiled lazily at the first backward.
    from torch._dynamo.utils import compilation_time_metrics as metrics

    in_compiler = sum(metrics.get("_compile.compile_inner", [])) + sum(metrics.get("compile_fx.<locals>.bw_compiler",
                                                                                   []))
    result = {"rank": rank, "times": times, "warmup": warmup, "loss_rel": loss_rel, "in_compiler": in_compiler}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    if distributed:
        dist.destroy_process_group()


def run_preset(overrides: list[str], steps: int, warm_cache: bool, threads: int) -> dict:
    from trainer.config.compose import compose_dict
    from trainer.validate.checks import validate_config

    cfg = validate_config(compose_dict([*overrides, "tracking=none", "train.compile=true"]))
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as cache:
        if not warm_cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # workers inherit it
        began = time.perf_counter()
        try:
            if cfg.world_size == 1:
                _worker(cfg.model_dump_json(), out, steps, threads)
            else:
                from torch.distributed.launcher.api import LaunchConfig, elastic_launch

                os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
                lc = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=cfg.world_size, rdzv_backend="c10d",
                                  rdzv_endpoint="127.0.0.1:0", max_restarts=0, start_method="spawn", run_id="bench")
                elastic_launch(lc, _worker)(cfg.model_dump_json(), out, steps, 1)
        finally:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        wall = time.perf_counter() - began
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    eager = max(statistics.median(r["times"]["eager"]) for r in ranks)
    compiled = max(statistics.median(r["times"]["compiled"]) for r in ranks)
    # The first compiled step less a steady one: what compiling took on that rank.
    compile_s = [r["warmup"]["compiled"][0] - statistics.median(r["times"]["compiled"]) for r in ranks]
    return {"world": cfg.world_size, "eager": eager, "compiled": compiled, "compile_max": max(compile_s),
            "compile_min": min(compile_s), "wall": wall, "loss_rel": max(r["loss_rel"] for r in ranks),
            "in_compiler_min": min(r["in_compiler"] for r in ranks),
            "in_compiler_max": max(r["in_compiler"] for r in ranks)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("presets", nargs="*", metavar="PRESET", help=f"some of {list(PRESETS)} (default: all)")
    parser.add_argument("--steps", type=int, default=10, help="alternating measured steps of each kind")
    parser.add_argument("--warm-cache", action="store_true", help="use Inductor's default on-disk cache")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the one-device run (workers always use 1, as trainer.launch sets)")
    args = parser.parse_args()
    if unknown := [p for p in args.presets if p not in PRESETS]:
        parser.error(f"unknown preset(s) {unknown}; choose from {list(PRESETS)}")
    rows = {name: run_preset(PRESETS[name], args.steps, args.warm_cache, args.threads) for name in args.presets
            or PRESETS}
    cache = "warm (default dir)" if args.warm_cache else "cold (fresh dir per launch)"
    print(f"\ntorch.compile per block vs eager, gpt_debug, batch 16 x 128, median of {args.steps} alternating "
          f"steps, slowest rank; Inductor cache {cache}; one device on {args.threads} thread(s)")
    print(f"{'preset':<8} {'ranks':>5} {'eager s/step':>13} {'compiled s/step':>16} {'compiled/eager':>15} "
          f"{'first step +s':>15} {'in compiler s':>15} {'launch wall s':>14} {'loss max rel diff':>18}")
    for name, r in rows.items():
        print(f"{name:<8} {r['world']:>5} {r['eager']:>13.4f} {r['compiled']:>16.4f} "
              f"{r['compiled'] / r['eager']:>14.2f}x "
              f"{r['compile_min']:>6.1f} - {r['compile_max']:<6.1f} {r['in_compiler_min']:>6.1f} - "
              f"{r['in_compiler_max']:<6.1f} "
              f"{r['wall']:>14.1f} {r['loss_rel']:>18.1e}")
    print("\nnotes: first step +s is the first compiled step less a steady one and in compiler s the time a\n"
          "process spent in Dynamo, AOTAutograd and Inductor (forward and backward), fastest - slowest rank. The\n"
          "ranks of a launch compile at the same time on the same cores (8 ranks on 2 cores stretch each one's\n"
          "compile about 4x), and the first step waits for the slowest rank at its collectives. Launch wall\n"
          "includes start-up, both builds and all steps. Loss max rel diff: eager against compiled over all\n"
          "steps (same batches, same initial values).")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main()
