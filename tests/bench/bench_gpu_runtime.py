"""What a CUDA GPU holds beside the tensors, and what its peaks reach: the measurements behind the
``runtime_memory`` of the hardware profiles (run by hand on a GPU host, not part of the default run).

    python tests/bench/bench_gpu_runtime.py          # needs one CUDA GPU and torch only; prints a table

- ``cuda context``: device memory in use (``cudaMemGetInfo``) minus what PyTorch's allocator reserved,
  after cuBLAS (a bf16 and a tf32 matmul) and scaled-dot-product attention (forward and backward)
  have run: the context and the kernels loaded, per process;
- ``allocator slack``: ``max_memory_reserved / max_memory_allocated - 1`` over three fused-AdamW steps
  of a Llama-shaped decoder (RMSNorm, causal SDPA, SwiGLU, untied head) under bf16 autocast, two sizes:
  what the caching allocator holds on top of the live tensors at the peak;
- ``bf16 / tf32 matmul``: achieved TFLOP/s of an 8192^3 matmul; ``copy``: achieved GB/s of a 2 GiB
  device-to-device copy (read + write), beside a profile's datasheet peaks.

NCCL's buffers need several GPUs (one process per GPU) and are not measured here. Plain torch, no
project imports, so it runs on any host with a GPU and torch.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """A Llama block: pre-norm causal attention (fused qkv) and a SwiGLU MLP, no biases."""

    def __init__(self, dim: int, n_heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv, self.wo = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.w13, self.w2 = nn.Linear(dim, 2 * hidden, bias=False), nn.Linear(hidden, dim, bias=False)
        self.n_heads = n_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        x = x + self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        gate, up = self.w13(self.mlp_norm(x)).chunk(2, -1)
        return x + self.w2(F.silu(gate) * up)


def cuda_context_gib() -> float:
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    a @ a
    torch.backends.cuda.matmul.allow_tf32 = True
    f = a.float()
    f @ f
    q = torch.randn(4, 16, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    torch.cuda.synchronize()
    del a, f, q
    free, total = torch.cuda.mem_get_info()
    return (total - free - torch.cuda.memory_reserved()) / 2**30


def allocator_slack(dim: int, n_layers: int, n_heads: int, hidden: int, vocab: int, batch: int, seq: int) -> str:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = nn.Sequential(nn.Embedding(vocab, dim), *[Block(dim, n_heads, hidden) for _ in range(n_layers)],
                          nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)).cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    tokens = torch.randint(0, vocab, (batch, seq + 1), device="cuda")
    for _ in range(3):
        with torch.autocast("cuda", torch.bfloat16):
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    return (f"allocator slack, dim {dim} x {n_layers} layers, batch {batch}x{seq}: {reserved / allocated - 1:.3f} "
            f"(peak allocated {allocated / 2**30:.2f} GiB, reserved {reserved / 2**30:.2f} GiB)")


def _seconds(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"cuda context: {cuda_context_gib():.3f} GiB")
    print(allocator_slack(2048, 16, 16, 5632, 32000, batch=4, seq=2048))
    print(allocator_slack(768, 12, 12, 2048, 32000, batch=8, seq=1024))
    n = 8192
    for dtype, label in ((torch.bfloat16, "bf16"), (torch.float32, "tf32")):
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        print(f"{label} matmul {n}^3: {2 * n**3 / _seconds(lambda a=a: a @ a) / 1e12:.1f} TFLOP/s")
    x = torch.empty(2**29, device="cuda")
    y = torch.empty_like(x)
    print(f"copy 2 GiB: {2 * x.numel() * 4 / _seconds(lambda: y.copy_(x)) / 1e9:.0f} GB/s (read + write)")


if __name__ == "__main__":
    main()
