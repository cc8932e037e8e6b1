"""The peak memory loss parallel, the chunked cross-entropy and selective recomputation save, measured on
this host beside the plan's prediction: a small Llama with a 32k vocabulary at 2048 tokens per sequence,
on tp [4] (also with sequence parallelism) and fsdp [4], each feature off (before) and on (after).

    python tests/bench/bench_loss_memory.py                 # 11 runs, 10-25 minutes on 2 shared cores
    python tests/bench/bench_loss_memory.py --rows tp_before tp_all
    python tests/bench/bench_loss_memory.py --replay tests/bench/data/loss_memory.rows.jsonl   # recorded, predicted now

Each row is one ``python -m trainer`` run of 3 optimizer steps (synthetic data, no tracking, fp32) that
prints the plan's per-rank peak before any worker starts (``memory: predicted peak ... MiB per rank``)
and each rank's measured peak at the last step (``memory: measured peak per rank ...``: CPU, the
resident high-water mark above the worker's floor, :class:`trainer.run.metrics.MemoryMeter`). One
sequence per rank and micro-batch on both layouts (tp: global batch 1, every rank the same sequence;
fsdp: global batch 4, one per rank), so the logits of a micro-batch are [2048, 32768] (256 MiB in fp32)
before loss parallel and [2048, 8192] after.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_memory import PREDICTED  # noqa: E402 - the same lines bench_memory reads

MODEL = ["model=gpt_small", "model.dim=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=4",
         "model.ffn_hidden_dim=688", "model.vocab_size=32768", "model.max_seq_len=2048"]
COMMON = [*MODEL, "data=synthetic", "tracking=none", "train.steps=3", "train.seq_len=2048", "train.log_every=1",
          "train.checkpoint.save_final=false", "launch.memory_budget_gb=1e6"]
TP = ["+parallel=tp", "mesh=[4]", "train.global_batch_size=1"]
TP_SP = ["+parallel=tp_sp", "mesh=[4]", "train.global_batch_size=1"]
FSDP = ["+parallel=fsdp", "mesh=[4]", "train.global_batch_size=4"]
OFF = ["train.loss_chunk_tokens=0", "parallel.activation_checkpointing=none"]
NO_LP = ["parallel.tensor_parallel.loss_parallel=false"]
ROWS = {  # name -> (layout, overrides)
    "tp_before": ("tp [4]", [*TP, *OFF, *NO_LP]),
    "tp_loss_parallel": ("tp [4]", [*TP, *OFF]),
    "tp_chunked": ("tp [4]", [*TP, *OFF, *NO_LP, "train.loss_chunk_tokens=512"]),
    "tp_selective": ("tp [4]", [*TP, *OFF, *NO_LP, "parallel.activation_checkpointing=selective"]),
    "tp_all": ("tp [4]", [*TP, "train.loss_chunk_tokens=512", "parallel.activation_checkpointing=selective"]),
    "tp_sp_before": ("tp_sp [4]", [*TP_SP, *OFF, *NO_LP]),
    "tp_sp_chunked": ("tp_sp [4]", [*TP_SP, *OFF, "train.loss_chunk_tokens=512"]),  # loss parallel too
    "fsdp_before": ("fsdp [4]", [*FSDP, *OFF]),
    "fsdp_chunked": ("fsdp [4]", [*FSDP, *OFF, "train.loss_chunk_tokens=512"]),
    "fsdp_selective": ("fsdp [4]", [*FSDP, *OFF, "parallel.activation_checkpointing=selective"]),
    "fsdp_all": ("fsdp [4]", [*FSDP, "train.loss_chunk_tokens=512", "parallel.activation_checkpointing=selective"]),
}
PER_RANK = re.compile(r"memory: measured peak per rank ([\d,. ]+) MiB")
STEP = re.compile(r"step (\d+)/\d+ .*?([\d,]+) ms/step")


def run(name: str, timeout: int) -> dict:
    layout, overrides = ROWS[name]
    began = time.perf_counter()
    with TemporaryDirectory() as cwd:
        out = subprocess.run([sys.executable, "-m", "trainer", *COMMON, *overrides], cwd=cwd, capture_output=True,
                             text=True, timeout=timeout, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    text = out.stdout + out.stderr
    row = {"name": name, "layout": layout, "rc": out.returncode, "seconds": time.perf_counter() - began}
    if m := PREDICTED.search(text):
        row["predicted"] = float(m.group(1).replace(",", ""))
    if m := PER_RANK.search(text):
        row["measured"] = [float(v.replace(",", "")) for v in m.group(1).split(", ")]
    if steps := STEP.findall(text):
        row["ms_per_step"] = float(steps[-1][1].replace(",", ""))
    if out.returncode != 0:
        row["error"] = "\n".join(text.splitlines()[-15:])
    return row


def table(rows: list[dict]) -> str:
    base = {r["layout"]: max(r["measured"]) for r in rows if r["name"].endswith("_before") and r.get("measured")}
    lines = [f"{'row':<18} {'layout':<9} {'predicted MiB':>13}  {'measured MiB per rank':<30} {'max':>6} "
             f"{'pred/max':>8} {'vs before':>9} {'s/step':>7}"]
    for r in rows:
        measured = r.get("measured")
        if not measured:
            lines.append(f"{r['name']:<18} {r['layout']:<9} failed (rc {r['rc']}): {r.get('error', '')[-200:]}")
            continue
        top, pred = max(measured), r.get("predicted", float("nan"))
        saved = f"{top / base[r['layout']] - 1:+.0%}" if r["layout"] in base else "-"
        lines.append(f"{r['name']:<18} {r['layout']:<9} {pred:>13,.0f}  {', '.join(f'{v:,.0f}' for v in measured):<30} "
                     f"{top:>6,.0f} {pred / top:>8.2f} {saved:>9} {r.get('ms_per_step', float('nan')) / 1e3:>7.1f}")
    return "\n".join(lines)


def predict(name: str) -> float:
    """The plan's per-rank peak (MiB) of a row by this checkout's code, without running anything."""
    sys.path.insert(0, str(REPO))
    from trainer.config.compose import compose_dict
    from trainer.planner.memory.predict import predict_memory
    from trainer.validate.checks import validate_with_plan

    cfg, plan = validate_with_plan(compose_dict([*COMMON, *ROWS[name][1]]))
    return max(e.total for e in predict_memory(cfg, plan)) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    ap.add_argument("--record", type=Path, help="append each run's row (JSON lines) to this file")
    ap.add_argument("--replay", type=Path, help="take the measured rows from this --record file instead of running "
                    "them; the predicted column is this checkout's")
    args = ap.parse_args()
    recorded = {}
    if args.replay:
        recorded = {r["name"]: r for r in map(json.loads, args.replay.read_text().splitlines()) if r.get("name")}
    rows = []
    for name in args.rows:
        if name in recorded:
            rows.append({**recorded[name], "predicted": predict(name)})
            continue
        rows.append(run(name, args.timeout))
        print(f"{name}: {rows[-1].get('measured')} (predicted {rows[-1].get('predicted')})", file=sys.stderr,
              flush=True)
        if args.record:
            with args.record.open("a") as f:
                f.write(json.dumps({k: v for k, v in rows[-1].items() if k != "error"}) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
