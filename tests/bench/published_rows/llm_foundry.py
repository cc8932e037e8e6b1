"""MosaicML llm-foundry's MPT training benchmarks: PyTorch FSDP on A100 and H100, data parallel only.

Source: mosaicml/llm-foundry ``scripts/train/benchmarking/README.md`` at commit 5e85bd62 (January
2024; the tables are unchanged at 49521837, the last commit touching the file). Every row at
sequence length 2048 of its four 16-bit tables is here: "H100 80GB BF16 (Large Scale, >= 128
GPUs)", "H100 80GB BF16", "A100 80GB with 1600 Gbps node-node interconnect (RoCE)" and "A100 40GB
with 1600 Gbps node-node interconnect (RoCE)" (the FP8 table and the longer sequences are left
out). Each row states the model, GPUs, micro-batch, gradient accumulation, global batch,
precision and FSDP mixed-precision mode, sharding strategy (FULL_SHARD or SHARD_GRAD_OP),
activation checkpointing (on: every MPT block is checkpointed), throughput per GPU, MFU and the
parameter count, so the layout is stated in full.

Model shapes: ``scripts/train/yamls/pretrain/mpt-<size>.yaml`` at the same commit (d_model,
n_heads, n_layers, expansion_ratio 4, vocab 50368); MPT's defaults there (``configuration_mpt.py``:
``learned_pos_emb=True``, ``no_bias=False``) give learned positions, biases and LayerNorms, tied
embeddings: the table's NumParams column equals that count exactly (the unit test checks it, with
the final LayerNorm that Megatron's count leaves out).

Units: ``Throughput (T/s/GPU)`` is the table's tokens per second per GPU, truncated to an integer.
MFU (README "MFU"): ``(6 N + 12 l d s) * tokens/s / peak`` with N the NumParams column (embeddings
included), peak 312 TFLOP/s (A100) or 989.5 TFLOP/s (H100 SXM, dense BF16, composer's); HFU counts a fourth pass
when activation checkpointing is on (HFU = 4/3 MFU).
"""

from __future__ import annotations

from published_rows.schema import A100_PEAK_DENSE_16BIT_TFLOPS, HardwareName, Layout, ModelShape, PublishedRun, Reported

# The peak collect_results.py divides by: composer's GPU_AVAILABLE_FLOPS (mosaicml/composer
# composer/callbacks/speed_monitor.py), 'h100-sxm' 'amp_bf16' = 1.979e15 / 2 (the datasheet's
# sparse figure halved); 'a100' 312e12.
COMPOSER_H100_SXM_BF16_TFLOPS = 989.5

SOURCE = ("mosaicml/llm-foundry scripts/train/benchmarking/README.md @5e85bd62, table '{table}', "
          "row '{size} | 2048 | {gpus} | ... MicroBatchSize {mbs} | GradAccum {ga} | "
          "GlobalBatchSize {gbs}'; model: scripts/train/yamls/pretrain/mpt-{size}.yaml @5e85bd62")
FORMULA = ("(6*N + 12*l*d*s) per token, N = NumParams (embeddings included), over the peak "
           "(scripts/train/benchmarking/collect_results.py @5e85bd62)")

# size: (n_layers, d_model, n_heads) from mpt-<size>.yaml
SHAPES = {"125m": (12, 768, 12), "350m": (24, 1024, 16), "760m": (24, 1536, 12),
          "1b": (24, 2048, 16), "3b": (32, 2560, 20), "7b": (32, 4096, 32), "13b": (40, 5120, 40),
          "30b": (48, 7168, 56), "70b": (80, 8192, 64)}

H100_LARGE = "H100 80GB BF16 (Large Scale, >= 128 GPUs)"
H100 = "H100 80GB BF16"
A100_80 = "A100 80GB with 1600 Gbps node-node interconnect (RoCE)"
A100_40 = "A100 40GB with 1600 Gbps node-node interconnect (RoCE)"
TABLE_HARDWARE: dict[str, HardwareName] = {H100_LARGE: "h100_sxm", H100: "h100_sxm",
                                           A100_80: "a100_80g", A100_40: "a100_40g"}

# (table, size, GPUs, MFU %, HFU %, micro-batch, grad accum, global batch, tokens/s/GPU,
#  precision / FSDP mixed precision, sharding strategy, activation checkpointing, NumParams),
# in the README's order.
_TABLE = (
    (H100_LARGE, "70b", 512, 41.25, 55.0, 8, 1, 4096, 1007, "amp_bf16/DEFAULT", "FULL_SHARD", True, 64862437376),
    (H100_LARGE, "70b", 256, 42.42, 56.56, 8, 1, 2048, 1035, "amp_bf16/DEFAULT", "FULL_SHARD", True, 64862437376),
    (H100_LARGE, "70b", 128, 43.36, 57.81, 8, 1, 1024, 1058, "amp_bf16/DEFAULT", "FULL_SHARD", True, 64862437376),
    (H100_LARGE, "30b", 512, 40.27, 53.69, 8, 1, 4096, 2115, "amp_bf16/DEFAULT", "FULL_SHARD", True, 29975214080),
    (H100_LARGE, "30b", 256, 40.89, 54.52, 8, 1, 2048, 2148, "amp_bf16/DEFAULT", "FULL_SHARD", True, 29975214080),
    (H100_LARGE, "30b", 128, 41.85, 55.8, 8, 1, 1024, 2199, "amp_bf16/DEFAULT", "FULL_SHARD", True, 29975214080),
    (H100_LARGE, "13b", 512, 41.12, 54.83, 16, 1, 8192, 4952, "amp_bf16/DEFAULT", "FULL_SHARD", True, 12853954560),
    (H100_LARGE, "13b", 256, 41.42, 55.23, 16, 1, 4096, 4989, "amp_bf16/DEFAULT", "FULL_SHARD", True, 12853954560),
    (H100_LARGE, "13b", 128, 42.18, 56.24, 16, 1, 2048, 5080, "amp_bf16/DEFAULT", "FULL_SHARD", True, 12853954560),
    (H100_LARGE, "7b", 512, 42.2, 42.2, 6, 1, 3072, 9670, "amp_bf16/DEFAULT", "FULL_SHARD", False, 6658859008),
    (H100_LARGE, "7b", 256, 44.15, 44.15, 6, 1, 1536, 10119, "amp_bf16/DEFAULT", "FULL_SHARD", False, 6658859008),
    (H100_LARGE, "7b", 128, 45.71, 45.71, 6, 1, 768, 10475, "amp_bf16/DEFAULT", "FULL_SHARD", False, 6658859008),
    (H100_LARGE, "3b", 512, 39.24, 39.24, 8, 1, 4096, 21664, "amp_bf16/DEFAULT", "SHARD_GRAD_OP", False, 2651837440),
    (H100_LARGE, "3b", 256, 41.25, 41.25, 8, 1, 2048, 22772, "amp_bf16/DEFAULT", "SHARD_GRAD_OP", False, 2651837440),
    (H100_LARGE, "3b", 128, 42.43, 42.43, 8, 1, 1024, 23422, "amp_bf16/DEFAULT", "SHARD_GRAD_OP", False, 2651837440),
    (H100_LARGE, "1b", 512, 36.65, 36.65, 12, 1, 6144, 39837, "amp_bf16/DEFAULT", "SHARD_GRAD_OP", False, 1315950592),
    (H100_LARGE, "1b", 256, 39.15, 39.15, 12, 1, 3072, 42555, "amp_bf16/DEFAULT", "SHARD_GRAD_OP", False, 1315950592),
    (H100_LARGE, "1b", 128, 40.6, 40.6, 12, 1, 1536, 44123, "amp_bf16/DEFAULT", "SHARD_GRAD_OP", False, 1315950592),
    (H100, "70b", 64, 42.57, 56.76, 8, 4, 2048, 1039, "amp_bf16/DEFAULT", "FULL_SHARD", True, 64862437376),
    (H100, "70b", 32, 36.15, 48.2, 2, 16, 1024, 882, "amp_bf16/DEFAULT", "FULL_SHARD", True, 64862437376),
    (H100, "30b", 32, 43.92, 58.57, 14, 3, 1344, 2308, "amp_bf16/DEFAULT", "FULL_SHARD", True, 29975214080),
    (H100, "30b", 16, 43.07, 57.42, 10, 3, 480, 2263, "amp_bf16/DEFAULT", "FULL_SHARD", True, 29975214080),
    (H100, "30b", 8, 38.11, 50.82, 3, 21, 504, 2002, "amp_bf16/DEFAULT", "FULL_SHARD", True, 29975214080),
    (H100, "13b", 64, 39.86, 39.86, 2, 1, 128, 4800, "amp_bf16/DEFAULT", "FULL_SHARD", False, 12853954560),
    (H100, "13b", 32, 39.95, 39.95, 2, 1, 64, 4811, "amp_bf16/DEFAULT", "FULL_SHARD", False, 12853954560),
    (H100, "13b", 16, 39.58, 39.58, 2, 1, 32, 4767, "amp_bf16/DEFAULT", "FULL_SHARD", False, 12853954560),
    (H100, "13b", 8, 39.79, 39.79, 2, 1, 16, 4792, "amp_bf16/DEFAULT", "FULL_SHARD", False, 12853954560),
    (H100, "7b", 8, 46.44, 46.44, 6, 1, 48, 10643, "amp_bf16/DEFAULT", "FULL_SHARD", False, 6658859008),
    (H100, "3b", 64, 40.8, 40.8, 6, 3, 1152, 22525, "amp_bf16/DEFAULT", "FULL_SHARD", False, 2651837440),
    (H100, "3b", 32, 41.7, 41.7, 6, 3, 576, 23021, "amp_bf16/DEFAULT", "FULL_SHARD", False, 2651837440),
    (H100, "3b", 16, 43.73, 43.73, 10, 3, 480, 24142, "amp_bf16/DEFAULT", "FULL_SHARD", False, 2651837440),
    (H100, "1b", 64, 40.85, 40.85, 20, 1, 1280, 44402, "amp_bf16/DEFAULT", "FULL_SHARD", False, 1315950592),
    (H100, "1b", 32, 41.52, 41.52, 20, 1, 640, 45130, "amp_bf16/DEFAULT", "FULL_SHARD", False, 1315950592),
    (H100, "1b", 16, 42.36, 42.36, 20, 1, 320, 46037, "amp_bf16/DEFAULT", "FULL_SHARD", False, 1315950592),
    (H100, "1b", 8, 41.82, 41.82, 14, 1, 112, 45455, "amp_bf16/DEFAULT", "FULL_SHARD", False, 1315950592),
    (H100, "760m", 32, 37.57, 37.57, 24, 1, 768, 67971, "amp_bf16/DEFAULT", "FULL_SHARD", False, 760470528),
    (H100, "760m", 16, 37.89, 37.89, 24, 1, 384, 68551, "amp_bf16/DEFAULT", "FULL_SHARD", False, 760470528),
    (H100, "760m", 8, 34.9, 34.9, 24, 2, 384, 63147, "amp_bf16/DEFAULT", "FULL_SHARD", False, 760470528),
    (A100_80, "70b", 64, 53.33, 71.1, 8, 4, 2048, 410, "bf16/PURE", "FULL_SHARD", True, 64862437376),
    (A100_80, "70b", 32, 48.56, 64.75, 2, 16, 1024, 373, "bf16/PURE", "FULL_SHARD", True, 64862437376),
    (A100_80, "30b", 8, 55.3, 73.74, 3, 21, 504, 916, "amp_bf16/DEFAULT", "FULL_SHARD", True, 29975214080),
    (A100_80, "13b", 8, 59.57, 59.57, 2, 3, 48, 2262, "amp_bf16/DEFAULT", "FULL_SHARD", False, 12853954560),
    (A100_80, "7b", 8, 64.23, 64.23, 6, 2, 96, 4641, "amp_bf16/DEFAULT", "FULL_SHARD", False, 6658859008),
    (A100_80, "3b", 8, 62.11, 62.11, 10, 2, 160, 10811, "amp_bf16/DEFAULT", "FULL_SHARD", False, 2651837440),
    (A100_80, "1b", 8, 59.86, 59.86, 14, 4, 448, 20513, "amp_bf16/DEFAULT", "FULL_SHARD", False, 1315950592),
    (A100_80, "760m", 8, 56.85, 56.85, 24, 2, 384, 32434, "amp_bf16/DEFAULT", "FULL_SHARD", False, 760470528),
    (A100_80, "350m", 8, 51.62, 51.62, 32, 2, 512, 58782, "amp_bf16/DEFAULT", "FULL_SHARD", False, 355985408),
    (A100_80, "125m", 8, 44.79, 44.79, 40, 2, 640, 142830, "amp_bf16/DEFAULT", "FULL_SHARD", False, 125311488),
    (A100_80, "125m", 8, 44.45, 44.45, 32, 2, 512, 141737, "amp_bf16/DEFAULT", "FULL_SHARD", False, 125311488),
    (A100_40, "70b", 128, 48.91, 65.21, 4, 1, 512, 376, "bf16/PURE", "FULL_SHARD", True, 64862437376),
    (A100_40, "70b", 64, 35.87, 47.82, 2, 1, 128, 276, "bf16/PURE", "FULL_SHARD", True, 64862437376),
    (A100_40, "30b", 128, 52.25, 69.66, 6, 1, 768, 865, "bf16/PURE", "FULL_SHARD", True, 29975214080),
    (A100_40, "30b", 32, 51.74, 68.98, 4, 1, 128, 857, "bf16/PURE", "FULL_SHARD", True, 29975214080),
    (A100_40, "13b", 128, 51.93, 69.24, 16, 1, 2048, 1972, "bf16/PURE", "FULL_SHARD", True, 12853954560),
    (A100_40, "13b", 64, 52.04, 69.39, 16, 1, 1024, 1976, "bf16/PURE", "FULL_SHARD", True, 12853954560),
    (A100_40, "13b", 32, 52.62, 70.16, 14, 1, 448, 1998, "bf16/PURE", "FULL_SHARD", True, 12853954560),
    (A100_40, "13b", 16, 52.5, 70.0, 10, 1, 160, 1993, "bf16/PURE", "FULL_SHARD", True, 12853954560),
    (A100_40, "13b", 8, 43.94, 58.58, 4, 16, 512, 1668, "bf16/PURE", "FULL_SHARD", True, 12853954560),
    (A100_40, "7b", 128, 50.14, 66.85, 18, 1, 2304, 3623, "bf16/PURE", "FULL_SHARD", True, 6658859008),
    (A100_40, "7b", 64, 50.73, 67.64, 18, 1, 1152, 3665, "bf16/PURE", "FULL_SHARD", True, 6658859008),
    (A100_40, "7b", 32, 51.55, 68.73, 18, 1, 576, 3725, "bf16/PURE", "FULL_SHARD", True, 6658859008),
    (A100_40, "7b", 16, 50.44, 67.26, 16, 1, 256, 3645, "bf16/PURE", "FULL_SHARD", True, 6658859008),
    (A100_40, "7b", 8, 50.92, 67.89, 12, 4, 384, 3679, "bf16/PURE", "FULL_SHARD", True, 6658859008),
    (A100_40, "3b", 128, 54.8, 54.8, 6, 1, 768, 9538, "bf16/PURE", "FULL_SHARD", False, 2651837440),
    (A100_40, "3b", 64, 55.94, 55.94, 6, 1, 384, 9736, "bf16/PURE", "FULL_SHARD", False, 2651837440),
    (A100_40, "3b", 32, 56.96, 56.96, 6, 1, 192, 9914, "bf16/PURE", "FULL_SHARD", False, 2651837440),
    (A100_40, "3b", 16, 56.02, 56.02, 5, 1, 80, 9750, "bf16/PURE", "FULL_SHARD", False, 2651837440),
    (A100_40, "3b", 8, 57.82, 57.82, 5, 8, 320, 10065, "bf16/PURE", "FULL_SHARD", False, 2651837440),
    (A100_40, "1b", 128, 54.41, 54.41, 10, 1, 1280, 18647, "bf16/PURE", "FULL_SHARD", False, 1315950592),
    (A100_40, "1b", 64, 55.44, 55.44, 10, 1, 640, 19001, "bf16/PURE", "FULL_SHARD", False, 1315950592),
    (A100_40, "1b", 32, 45.39, 45.39, 10, 1, 320, 15555, "bf16/PURE", "FULL_SHARD", False, 1315950592),
    (A100_40, "1b", 16, 55.69, 55.69, 8, 1, 128, 19085, "bf16/PURE", "FULL_SHARD", False, 1315950592),
    (A100_40, "1b", 8, 56.23, 56.23, 8, 8, 512, 19271, "bf16/PURE", "FULL_SHARD", False, 1315950592),
    (A100_40, "760m", 128, 50.73, 50.73, 12, 1, 1536, 28940, "bf16/PURE", "FULL_SHARD", False, 760470528),
    (A100_40, "760m", 64, 51.44, 51.44, 12, 1, 768, 29344, "bf16/PURE", "FULL_SHARD", False, 760470528),
    (A100_40, "760m", 32, 51.97, 51.97, 12, 1, 384, 29648, "bf16/PURE", "FULL_SHARD", False, 760470528),
    (A100_40, "760m", 16, 51.9, 51.9, 12, 1, 192, 29607, "bf16/PURE", "FULL_SHARD", False, 760470528),
    (A100_40, "760m", 8, 52.89, 52.89, 12, 4, 384, 30173, "bf16/PURE", "FULL_SHARD", False, 760470528),
    (A100_40, "350m", 128, 45.61, 45.61, 18, 1, 2304, 51934, "bf16/PURE", "FULL_SHARD", False, 355985408),
    (A100_40, "350m", 64, 46.27, 46.27, 18, 1, 1152, 52689, "bf16/PURE", "FULL_SHARD", False, 355985408),
    (A100_40, "350m", 32, 47.26, 47.26, 18, 1, 576, 53811, "bf16/PURE", "FULL_SHARD", False, 355985408),
    (A100_40, "350m", 16, 48.66, 48.66, 18, 1, 288, 55413, "bf16/PURE", "FULL_SHARD", False, 355985408),
    (A100_40, "350m", 8, 49.17, 49.17, 16, 4, 512, 55995, "bf16/PURE", "FULL_SHARD", False, 355985408),
    (A100_40, "125m", 128, 38.86, 38.86, 26, 1, 3328, 123936, "bf16/PURE", "FULL_SHARD", False, 125311488),
    (A100_40, "125m", 64, 39.27, 39.27, 26, 1, 1664, 125234, "bf16/PURE", "FULL_SHARD", False, 125311488),
    (A100_40, "125m", 32, 39.86, 39.86, 26, 1, 832, 127122, "bf16/PURE", "FULL_SHARD", False, 125311488),
    (A100_40, "125m", 16, 40.93, 40.93, 26, 1, 416, 130535, "bf16/PURE", "FULL_SHARD", False, 125311488),
    (A100_40, "125m", 8, 42.75, 42.75, 26, 3, 624, 136334, "bf16/PURE", "FULL_SHARD", False, 125311488),
)


def _row(table: str, size: str, gpus: int, mfu: float, hfu: float, micro_batch: int, accum: int,
         batch: int, tps: int, precision: str, sharding: str, checkpointing: bool,
         params: int) -> PublishedRun:
    """One README row as a :class:`PublishedRun` (GPT-style MPT, seq 2048, 8 GPUs a node)."""
    layers, dim, heads = SHAPES[size]
    hardware = TABLE_HARDWARE[table]
    peak = COMPOSER_H100_SXM_BF16_TFLOPS if hardware == "h100_sxm" else A100_PEAK_DENSE_16BIT_TFLOPS
    return PublishedRun(
        name=f"llmfoundry-{hardware}-{size}-{gpus}gpu-mbs{micro_batch}",
        source=SOURCE.format(table=table, size=size, gpus=gpus, mbs=micro_batch, ga=accum, gbs=batch),
        hardware=hardware,
        model=ModelShape("gpt", layers, dim, heads, heads, 4 * dim, 50368, 2048, params / 1e9),
        layout=Layout(
            devices=gpus, nodes=gpus // 8, tp=1, pp=1, dp=gpus, cp=1, sequence_parallel=False,
            virtual_stages=None, micro_batch_size=micro_batch, global_batch_size=batch,
            precision="bf16", activation_checkpointing="full" if checkpointing else "none",
            data_parallel="fsdp" if sharding == "FULL_SHARD" else "zero2"),
        reported=Reported(tokens_per_s_per_device=tps, mfu=mfu / 100, hfu=hfu / 100,
                          mfu_peak_tflops=peak, flops_kind="model", flops_formula=FORMULA),
        notes=f"precision / FSDP mixed precision {precision} (composer's PURE keeps the gradient "
              f"reduction in bf16, DEFAULT reduces in fp32); sharding {sharding}; "
              f"gradient accumulation {accum}; triton flash attention (mpt-<size>.yaml "
              "attn_impl); H100 80GB taken as SXM: the MFU column reproduces with its 989.5 TFLOP/s (PCIe's: 756)",
    )


ROWS: tuple[PublishedRun, ...] = tuple(_row(*entry) for entry in _TABLE)
