"""Tokens/s of the mixture-of-experts model ``gpt_moe`` on expert parallel ep 1, 2 and 4, and the bytes its
dispatch and combine all-to-alls send per step, measured in real gloo processes, beside the plan's prediction.

    python tests/bench/bench_experts.py                  # ep 1, 2, 4: about a minute on 2 cores
    python tests/bench/bench_experts.py 2 4              # some ep sizes

Each size is ``model=gpt_moe +parallel=ep mesh=[n]`` (ep 1: one device, no axis) with the default train
settings and synthetic tokens, built by the trainer's own ``build_parallel_model`` and trained on its loss
plus the weighted balance loss (``with_aux_loss``) for ``WARMUP`` + ``MEASURED`` AdamW steps.

The all-to-all bytes are counted where they are sent: a ``TorchDispatchMode`` around the steps sees every
``_c10d_functional.all_to_all_single`` the dispatch issues (the rows out to the experts' ranks and back,
and in backward their gradients, which retrace them), and counts the rows each sends to *other* ranks
(its input split for its own rank stays home) times the row's bytes. The expert counts' exchange (one
plain all-to-all of ``n * E_local`` integers per block and forward) is counted apart; the plan leaves it
out. The prediction is the dry run's ``all-to-all on ep`` (:func:`trainer.planner.numbers.plan_numbers`:
4 all-to-alls per block of the rank's tokens' top_k rows, (n - 1) / n of them leaving the rank when the
routing is balanced); measured / predicted is the mean over ranks and measured steps.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from tempfile import TemporaryDirectory

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]
from ports import free_port  # noqa: E402  (tests/ is on sys.path now)

SIZES = [1, 2, 4]
WARMUP, MEASURED = 1, 4
TOLERANCE = 0.10  # the acceptance: measured all-to-all bytes within 10% of the plan's


class AllToAllBytes(TorchDispatchMode):
    """Bytes this rank sends to other ranks by functional all-to-alls (the dispatch's rows, forward and
    backward) and by c10d's plain ``alltoall_base_`` (the expert counts), while active."""

    def __init__(self) -> None:
        super().__init__()
        self.rows_bytes = self.count_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.distributed_c10d import _resolve_process_group

        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name == "all_to_all_single":
            values = dict(zip([a.name for a in func._schema.arguments], args)) | kwargs
            x, splits = values["input"], list(values["input_split_sizes"])
            me = dist.get_rank(_resolve_process_group(values["group_name"]))
            row = x[0].numel() * x.element_size() if x.shape[0] else 0
            self.rows_bytes += (sum(splits) - splits[me]) * row
        elif func.namespace == "c10d" and name == "alltoall_base_":
            sent = args[1]  # (output, input, group, ...): the counts as [destination rank, its local expert]
            n = sent.shape[0]
            self.count_bytes += sent.numel() * sent.element_size() * (n - 1) // n
        return func(*args, **kwargs)


def run(raw: dict) -> dict:
    """``WARMUP + MEASURED`` steps of ``raw`` on this process group (or one device): step times and the
    all-to-all bytes of each measured step."""
    from trainer.models import decoder_config, loss_fn_for
    from trainer.models.moe import with_aux_loss
    from trainer.run.build import build_parallel_model
    from trainer.validate.checks import validate_config

    cfg = validate_config(raw)
    t = cfg.train
    torch.manual_seed(t.seed)
    pm = build_parallel_model(cfg, torch.device("cpu"))
    optimizer = torch.optim.AdamW(list(pm.parameters()), lr=cfg.optim.lr, betas=cfg.optim.betas,
                                  eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay)
    loss_fn = with_aux_loss(loss_fn_for(cfg.model), pm.model_parts, decoder_config(cfg.model))
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, cfg.model.vocab_size, (WARMUP + MEASURED, t.global_batch_size, t.seq_len + 1),
                           generator=g)
    per = t.global_batch_size // pm.dp_size
    times, rows, counts = [], [], []
    for step in range(WARMUP + MEASURED):
        batch = tokens[step, pm.dp_rank * per:(pm.dp_rank + 1) * per]
        if pm.mesh is not None:
            dist.barrier()
        began = time.perf_counter()
        with AllToAllBytes() as sent:
            loss = pm.forward_backward(batch[:, :-1], batch[:, 1:], loss_fn)
            pm.clip_grad_norm_(t.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            pm.reduce_loss(loss)
        if step >= WARMUP:
            times.append(time.perf_counter() - began)
            rows.append(sent.rows_bytes)
            counts.append(sent.count_bytes)
    return {"step_times": times, "rows_bytes": rows, "count_bytes": counts}


def _entry(rank: int, world: int, port: int, raw: dict, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        result = run(raw)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def launch(world: int, raw: dict) -> list[dict]:
    if world == 1:
        torch.set_num_threads(1)  # as each worker: one core per rank
        return [run(raw)]
    with TemporaryDirectory() as out:
        mp.start_processes(_entry, args=(world, free_port(), raw, out), nprocs=world, join=True, start_method="spawn")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def predicted_bytes(raw: dict) -> float:
    """The dry run's all-to-all bytes per rank and step on ep (0 without the axis)."""
    from trainer.planner.numbers import plan_numbers
    from trainer.validate.checks import validate_with_plan

    cfg, plan = validate_with_plan(raw)
    return plan_numbers(cfg, plan).comm.get("ep all-to-all", 0.0)


def main(sizes: list[int]) -> list[dict]:
    from trainer.config.compose import compose_dict

    table = []
    for n in sizes:
        overrides = ["model=gpt_moe", "tracking=none", *(["+parallel=ep", f"mesh=[{n}]"] if n > 1 else [])]
        raw = compose_dict(overrides)
        began = time.perf_counter()
        per_rank = launch(n, raw)
        print(f"[ep {n}: {time.perf_counter() - began:.0f} s]", file=sys.stderr)
        tokens = raw["train"]["global_batch_size"] * raw["train"]["seq_len"]
        step = sorted(max(r["step_times"][i] for r in per_rank) for i in range(MEASURED))[MEASURED // 2]
        measured = sum(sum(r["rows_bytes"]) for r in per_rank) / len(per_rank) / MEASURED
        counts = sum(sum(r["count_bytes"]) for r in per_rank) / len(per_rank) / MEASURED
        table.append({"ep": n, "ms_per_step": step * 1e3, "tokens_per_s": tokens / step, "measured": measured,
                      "predicted": predicted_bytes(raw), "counts": counts,
                      "spread": (min(sum(r["rows_bytes"]) for r in per_rank) / MEASURED,
                                 max(sum(r["rows_bytes"]) for r in per_rank) / MEASURED)})
    print_table(table, tokens)
    return table


def print_table(table: list[dict], tokens: int) -> None:
    mib = 2**20
    print(f"\ngpt_moe (8 experts of width 64 per block, top_k 2, 4 blocks), batch of {tokens:,} tokens per step; "
          f"{MEASURED} measured steps after {WARMUP}; all-to-all: bytes a rank sends to other ranks per step")
    header = (f"{'ep':>3} {'ms/step':>8} {'tokens/s':>9} {'a2a measured MiB':>17} {'ranks min-max':>14} "
              f"{'plan MiB':>9} {'meas/plan':>9} {'counts KiB':>10}")
    print(header)
    print("-" * len(header))
    for row in table:
        ratio = row["measured"] / row["predicted"] if row["predicted"] else float("nan")
        low, high = row["spread"]
        print(f"{row['ep']:>3} {row['ms_per_step']:>8.0f} {row['tokens_per_s']:>9,.0f} {row['measured'] / mib:>17.3f} "
              f"{f'{low / mib:.2f}-{high / mib:.2f}':>14} {row['predicted'] / mib:>9.3f} "
              f"{ratio if row['predicted'] else '-':>9.3} {row['counts'] / 1024:>10.2f}")
    within = [abs(r["measured"] / r["predicted"] - 1) <= TOLERANCE for r in table if r["predicted"]]
    print(f"\nall-to-all bytes within {TOLERANCE:.0%} of the plan's: {sum(within)}/{len(within)} ep sizes")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or SIZES)
