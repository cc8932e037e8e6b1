"""Colossal-AI's 3-D tensor parallelism (``+parallel=tp3d``, cube [2, 2, 2], 8 gloo workers): the bytes each rank
sends in one step (forward + backward) beside the paper's analytic volume, and its memory for weights and
activations, measured and predicted.

    python tests/bench/bench_tp_cube.py                  # ~1.5 minutes on 2 cores (one 8-process launch)
    python tests/bench/bench_tp_cube.py --out tests/bench/results/tp_cube_2026-11-29.txt

The model is gpt_debug (4 layers, dim 64, 4 heads over 2 kv heads, ffn 172, fp32), one batch of 8 rows x 32
tokens (``tests/dist/dist_checks.py``'s first), built by the engine from the preset (``cube_checks.bytes_check``).

* Sent bytes: DTensor's functional collectives counted by a ``TorchDispatchMode`` (as ``CommDebugMode`` sees
  them), each as a ring sends: ``(n - 1) / n`` of an all-gather's output or a reduce-scatter's input, twice that
  of an all-reduce. The analytic volume is :func:`parallel.plan.cube.cube_traffic`: the paper's 3-D matmul term
  (Bian et al. 2021: per Linear ``2 (q - 1) / q^3 (mk + kn + mn)`` elements) plus the cube's other terms (norm
  statistics and weight gradients, the whole activation gathered at the first block's input gradient and the
  last block's output). Gathers and reduce-scatters are the Linears' and the entry / exit's; all-reduces the norms'.
* Memory: this rank's parameter bytes (its cube blocks; the embedding, final norm and head whole) and the bytes
  autograd keeps for backward inside the cube's Linears and norms (a saved-tensor hook scoped by module),
  against :func:`parallel.plan.cube.cube_memory`. What attention, SwiGLU, the head and the loss keep is
  measured only (``other``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "dist")]

from dist_harness import launch  # noqa: E402  (tests/dist is on sys.path now)

MIB = 2**20


def measure() -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        per_rank = launch("eight_rank", world_size=8, out_dir=Path(tmp), only=["bytes"], checks="cube_checks",
                          timeout_s=600)
    return [r["bytes"] for r in per_rank]


def table(per_rank: list[dict]) -> str:
    from dist_checks import llama_cfg, load_preset

    from parallel.plan.cube import cube_memory, cube_traffic
    from parallel.plan.resolve import resolve_plan
    from trainer.models import build_model

    mesh, par = load_preset("tp3d")
    model = build_model(llama_cfg(), device="meta")
    spec = resolve_plan(par, mesh, model).cube
    tokens = per_rank[0]["rows"] * per_rank[0]["seq_len"]
    traffic = cube_traffic(spec, model, side=2, tokens=tokens)
    memory = cube_memory(spec, model, side=2, tokens=tokens)
    sent = [sum(r["sent"].values()) for r in per_rank]
    linear_sent = [sum(v for k, v in r["sent"].items() if not k.startswith("all_reduce")) for r in per_rank]
    reduce_sent = [s - lin for s, lin in zip(sent, linear_sent)]
    total = sum(traffic.values())
    gathers = traffic["3-D matmul (paper)"] + traffic["heads gathered"] + traffic["entry / exit"]
    reduces = traffic["norm statistics"] + traffic["norm weights"]
    lines = [f"tp3d cube [2, 2, 2], gpt_debug fp32, {per_rank[0]['rows']} rows x {per_rank[0]['seq_len']} tokens, "
             "one forward + backward; bytes one rank sends (min-max over the 8 ranks)", "",
             f"{'term':<34}{'analytic MiB':>14}{'measured MiB':>18}{'rel':>8}"]
    for term, value in traffic.items():
        lines.append(f"  {term:<32}{value / MIB:>14.4f}")

    def row(label: str, analytic: float, measured: list[float]) -> str:
        rel = max(abs(m - analytic) for m in measured) / analytic if analytic else 0.0
        span = f"{min(measured) / MIB:.4f}-{max(measured) / MIB:.4f}"
        return f"{label:<34}{analytic / MIB:>14.4f}{span:>18}{rel:>8.1%}"

    lines += [row("gathers + reduce-scatters", gathers, linear_sent), row("all-reduces (norms)", reduces, reduce_sent),
              row("total", total, sent), "",
              f"the paper's 3-D matmul term is {traffic['3-D matmul (paper)'] / total:.0%} of the total", "",
              f"{'memory per rank':<34}{'predicted MiB':>14}{'measured MiB':>18}{'rel':>8}"]
    measured_memory = {
        "cube weights": [r["cube_param_bytes"] for r in per_rank],
        "whole weights": [r["whole_param_bytes"] for r in per_rank],
        "Linear activations": [r["saved_bytes"].get("linear", 0) for r in per_rank],
        "norm activations": [r["saved_bytes"].get("norm", 0) for r in per_rank],
    }
    for term, value in memory.items():
        lines.append(row(term, value, measured_memory[term]))
    other = [r["saved_bytes"].get("other", 0) for r in per_rank]
    lines.append(f"{'other activations (measured only)':<34}{'':>14}{min(other) / MIB:>9.4f}-{max(other) / MIB:.4f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    text = table(measure())
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
