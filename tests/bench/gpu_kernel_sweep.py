"""On a machine with a GPU: bf16 GEMM efficiency over a decoder's shapes, and where one eager training
step's GPU time goes (torch.profiler), to hold the cost model's per-op roofline against.

    python tests/bench/gpu_kernel_sweep.py --out results/     # prints tables, writes gpu_sweep.json

The step is the built-in decoder of ``gpu_profile_check.py`` (about 1.1B parameters, 4 x 2048 tokens)
under bf16 autocast with AdamW, as one device trains it; its kernels are grouped into GEMMs, flash
attention, the optimizer and the other (elementwise and reduction) kernels, beside the step's wall
time, so that the GPU's busy share (the rest is the host's dispatch) is seen.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from gpu_profile_check import timed  # noqa: E402 - beside this file

SHAPES = [(m, k, n) for m in (2048, 8192) for k, n in ((2048, 2048), (2048, 5632), (5632, 2048), (2048, 6144),
                                                      (4096, 4096), (8192, 8192), (2048, 32000), (12288, 4608),
                                                      (4608, 12288), (1024, 1024), (512, 2048))]


def gemms() -> list[dict]:
    out = []
    for m, k, n in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        at = torch.randn(k, m, device="cuda", dtype=torch.bfloat16)
        row = {"m": m, "k": k, "n": n, "flops": 2 * m * k * n}
        row["tflops"] = row["flops"] / timed(lambda: a @ b) / 1e12
        row["tflops_at_b"] = row["flops"] / timed(lambda: at.t() @ b) / 1e12  # a weight gradient's layout
        out.append(row)
    return out


def step_profile() -> dict:
    from torch.profiler import ProfilerActivity, profile

    from trainer.config.compose import compose_dict
    from trainer.config.schema import RunConfig
    from trainer.models import build_model, loss_fn_for

    import gpu_profile_check  # noqa: F811

    raw = compose_dict([o for o in gpu_profile_check.STEP_OVERRIDES if not o.startswith("tracking")])
    cfg = RunConfig.model_validate(raw)
    model = build_model(cfg.model, device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn = loss_fn_for(cfg.model)
    x = torch.randint(0, cfg.model.vocab_size, (4, 2048), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(x), x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    wall = timed(step, repeats=5)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    groups: dict[str, float] = {"gemm": 0.0, "attention": 0.0, "optimizer": 0.0, "other": 0.0}
    kernels: dict[str, float] = {}
    count = 0
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name, us = evt.name, evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
        count += 1
        low = name.lower()
        group = ("attention" if "flash" in low or "fmha" in low or "attention" in low else
                 "gemm" if any(s in low for s in ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")) else
                 "optimizer" if "multi_tensor" in low or "adam" in low else "other")
        groups[group] += us / 3 / 1e6
        kernels[name[:90]] = kernels.get(name[:90], 0.0) + us / 3 / 1e6
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return {"wall_s": wall, "gpu_s": groups, "kernels_per_step": count / 3, "top": top}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name(0), "gemm": gemms(), "step": step_profile()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_sweep.json").write_text(json.dumps(result, indent=1))
    print(result["device"])
    for g in result["gemm"]:
        print(f"  {g['m']:>6} x {g['k']:>6} x {g['n']:>6}: {g['tflops']:7.1f} TFLOP/s (A^T B {g['tflops_at_b']:7.1f})")
    s = result["step"]
    print(f"step: wall {s['wall_s'] * 1e3:.1f} ms, {s['kernels_per_step']:.0f} kernels; GPU "
          + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in s["gpu_s"].items()))
    for name, sec in s["top"]:
        print(f"  {sec * 1e3:8.2f} ms  {name}")


if __name__ == "__main__":
    main()
