"""On a machine with a GPU: what its kernels achieve, and one measured training step to hold a
hardware profile's prediction against (``trainer/conf/hardware/*.yaml``).

    python tests/bench/gpu_profile_check.py --out results/      # prints a table, writes gpu_check.json

1. Kernels, each the median of timed repeats after warm-ups (CUDA events): bf16 GEMMs of a
   decoder's shapes and of 8192^3 (achieved FLOP/s over the datasheet's peak), torch's flash
   attention forward and backward (causal, head dim 128), a device-to-device copy (bytes read +
   written per second), and the time of a tiny elementwise kernel in a loop (launch and dispatch).
2. Two runs of ``python -m trainer`` on this GPU, eager and with ``train.compile=true`` (bf16, synthetic data, no
   tracking): its mean tokens/s after the first step and its peak allocated memory (the trainer's step lines), with
   the GPU's used memory (nvidia-smi, the whole process: context, NCCL, the allocator's cache)
   sampled while it runs.

The profile's prediction for the same config is made on any machine, without a GPU:
``python tests/bench/bench_profiles.py --check results/gpu_check.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# The measured step: a ~1.1B Llama-family decoder that fits one 80 GB device without checkpointing.
STEP_OVERRIDES = ["model=gpt_small", "model.dim=2048", "model.n_layers=20", "model.n_heads=16", "model.n_kv_heads=16",
                  "model.ffn_hidden_dim=5632", "model.vocab_size=32000", "model.max_seq_len=2048", "train.seq_len=2048",
                  "train.global_batch_size=4", "train.precision=bf16", "train.steps=12", "data=synthetic",
                  "tracking=none", "device=cuda", "tracking.pictures=false"]


def timed(fn, repeats: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn`` on the GPU (CUDA events around each call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def kernels() -> dict:
    dev = torch.device("cuda")
    out: dict = {"gemm": {}, "device": torch.cuda.get_device_name(0),
                 "sms": torch.cuda.get_device_properties(0).multi_processor_count,
                 "memory_bytes": torch.cuda.get_device_properties(0).total_memory}
    for m, k, n in ((8192, 8192, 8192), (8192, 2048, 6144), (8192, 2048, 5632), (8192, 5632, 2048),
                    (8192, 2048, 32000)):
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
        s = timed(lambda: a @ b)
        out["gemm"][f"{m}x{k}x{n}"] = 2 * m * k * n / s
    q, k_, v = (torch.randn(4, 16, 2048, 128, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    flops = 4 * 4 * 16 * 2048 * 2048 * 128 * 0.5
    fwd = timed(lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=True))
    o = F.scaled_dot_product_attention(q, k_, v, is_causal=True)
    grad = torch.randn_like(o)
    both = timed(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k_, v, is_causal=True), (q, k_, v),
                                             grad))
    out["attention_forward_flops"] = flops / fwd
    out["attention_backward_flops"] = 2.5 * flops / max(both - fwd, 1e-9)
    x = torch.empty(2**30, device=dev, dtype=torch.uint8)
    y = torch.empty_like(x)
    out["copy_bytes_per_s"] = 2 * x.numel() / timed(lambda: y.copy_(x))
    small = torch.randn(1024, device=dev)
    loop = 1000
    out["kernel_s"] = timed(lambda: [small.mul_(1.0) for _ in range(loop)], repeats=5) / loop
    return out


def sample_used_memory(stop: threading.Event, samples: list[float]) -> None:
    while not stop.is_set():
        text = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True).stdout.strip()
        if text:
            samples.append(float(text.splitlines()[0]) * 2**20)
        stop.wait(0.2)


def training_step(repo: Path, extra: tuple[str, ...] = ()) -> dict:
    stop, samples = threading.Event(), []
    sampler = threading.Thread(target=sample_used_memory, args=(stop, samples), daemon=True)
    sampler.start()
    began = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "trainer", *STEP_OVERRIDES, *extra], cwd=repo, capture_output=True,
                         text=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    stop.set()
    sampler.join()
    text = run.stdout + run.stderr
    steps = [(float(t), float(p)) for t, p in re.findall(r"step \d+/\d+ .*? ([\d.]+) tok/s.*?peak ([\d.]+) MiB",
                                                         text.replace(",", ""))]
    mean = re.search(r"mean ([\d,]+) tok/s", text)
    return {"overrides": [*STEP_OVERRIDES, *extra], "exit_code": run.returncode, "seconds": time.monotonic() - began,
            "tokens_per_s": float(mean.group(1).replace(",", "")) if mean else None,
            "peak_allocated_bytes": max((p for _, p in steps), default=0.0) * 2**20,
            "peak_used_bytes": max(samples, default=0.0), "log_tail": text[-3000:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    repo = Path(__file__).resolve().parents[2]
    result = {"kernels": kernels(), "step": training_step(repo),
              "compiled_step": training_step(repo, ("train.compile=true",))}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    k = result["kernels"]
    print(f"{k['device']}: {k['sms']} SMs, {k['memory_bytes'] / 2**30:.1f} GiB")
    for shape, rate in k["gemm"].items():
        print(f"  gemm {shape:>20}: {rate / 1e12:7.1f} TFLOP/s")
    print(f"  flash attention: forward {k['attention_forward_flops'] / 1e12:.1f}, backward "
          f"{k['attention_backward_flops'] / 1e12:.1f} TFLOP/s")
    print(f"  copy: {k['copy_bytes_per_s'] / 1e9:.0f} GB/s; tiny kernel {k['kernel_s'] * 1e6:.1f} us")
    for name in ("step", "compiled_step"):
        s = result[name]
        print(f"{name}: exit {s['exit_code']}, {s['tokens_per_s']} tok/s, peak allocated "
              f"{s['peak_allocated_bytes'] / 2**30:.2f} GiB, GPU used {s['peak_used_bytes'] / 2**30:.2f} GiB, "
              f"{s['seconds']:.0f} s")
        if s["exit_code"] != 0:
            print(s["log_tail"])


if __name__ == "__main__":
    main()
