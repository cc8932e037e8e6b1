"""The fields of one published row (:class:`PublishedRun`): the model's shape, the layout it ran
with and what the source reported. A field the source does not state is ``None``; the rows are
data, never fitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Arch = Literal["gpt", "llama"]
HardwareName = Literal["a100_40g", "a100_80g", "h100_sxm", "h100_hbm2e", "h200", "b200"]
Precision = Literal["bf16", "fp16", "fp8"]
Checkpointing = Literal["full", "selective", "none"]
# zero1: optimizer states sharded (Megatron's distributed optimizer, nanotron's ZeRO-1); zero2: gradients
# too, parameters gathered for forward and kept until backward (PyTorch FSDP's SHARD_GRAD_OP); fsdp:
# parameters too, gathered per block (FSDP's FULL_SHARD, FSDP2).
DataParallelMode = Literal["ddp", "zero1", "zero2", "fsdp"]
FlopsKind = Literal["hardware", "model"]

A100_PEAK_DENSE_16BIT_TFLOPS = 312.0  # the peak both papers divide by (163 TFLOP/s = 52%)
# H100 SXM dense BF16 (NVIDIA H100 datasheet, 1979 TFLOP/s with sparsity): Megatron-LM's 2024 table
# (408.8 TFLOP/s = 41% MFU) and llm-foundry's (composer's GPU_AVAILABLE_FLOPS) divide by it.
H100_PEAK_DENSE_BF16_TFLOPS = 989.0


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer. ``gpt``: LayerNorm, GELU MLP, learned positions, biases,
    ``llama``: RMSNorm, SwiGLU, RoPE, no biases."""

    arch: Arch
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden_dim: int
    vocab_size: int
    seq_len: int
    params_billion: float  # as the source names or counts it
    tied_output: bool = True  # output projection shares the input embedding (Megatron's default)


@dataclass(frozen=True)
class Layout:
    """How the run was spread: sizes multiply to ``devices``; batch sizes are in sequences."""

    devices: int
    nodes: int
    tp: int
    pp: int
    dp: int
    cp: int
    sequence_parallel: bool
    virtual_stages: int | None  # model chunks per pipeline rank (interleaved schedule); None: one
    micro_batch_size: int | None  # None where the source does not state it
    global_batch_size: int
    precision: Precision
    activation_checkpointing: Checkpointing | None  # None where the source does not state it
    data_parallel: DataParallelMode
    pipeline_schedule: str | None = None
    compile: bool = False
    float8: str | None = None  # torchao float8 recipe on the Linear layers, if any
    async_tp: bool = False


@dataclass(frozen=True)
class Reported:
    """What the source reports; ``None`` where it does not."""

    tflops_per_device: float | None = None
    flops_kind: FlopsKind | None = None
    flops_formula: str | None = None
    aggregate_pflops: float | None = None
    tokens_per_s_per_device: float | None = None
    aggregate_tokens_per_s: float | None = None  # all devices together, where that is what is printed
    mfu: float | None = None  # fraction, model FLOPs over peak
    mfu_peak_tflops: float | None = None  # the per-device peak the source's MFU divides by
    hfu: float | None = None  # fraction, hardware FLOPs (recomputation included) over peak
    iteration_time_s: float | None = None
    peak_memory_gib: float | None = None  # per device, the max over ranks unless notes say otherwise


@dataclass(frozen=True)
class PublishedRun:
    """One measured row and where it was read."""

    name: str
    source: str
    hardware: HardwareName
    model: ModelShape
    layout: Layout
    reported: Reported
    notes: str = ""
