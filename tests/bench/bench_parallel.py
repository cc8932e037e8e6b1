"""Per-step communication of every conf/parallel preset, measured in real gloo processes, beside
the analytic expectation; plus step time and tokens/s against one device.

    python tests/bench/bench_parallel.py                 # all presets, ~3-5 minutes on 2 cores
    python tests/bench/bench_parallel.py tp pp           # some of them

Each preset runs the default model (gpt_debug) with the default train settings (global batch 16 x
128 tokens, grad clip 1.0, AdamW), built by the trainer's own ``build_parallel_model``, for
``WARMUP`` + ``MEASURED`` optimizer steps; counts and bytes are those of the measured steps
(per step, rank 0). Two counters run together, so nothing is counted twice:

* c10d calls (``torch.distributed.all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
  ``send``/``recv``/``isend``/``irecv``/``batch_isend_irecv``, ...) are wrapped; FSDP2, DDP
  (``replicate``), the pipeline schedules and the engine's own loss / grad-norm reductions use them;
* DTensor's functional collectives (``torch.ops._c10d_functional.*``: tensor/sequence parallel)
  are caught by a ``TorchDispatchMode`` that, like ``torch.distributed.tensor.debug.CommDebugMode``,
  lets DTensor desugar first and then sees the collectives it issues (CommDebugMode itself only
  reports totals, not the process group, which is needed here to name the mesh axis).

Each group is named by the mesh axis whose process group has the same ranks (``world`` = all
ranks of a mesh with several axes). Bytes are the full buffer each collective moves through on a
rank: the tensor of an all-reduce / send / recv, the *gathered output* of an all-gather, the
*input* of a reduce-scatter. The batch is seeded random tokens (not the text corpus: reading it
costs ~6 s per process and does not change any count or shape).
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import threading
import time
from collections import defaultdict
from datetime import timedelta
from itertools import combinations
from pathlib import Path
from tempfile import TemporaryDirectory

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]
from ports import free_port  # noqa: E402  (tests/ is on sys.path now)

PRESETS = ["dp", "fsdp", "zero2", "hsdp", "tp", "tp_sp", "pp", "2d", "3d"]
WARMUP, MEASURED = 1, 3
C10D_BYTES = {  # function -> (argument holding the payload, how to size it)
    "all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor",
    "send": "tensor", "recv": "tensor", "isend": "tensor", "irecv": "tensor",
    "all_gather_into_tensor": "output_tensor", "reduce_scatter_tensor": "input",
    "all_gather_single": "output_tensor", "reduce_scatter_single": "input",  # FSDP2 in torch 2.13
    "all_gather": "tensor_list", "reduce_scatter": "input_list", "all_to_all": "input_tensor_list",
    "all_to_all_single": "input", "gather": "tensor", "scatter": "tensor",
}
OP_NAME = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor",
           "isend": "send", "irecv": "recv"}  # one name per kind of collective in the table
FUNCOL = {"all_reduce", "all_reduce_coalesced", "all_gather_into_tensor", "all_gather_into_tensor_coalesced",
          "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast"}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(t) for t in x)


# ------------------------------------------------------------------------------ counting


_INSTALLED: CommCounter | None = None


class CommCounter:
    """Records ``(axis, op) -> [count, bytes]``; ``axis_of(ranks)`` names a group."""

    def __init__(self, mesh) -> None:
        self.records: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        self.active = False
        self._local = threading.local()
        self._names = _axis_names(mesh)

    def axis_of(self, group) -> str:
        ranks = tuple(sorted(dist.get_process_group_ranks(group or dist.group.WORLD)))
        return self._names.get(ranks, f"ranks{list(ranks)}")

    target: CommCounter | None = None

    def add(self, group, op: str, nbytes: int) -> None:
        if self is _INSTALLED and self.target is not self:
            return self.target.add(group, op, nbytes)
        if self.active:
            rec = self.records[(self.axis_of(group), op)]
            rec[0] += 1
            rec[1] += nbytes

    # c10d: wrap the module functions (both namespaces: P2POp checks its op against distributed_c10d's)
    def install(self) -> None:
        import torch.distributed.distributed_c10d as c10d

        global _INSTALLED
        if _INSTALLED is not None:  # wrapped once per process; later counters take the records over
            _INSTALLED.target = self
            return
        _INSTALLED, self.target = self, self

        for name, arg in C10D_BYTES.items():
            if not hasattr(c10d, name):
                continue
            original = getattr(c10d, name)
            wrapped = self._wrap(OP_NAME.get(name, name), original, arg)
            setattr(c10d, name, wrapped)
            setattr(dist, name, wrapped)
        batch = c10d.batch_isend_irecv

        def batch_isend_irecv(p2p_op_list):
            for op in p2p_op_list:
                self.add(op.group, "send" if op.op is c10d.isend else "recv", _nbytes(op.tensor))
            return self._nested(batch, p2p_op_list)

        c10d.batch_isend_irecv = dist.batch_isend_irecv = batch_isend_irecv

    def _nested(self, fn, *args, **kwargs):
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            self._local.depth = depth

    def _wrap(self, name, original, arg):
        signature = inspect.signature(original)

        def wrapper(*args, **kwargs):
            if getattr(self._local, "depth", 0) == 0:
                bound = signature.bind(*args, **kwargs)
                self.add(bound.arguments.get("group"), name, _nbytes(bound.arguments[arg]))
            return self._nested(original, *args, **kwargs)

        wrapper.__name__ = name
        return wrapper


class FuncolMode(TorchDispatchMode):
    """Counts DTensor's functional collectives with their process group (see module docstring)."""

    def __init__(self, counter: CommCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor run its propagation / redistribution first
        packet = func.overloadpacket
        if func.namespace == "_c10d_functional" and packet.__name__ in FUNCOL:
            names = [a.name for a in func._schema.arguments]
            values = dict(zip(names, args)) | kwargs
            from torch.distributed.distributed_c10d import _resolve_process_group

            group = _resolve_process_group(values["group_name"])
            payload = values.get("input", values.get("inputs"))
            nbytes = _nbytes(payload) * (values["group_size"] if "all_gather" in packet.__name__ else 1)
            op = {"all_gather_into_tensor": "all_gather_into_tensor"}.get(packet.__name__, packet.__name__)
            self.counter.add(group, f"{op}*", nbytes)
        return func(*args, **kwargs)


def _axis_names(mesh) -> dict[tuple, str]:
    """Ranks of every group this rank could use, by axis name (``a+b`` for several axes)."""
    if mesh is None:
        return {}
    names = list(mesh.mesh_dim_names)
    ids, coord = mesh.mesh, mesh.get_coordinate()
    out = {}
    for k in range(len(names), 0, -1):
        for subset in combinations(range(len(names)), k):
            index = tuple(slice(None) if i in subset else coord[i] for i in range(len(names)))
            ranks = tuple(sorted(ids[index].flatten().tolist()))
            label = "world" if k == len(names) and k > 1 else "+".join(names[i] for i in subset)
            out[ranks] = label
    return out


# ---------------------------------------------------------------------------- one preset


def run_preset(raw: dict, *, count: bool) -> dict:
    """``WARMUP + MEASURED`` steps of the preset ``raw`` on this process group (or one device)."""
    from trainer.models import loss_fn_for
    from trainer.run.build import build_parallel_model
    from trainer.validate.checks import validate_config

    cfg = validate_config(raw)
    t = cfg.train
    torch.manual_seed(t.seed)
    pm = build_parallel_model(cfg, torch.device("cpu"))
    optimizer = torch.optim.AdamW(list(pm.parameters()), lr=cfg.optim.lr, betas=cfg.optim.betas,
                                  eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay)
    loss_fn = loss_fn_for(cfg.model)
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, cfg.model.vocab_size, (WARMUP + MEASURED, t.global_batch_size, t.seq_len + 1),
                           generator=g)
    per = t.global_batch_size // pm.dp_size
    counter = CommCounter(pm.mesh)
    if count:
        counter.install()
    steps, times = [], []
    for step in range(WARMUP + MEASURED):
        batch = tokens[step, pm.dp_rank * per:(pm.dp_rank + 1) * per]
        if pm.mesh is not None:
            dist.barrier()
        counter.records.clear()
        counter.active = step >= WARMUP
        began = time.perf_counter()
        with FuncolMode(counter) if count else _null():
            loss = pm.forward_backward(batch[:, :-1], batch[:, 1:], loss_fn)
            pm.clip_grad_norm_(t.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            pm.reduce_loss(loss)
        counter.active = False
        if step >= WARMUP:
            times.append(time.perf_counter() - began)
            steps.append({f"{a}|{o}": v for (a, o), v in counter.records.items()})
    records: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for s in steps:
        for key, (n, b) in s.items():
            records[key][0] += n / MEASURED
            records[key][1] += b / MEASURED
    return {"records": dict(records), "step_times": times}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False



def _entry(rank: int, world: int, port: int, presets: dict[str, dict], out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    results = {}
    try:
        for name, raw in presets.items():
            results[name] = run_preset(raw, count=True)
            dist.barrier()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def launch(world: int, presets: dict[str, dict]) -> list[dict]:
    with TemporaryDirectory() as out:
        mp.start_processes(_entry, args=(world, free_port(), presets, out), nprocs=world, join=True,
                           start_method="spawn")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


# ---------------------------------------------------------------------------- expectation


def expectation(cfg) -> dict[str, dict[str, tuple[float, float]]]:
    """Analytic ``{axis: {op: (count, bytes)}}`` per optimizer step on rank 0 (stage 0)."""
    from parallel.plan.resolve import resolve_plan
    from trainer.models import build_model

    par, m, t = cfg.parallel, cfg.model, cfg.train
    model = build_model(m, device="meta")
    plan = resolve_plan(par, cfg.mesh, model)  # the placements the engine applies, named plans included
    tp_axis = next((a for a in par.dims if any(a in axes for axes in plan.placements.values())), None)
    tp = cfg.axis_size(tp_axis) if tp_axis else 1
    dp, mb = cfg.dp_size, cfg.num_microbatches
    # Stage 0 of rank 0: which units it holds.
    if plan.pipeline is not None:
        units = plan.pipeline.stage_units[0]
    else:
        units = [n for n, _ in model.named_children() if n != "layers"] + [f"layers.{i}" for i in range(m.n_layers)]
    blocks = [u for u in units if u.startswith("layers.")]
    root = [u for u in units if not u.startswith("layers.")]

    def unit_bytes(unit: str) -> float:  # this rank's tp-local share of the unit's parameters
        total = 0.0
        for n, p in model.named_parameters():
            if n == unit or n.startswith(unit + "."):
                sharded = tp_axis in plan.placements.get(n, {})
                total += p.numel() * 4 / (tp if sharded else 1)
        return total

    block_b, root_b = sum(map(unit_bytes, blocks)), sum(map(unit_bytes, root))
    act = t.global_batch_size // dp // mb * t.seq_len * m.dim * 4  # one micro-batch's [B, T, dim] fp32
    L = len(blocks)
    out: dict[str, dict[str, tuple[float, float]]] = defaultdict(dict)
    scalar_axis = par.dims[0] if len(par.dims) == 1 else "world"
    out[scalar_axis]["all_reduce"] = (2, 16)  # grad-norm and loss reductions (float64 scalars)
    dpm = par.data_parallel.mode if par.data_parallel else None
    if dpm == "ddp":
        out[par.data_parallel.dim_names[0]]["all_reduce"] = (out.get(par.data_parallel.dim_names[0],
                                                                     {}).get("all_reduce", (0, 0))[0] + 1,
                                                             16 + block_b + root_b)
    elif dpm in ("fsdp", "zero2", "hsdp"):
        shard = par.data_parallel.dim_names[-1]
        units_n = L + (1 if root_b else 0)
        regather = L if dpm in ("fsdp", "hsdp") and par.pipeline is None else 0
        out[shard]["all_gather_into_tensor"] = (units_n + regather, block_b + root_b + (block_b if regather else 0))
        out[shard]["reduce_scatter_tensor"] = (units_n, block_b + root_b)
        if dpm == "hsdp":
            out[par.data_parallel.dim_names[0]]["all_reduce"] = (units_n, (block_b + root_b) / cfg.axis_size(shard))
    if tp_axis:
        if plan.layouts:  # sequence parallel: per block 2 reduce-scatters + 2 all-gathers each way,
            # plus the run's final gather (forward) and the gradient of its first scatter (backward)
            out[tp_axis]["reduce_scatter_tensor*"] = (4 * L * mb, 4 * L * mb * act)
            out[tp_axis]["all_gather_into_tensor*"] = ((4 * L + 2) * mb, (4 * L + 2) * mb * act)
            # the 2 norms per block have Partial weight gradients, summed once per step
            out[tp_axis]["all_reduce*"] = (2 * L, 2 * L * m.dim * 4)
        else:  # Megatron: 2 all-reduces forward, 2 backward per block
            out[tp_axis]["all_reduce*"] = (4 * L * mb, 4 * L * mb * act)
    if par.pipeline is not None:
        out[par.pipeline.dim]["send"] = (mb, mb * act)  # stage 0: activations forward
        out[par.pipeline.dim]["recv"] = (mb, mb * act)  # and their gradients back
    return out


# ------------------------------------------------------------------------------- report


def _fmt_bytes(b: float) -> str:
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.1f} {unit}"
    return f"{b:.0f} B"


def main(presets: list[str]) -> None:
    from trainer.config.compose import compose_dict
    from trainer.validate.checks import validate_config

    base = ["tracking=none"]
    raws = {p: compose_dict([f"+parallel={p}", *base]) for p in presets}
    def single_device() -> float:
        times = run_preset(compose_dict(base), count=False)["step_times"]
        return sorted(times)[len(times) // 2]

    t_single = single_device()
    by_world: dict[int, dict] = defaultdict(dict)
    for p, raw in raws.items():
        by_world[validate_config(raw).world_size][p] = raw
    results = {}
    for world, group in sorted(by_world.items()):
        began = time.perf_counter()
        per_rank = launch(world, group)
        print(f"[{world} ranks: {', '.join(group)} in {time.perf_counter() - began:.0f} s]", file=sys.stderr)
        for p in group:
            results[p] = per_rank

    # Measured again after the launches; the faster one counts (the cores may be shared with other jobs).
    t_single = min(t_single, single_device())
    cfg0 = validate_config(compose_dict(base))
    tokens = cfg0.train.global_batch_size * cfg0.train.seq_len
    print(f"\nPer optimizer step, rank 0; model {cfg0.model.arch} dim {cfg0.model.dim} x {cfg0.model.n_layers} layers, "
          f"batch {cfg0.train.global_batch_size} x {cfg0.train.seq_len} tokens; * = DTensor functional collective")
    print(f"single device: {t_single * 1000:.0f} ms/step, {tokens / t_single:,.0f} tokens/s\n")
    header = (f"{'preset':7} {'mesh':10} {'axis':12} {'op':26} {'count':>6} {'bytes':>11} | {'expected':>8} "
              f"{'exp bytes':>11}")
    print(header)
    print("-" * len(header))
    for p in presets:
        cfg = validate_config(raws[p])
        per_rank = results[p]
        measured = per_rank[0][p]["records"]
        expected = expectation(cfg)
        rows = {}
        for key, (n, b) in measured.items():
            axis, op = key.split("|")
            rows[(axis, op)] = (n, b, *expected.get(axis, {}).get(op, (0, 0)))
        for axis, ops in expected.items():
            for op, (n, b) in ops.items():
                rows.setdefault((axis, op), (0, 0, n, b))
        step = sorted(max(r[p]["step_times"][i] for r in per_rank) for i in range(MEASURED))[MEASURED // 2]
        label = f"{p}"
        mesh = "x".join(map(str, cfg.mesh_shape))
        for i, ((axis, op), (n, b, en, eb)) in enumerate(sorted(rows.items())):
            mark = "" if (round(n, 2) == en and abs(b - eb) <= 0.02 * max(eb, 1)) else "  <>"
            print(f"{label if i == 0 else '':7} {mesh if i == 0 else '':10} {axis:12} {op:26} {n:6.1f} "
                  f"{_fmt_bytes(b):>11} | "
                  f"{en:8.0f} {_fmt_bytes(eb):>11}{mark}")
        print(f"{'':7} {'':10} step {step * 1000:.0f} ms, {tokens / step:,.0f} tokens/s, "
              f"{t_single / step:.2f}x the single device's throughput")
        print()
    print(NOTES)


NOTES = """NOTES (<> marks a row where the measurement differs from the simple formula; why):
- All presets: 2 scalar all-reduces per step are the engine's own (clip_grad_norm_ sums squared norms
  over the world; reduce_loss averages the loss), float64, 8 B each. On a 1-D mesh the world is the axis.
- dp (DDP = FSDP2's replicate): formula = one all-reduce of all gradient bytes. replicate() makes one
  FSDP unit of the root, so the gradients go in one bucket (one call); bytes = all parameters, fp32.
- fsdp (ZeRO-3): per unit (4 blocks + root) one all-gather in forward, the blocks gathered again in
  backward (the root keeps its parameters from forward to backward: reshard_after_forward=False), one
  reduce-scatter of gradients per unit. Bytes are the gathered/reduced sizes, incl. FSDP's padding to a
  multiple of the dp size. zero2: no re-gather in backward.
- hsdp: the same on dp_shard; gradients then all-reduced over dp_replicate, at 1/|dp_shard| of the size.
- tp (Megatron via torch's Colwise/RowwiseParallel): forward = 2 all-reduces per block (after wo and w2)
  of [B, T, dim], and 2 in backward: the engine hands attention and the MLP their input as one
  Replicate DTensor, so the Partial input-gradients of wq, wk, wv (w1, w3) are summed before one
  all-reduce (Megatron's "f"). Without that, torch's ColwiseParallel reduces each layer's input
  gradient on its own: 7 all-reduces per block instead of 4 (measured before the change: 28 calls,
  14 MiB per step for tp on gpt_debug; now 16 calls, 8 MiB).
- tp_sp: row outputs reduce-scatter into sequence shards, each norm's output is all-gathered once
  (forward), and the reverse in backward; the last block of the run all-gathers the residual stream
  (forward) and the gradient of the first block's scatter is all-gathered (backward): 4L + 2.
  The 8 sequence-parallel RMSNorm weights get Partial gradients (each rank saw only its sequence
  shard): the engine sums each once before clipping (8 all-reduces of 256 B per step; before that
  change every optimizer op touching them all-reduced again: 32).
- pp (1F1B, 4 micro-batches): stage 0 sends each micro-batch's activation [B/mb, T, dim] and receives
  its gradient; the last stage does the opposite (only rank 0 is shown).
- 2d / 3d: the tp counts per micro-batch and per block held by this stage (4 per block per
  micro-batch, as for tp); FSDP inside a pipeline keeps
  parameters gathered across micro-batches (one all-gather per unit per step) and reduce-scatters once.
- Timing: gloo on 2 shared CPU cores with up to 8 processes; every process competes for the same two
  cores, so these ratios measure overhead (communication, scheduling), not the speed-up a real cluster
  with one device per rank would show. Step time = median over measured steps of the slowest rank;
  the single-device time is the faster of two runs (before and after the launches).
"""


if __name__ == "__main__":
    main(sys.argv[1:] or PRESETS)
