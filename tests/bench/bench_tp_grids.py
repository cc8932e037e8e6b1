"""Colossal-AI's tensor-parallel family on 8 workers: bytes each rank sends per step, and its memory for weights
and activations, measured in real gloo processes beside each scheme's analytic figures.

    python tests/bench/bench_tp_grids.py            # one launch of 8 processes, ~4 minutes on 2 cores
    python tests/bench/bench_tp_grids.py --out tests/bench/results/tp_grids_2026-11-29.txt
    python tests/bench/bench_tp_grids.py --raw > m.json; python tests/bench/bench_tp_grids.py --measured m.json

Layouts (one model, 8 workers): 1-D tp 8 (Megatron), 2-D 2 x 2 with dp 2 (``+parallel=tp2d_dp``, Optimus /
SUMMA), 2.5-D 2 x 2 x 2 (``+parallel=tp2p5d``, Tesseract), 3-D 2 x 2 x 2 (``+parallel=tp3d``, Bian et al.'s
cube; each rank's cube holds the whole batch). The model is gpt_debug made splittable 8
ways (8 heads over 8 kv heads, dim 64, ffn 176, 4 layers, vocabulary 256), fp32, global batch 16 x 128 tokens;
the head is replicated in every layout (``loss_parallel=false`` for tp, which the grids keep anyway), so the
figures compare the blocks' partitioning and nothing else.

Measured: ``bench_parallel``'s counters (c10d calls wrapped, DTensor's functional collectives seen by a dispatch
mode), per axis and kind, turned into bytes *sent* by a ring's count: an all-gather sends ``(g-1)/g`` of its
gathered output, a reduce-scatter ``(g-1)/g`` of its input, an all-reduce ``2 (g-1)/g`` of its buffer.

Analytic, per step and rank (E = 4 bytes, L blocks, each block's Linears ``(in, out)``, N tokens a replica holds):

* 1-D (Shoeybi et al. 2019, sec. 3; Narayanan et al. 2021, sec. 3.2): 2 all-reduces of ``N h`` in forward (after
  the row-parallel o and down projections) and 2 in backward (before the column-parallel q/k/v and gate/up):
  ``4 L x 2 (p-1)/p N h E``.
* 2-D (Xu et al. 2021, Optimus, sec. 3 on SUMMA): a Linear's forward all-gathers ``X_i.`` over its row of the grid
  (``(q-1)/q x N/q x in``: the q broadcasts of ``X_ik`` SUMMA makes) and ``W_.j`` over its column
  (``(q-1)/q x in out/q``); backward reduce-scatters ``dX`` and ``dW`` of the same sizes:
  ``sum over Linears of 2 (q-1)/q (N/q in + in out/q) E``. Beside the Linears: the norms' statistics (one
  all-reduce of ``N/q`` values over c in forward; in backward their gradient, which DTensor keeps Partial:
  one term of the norm's input gradient, ``N/q x h``, reduce-scattered over c), the norm weights' gradients
  (all-reduced over r, ``h/q`` each), the stream leaving the grid (forward) and its gradient entering it
  (backward), all-gathered over c then r (``(q-1)/q N/q h`` and ``(q-1)/q N h`` each way), and data
  parallelism's all-reduce of this rank's gradients ``2 (d-1)/d P_rank E``.
* 2.5-D (Wang et al. 2021, Tesseract, sec. 3): each of the d layers runs the 2-D figures on its N/d tokens, and
  ``dW`` is all-reduced among depth: the 2-D terms with N the layer's tokens, plus ``2 (d-1)/d P_rank E``.
* 3-D (Agarwal et al. 1995; Bian et al. 2021): :func:`parallel.plan.cube.cube_traffic` on the batch's N tokens,
  the paper's per-Linear ``2 (q-1)/q^3 (N in + in out + N out)`` plus the norms' statistics and weight gradients
  and the stream gathered whole at the cube's exit (forward) and entry (backward). Its axes (ca, cb, cc) are
  compared together, as one ``cube`` row.
* Every layout: the gradient norm's and the loss's all-reduces (one float64 each over the world).

Memory per rank: weights = this rank's parameter bytes (local shards) against ``P_rank E`` (3-D:
:func:`~parallel.plan.cube.cube_memory`'s cube and whole weights); activations = the bytes autograd saves for
backward in one forward (unique storages, counted by a saved-tensors hook), measured only, except the 3-D row's
share kept inside the cube's Linears and norms (a hook scoped by module), against ``cube_memory``'s prediction.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import defaultdict
from datetime import timedelta
from pathlib import Path
from tempfile import TemporaryDirectory

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "bench")]
from bench_parallel import CommCounter, FuncolMode  # noqa: E402
from ports import free_port  # noqa: E402

E = 4  # fp32
MODEL = ["model=gpt_debug", "model.n_heads=8", "model.n_kv_heads=8", "model.ffn_hidden_dim=176"]
TRAIN = ["data=synthetic", "tracking=none", "train.global_batch_size=16", "train.seq_len=128"]
LAYOUTS = {
    "1-D tp 8": ["+parallel=tp", "mesh=[8]", "parallel.tensor_parallel.loss_parallel=false"],
    "2-D 2x2, dp 2": ["+parallel=tp2d_dp"],
    "2.5-D 2x2x2": ["+parallel=tp2p5d"],
    "3-D 2x2x2": ["+parallel=tp3d"],
}
CUBE = "3-D 2x2x2"
CUBE_AXES = ("ca", "cb", "cc")  # conf/parallel/tp3d.yaml's dims, the roles (a, b, c); compared as one "cube" row
RESULTS = REPO / "tests" / "bench" / "results"


def raw_config(layout: str) -> dict:
    from trainer.config.compose import compose_dict

    return compose_dict([*MODEL, *TRAIN, *LAYOUTS[layout]])


# ------------------------------------------------------------------------------ measured (in the workers)


def _group_sizes(mesh) -> dict[str, int]:
    names, shape = list(mesh.mesh_dim_names), list(mesh.mesh.shape)
    sizes = {"world": math.prod(shape)}
    from itertools import combinations

    for k in range(1, len(names) + 1):
        for subset in combinations(range(len(names)), k):
            sizes["+".join(names[i] for i in subset)] = math.prod(shape[i] for i in subset)
    return sizes


def _sent(op: str, nbytes: float, group: int) -> float:
    if "all_reduce" in op:
        return 2 * (group - 1) / group * nbytes
    return (group - 1) / group * nbytes  # all-gather (its output), reduce-scatter (its input)


def measure(raw: dict) -> dict:
    """One warm-up step, then one counted step and one forward whose saved tensors are weighed, on this rank."""
    from trainer.models import loss_fn_for
    from trainer.run.build import build_parallel_model
    from trainer.validate.checks import validate_config

    cfg = validate_config(raw)
    pm = build_parallel_model(cfg, torch.device("cpu"))
    optimizer = torch.optim.AdamW(list(pm.parameters()))
    loss_fn = loss_fn_for(cfg.model)
    t = cfg.train
    tokens = torch.randint(0, cfg.model.vocab_size, (t.global_batch_size, t.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    per = t.global_batch_size // pm.dp_size
    batch = tokens[pm.dp_rank * per:(pm.dp_rank + 1) * per]
    counter = CommCounter(pm.mesh)
    counter.install()
    sent: dict[str, float] = defaultdict(float)
    for step in range(2):
        dist.barrier()
        counter.records.clear()
        counter.active = step == 1
        with FuncolMode(counter):
            loss = pm.forward_backward(batch[:, :-1], batch[:, 1:], loss_fn)
            pm.clip_grad_norm_(t.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            pm.reduce_loss(loss)
        counter.active = False
    sizes = _group_sizes(pm.mesh)
    for (axis, op), (_, nbytes) in counter.records.items():
        sent[axis] += _sent(op, nbytes, sizes.get(axis, 1))
    weights = sum(_local(p).numel() * _local(p).element_size() for p in pm.parameters())
    return {"sent": dict(sent), "weights": weights, "activations": _saved_bytes(pm, batch, loss_fn)}


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def _saved_bytes(pm, batch: torch.Tensor, loss_fn) -> dict[str, int]:
    """Bytes of the distinct storages autograd keeps for backward over one forward of this rank's batch (not
    parameters: their storage is the weights'), by where they are saved: inside the cube's Linears
    (``linear``), its norms (``norm``), elsewhere (``other``; every byte of the other layouts)."""
    params = {_local(p).untyped_storage().data_ptr() for p in pm.parameters()}
    seen: dict[int, tuple[str, int]] = {}
    scope: list[str] = []
    (model,) = pm.model_parts
    hooks = []
    for name, module in model.named_modules():
        if pm.placement_report.get(name) == "cube":
            kind = "linear" if isinstance(module, torch.nn.Linear) else "norm"
            hooks += [module.register_forward_pre_hook(lambda _m, _a, kind=kind: scope.append(kind)),
                      module.register_forward_hook(lambda *_: scope.pop() and None)]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = _local(t).untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = (scope[-1] if scope else "other", storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model(batch[:, :-1]), batch[:, 1:])
    loss.backward()
    for hook in hooks:
        hook.remove()
    for p in pm.parameters():
        p.grad = None
    kinds: dict[str, int] = defaultdict(int)
    for kind, nbytes in seen.values():
        kinds[kind] += nbytes
    return dict(kinds)


def _entry(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=8,
                            timeout=timedelta(seconds=600))
    results = {}
    try:
        for layout in LAYOUTS:
            results[layout] = measure(raw_config(layout))
            dist.barrier()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def launch() -> dict:
    with TemporaryDirectory() as out:
        mp.start_processes(_entry, args=(free_port(), out), nprocs=8, join=True, start_method="spawn")
        return json.loads(Path(out, "rank0.json").read_text())


# ------------------------------------------------------------------------------ analytic


def shapes() -> dict:
    """The model's sizes, from its config (so the formulas follow MODEL)."""
    from trainer.config.schema import LlamaConfig
    from trainer.config.compose import compose_dict

    raw = compose_dict([*MODEL, *TRAIN])
    m = LlamaConfig(**raw["model"])
    h, kv, f = m.dim, m.num_kv_heads * m.head_width, m.ffn_hidden_dim
    return {"h": h, "L": m.n_layers, "V": m.vocab_size, "T": raw["train"]["seq_len"],
            "B": raw["train"]["global_batch_size"],
            "linears": [(h, h), (h, kv), (h, kv), (h, h), (h, f), (h, f), (f, h)], "norms": 2}


def params_per_rank(s: dict, *, block_divisor: int, norm_divisor: int) -> int:
    """Elements this rank holds: the blocks' Linears split ``block_divisor`` ways, their norms
    ``norm_divisor`` ways, the embedding, head and final norm whole (replicated in every layout here)."""
    linears = sum(i * o for i, o in s["linears"])
    return s["L"] * (linears // block_divisor + s["norms"] * s["h"] // norm_divisor) + 2 * s["V"] * s["h"] + s["h"]


def one_d(s: dict, p: int) -> dict[str, float]:
    """Megatron's 1-D: 4 all-reduces of the replica's N h activations per block per step."""
    n_tokens = s["B"] * s["T"]
    return {"tp": 4 * s["L"] * 2 * (p - 1) / p * n_tokens * s["h"] * E}


def two_d(s: dict, q: int, batch_ranks: int, batch_axis: str | None) -> dict[str, float]:
    """Optimus on a q x q grid holding ``B / batch_ranks`` sequences (2-D with dp, or one Tesseract layer):
    :func:`parallel.plan.traffic.grid_traffic`, the dry run's formula, and dp's (or depth's) all-reduce."""
    from parallel.plan.traffic import grid_traffic

    out = grid_traffic(s["linears"], layers=s["L"], norms=s["norms"], hidden=s["h"], side=q,
                       tokens=s["B"] // batch_ranks * s["T"], dtype_bytes=E)
    if batch_axis is not None:
        held = params_per_rank(s, block_divisor=q * q, norm_divisor=q)
        out[batch_axis] = 2 * (batch_ranks - 1) / batch_ranks * held * E
    return out


def cube() -> tuple:
    """``(CubeSpec, model on meta, tokens a rank's cube holds)`` of the 3-D row, for
    :func:`parallel.plan.cube.cube_traffic` and :func:`~parallel.plan.cube.cube_memory`."""
    from parallel.plan.resolve import resolve_plan
    from trainer.models import build_model
    from trainer.validate.checks import validate_config

    cfg = validate_config(raw_config(CUBE))
    model = build_model(cfg.model, device="meta")
    spec = resolve_plan(cfg.parallel, cfg.mesh, model).cube
    return spec, model, cfg.train.global_batch_size * cfg.train.seq_len


def analytic(layout: str, s: dict) -> dict[str, float]:
    scalars = 2 * 2 * 7 / 8 * 8  # the grad norm's and the loss's float64 all-reduces over the 8 workers
    if layout == CUBE:
        from parallel.plan.cube import cube_traffic

        spec, model, tokens = cube()
        return {"cube": sum(cube_traffic(spec, model, side=2, tokens=tokens, dtype_bytes=E).values()),
                "world": scalars}
    per_axis = {"1-D tp 8": lambda: one_d(s, 8), "2-D 2x2, dp 2": lambda: two_d(s, 2, 2, "dp"),
                "2.5-D 2x2x2": lambda: two_d(s, 2, 2, "depth")}[layout]()
    return {**per_axis, "world": scalars}


def predicted_weights(layout: str, s: dict) -> float:
    if layout == CUBE:
        return sum(_cube_memory()[k] for k in ("cube weights", "whole weights"))
    if layout == "1-D tp 8":
        return params_per_rank(s, block_divisor=8, norm_divisor=1) * E
    return params_per_rank(s, block_divisor=4, norm_divisor=2) * E


def _cube_memory() -> dict[str, float]:
    from parallel.plan.cube import cube_memory

    spec, model, tokens = cube()
    return cube_memory(spec, model, side=2, tokens=tokens, dtype_bytes=E)


# ------------------------------------------------------------------------------ the table


def table(measured: dict, s: dict) -> list[str]:
    lines = [f"{'layout':15} {'axis':6} {'sent KiB/step':>13} {'analytic KiB':>12} {'diff':>7}"]
    worst = 0.0
    for layout in LAYOUTS:
        sent, want = dict(measured[layout]["sent"]), analytic(layout, s)
        if layout == CUBE:  # cube_traffic prices the cube's three axes together; each is shown, measured only
            lines += [f"{layout:15} {axis:6} {sent[axis] / 1024:13.1f}" for axis in CUBE_AXES if axis in sent]
            sent["cube"] = sum(sent.pop(axis, 0.0) for axis in [*CUBE_AXES, "+".join(CUBE_AXES)])
        if "world" not in sent and "tp" in sent:  # 1-D: the tp group is the world, the scalars ride on it
            want["tp"] += want.pop("world")
        for axis in sorted(set(sent) | set(want)):
            got, exp = sent.get(axis, 0.0), want.get(axis, 0.0)
            diff = abs(got - exp) / exp if exp else float(got != 0)
            worst = max(worst, diff)
            lines.append(f"{layout:15} {axis:6} {got / 1024:13.1f} {exp / 1024:12.1f} {100 * diff:6.2f}%")
        total, total_want = sum(sent.values()), sum(want.values())
        lines.append(f"{layout:15} {'total':6} {total / 1024:13.1f} {total_want / 1024:12.1f} "
                     f"{100 * abs(total - total_want) / total_want:6.2f}%")
    lines.append(f"largest difference: {100 * worst:.2f}% (within 5%: {worst <= 0.05})")
    lines += ["", f"{'layout':15} {'weights KiB':>11} {'predicted':>9} {'activations KiB':>15} "
              f"{'in the cube':>11} {'predicted':>9}"]
    for layout in LAYOUTS:
        m = measured[layout]
        acts = m["activations"]
        line = (f"{layout:15} {m['weights'] / 1024:11.1f} {predicted_weights(layout, s) / 1024:9.1f} "
                f"{sum(acts.values()) / 1024:15.1f}")
        if layout == CUBE:  # what the cube's Linears and norms keep, against cube_memory
            memory = _cube_memory()
            got = acts.get("linear", 0) + acts.get("norm", 0)
            line += f" {got / 1024:11.1f} {(memory['Linear activations'] + memory['norm activations']) / 1024:9.1f}"
        lines.append(line)
    return lines


def main() -> None:
    import argparse
    import datetime

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where the table goes (default: results/tp_grids_<today>.txt)")
    parser.add_argument("--raw", action="store_true", help="print rank 0's measurements as JSON, no table")
    parser.add_argument("--measured", type=Path, help="build the table from a --raw JSON instead of launching")
    args = parser.parse_args()
    measured = json.loads(args.measured.read_text()) if args.measured else launch()
    if args.raw:
        print(json.dumps(measured, indent=1))
        return
    s = shapes()
    lines = table(measured, s)
    header = (f"bench_tp_grids {datetime.date.today()}: gpt_debug 8 heads / 8 kv heads, dim {s['h']}, ffn 176, "
              f"{s['L']} layers, fp32, global batch {s['B']} x {s['T']} tokens, 8 gloo workers; bytes sent per rank "
              "per step (rank 0, the step after one warm-up)")
    text = "\n".join([header, *lines]) + "\n"
    print(text)
    out = args.out or RESULTS / f"tp_grids_{datetime.date.today()}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


if __name__ == "__main__":
    main()
