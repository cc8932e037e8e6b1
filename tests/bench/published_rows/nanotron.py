"""Hugging Face nanotron's best layouts per model size and cluster size, on 1-64 nodes of 8 H100s.

Source: huggingface/nanotron ``docs/benchmark_summary.svg`` at commit c2528430 (March 2025; the
README's "Benchmarks" section: "the best configurations we discovered for each model size and node
count in nanotron v0.5"), the heatmaps of the Ultra-Scale Playbook's section "Benchmarking
thousands of configurations" (huggingface.co/spaces/nanotron/ultrascale-playbook). Its left panel
("MFU and Memory Usage for Best Configurations") gives each cell's MFU in percent and its memory in
GB; its right panel ("Best Configuration by Model Size and Number of Nodes") the layout: DP, TP,
PP, gradient accumulation steps (GAS) and micro-batch size (MBS), ZeRO-0 or ZeRO-1. The cells
are laid out by model size (1.34, 3.57, 8.86, 80.0 billion parameters) and nodes (1-64). The
figure's text is matplotlib glyphs, read from the SVG's glyph references (one ``<use>`` per
character), cell by cell; every cell's DP x TP x PP is 8 x nodes and DP x GAS x MBS is 256.

Stated elsewhere in the same sources:

* The playbook (same section): "All the following benchmarks were conducted with a sequence
  length of 4096 and a global batch size of 1M tokens" (256 x 4096 = 1,048,576), on "1-64 nodes
  of 8xH100s"; its GPU primer names "the advertised 80 GB for a H100" (the H100 SXM profile).
* The shapes: ``scripts/scaling_benchmarks.py`` at c2528430, ``model_configs`` (layers, hidden,
  heads, intermediate): 1B (16, 2048, 32, 8192), 3B (28, 3072, 32, 8192), 8B (32, 4096, 32,
  14336), 70B (80, 8192, 64, 28672); ``NUM_KEY_VALUE_HEADS = None`` (as many K/V heads as query
  heads); vocab 131072 (``VOCAB_SIZES``); embeddings tied below an intermediate size of 10,000
  (``create_config``). Its ``estimate_num_params`` with these gives the figure's 1.34, 3.57, 8.86
  and 80.0 exactly, which ties the shapes to the figure (the unit test checks it). Its
  ``tp_mode`` REDUCE_SCATTER (sequence parallel, with asynchronous TP linear communication) and
  ``accumulate_grad_in_fp32`` are the script's settings.
* The rest of the run's configuration: the script's base config
  ``examples/config_tiny_llama_bench.yaml`` (at 67c5ebb6, its last version): bf16, ``pp_engine:
  1f1b``, no ``recompute_layer`` (nanotron's default: no activation checkpointing; flash attention
  recomputes the attention scores by itself).

Units: MFU is model FLOPs (nanotron's ``get_flops`` in ``src/nanotron/models/llama.py``: 6 FLOPs per
matmul weight per token plus ``12 l h s`` for attention, the same count as
``published.model_flops_per_token``) over a peak the figure does not state; 989 TFLOP/s (H100 SXM
dense BF16) is assumed. Memory: GB as nanotron logs it (``/ 1024**3``, i.e. GiB); its benchmark
log (``src/nanotron/helpers.py`` ``create_table_log``) writes rank 0's peak allocated and peak
reserved memory, and the figure does not say which of the two it shows, nor the max over ranks.
"""

from __future__ import annotations

from published_rows.schema import H100_PEAK_DENSE_BF16_TFLOPS, Layout, ModelShape, PublishedRun, Reported

SOURCE = ("huggingface/nanotron docs/benchmark_summary.svg @c2528430 (Ultra-Scale Playbook heatmap), "
          "cell '{size}B parameters, {nodes} nodes'; seq 4096 and batch of 1M tokens: the playbook's "
          "'Benchmarking thousands of configurations'; shape: scripts/scaling_benchmarks.py @c2528430 "
          "model_configs '{key}'; schedule and checkpointing: examples/config_tiny_llama_bench.yaml @67c5ebb6")
FORMULA = "nanotron get_flops (src/nanotron/models/llama.py @c2528430): 3 x forward matmuls incl. attention"

# figure label: (scaling_benchmarks.py key, layers, hidden, heads, intermediate, tied embeddings)
SHAPES = {"1.34": ("1B", 16, 2048, 32, 8192, True), "3.57": ("3B", 28, 3072, 32, 8192, True),
          "8.86": ("8B", 32, 4096, 32, 14336, False), "80.0": ("70B", 80, 8192, 64, 28672, False)}

# (model label, nodes, DP, TP, PP, GAS, MBS, ZeRO stage, MFU %, memory GB), by model then nodes.
_CELLS = (
    ("1.34", 1, 4, 1, 2, 16, 4, 1, 44.32, 41.76),
    ("1.34", 2, 8, 1, 2, 32, 1, 1, 41.59, 19.45),
    ("1.34", 4, 16, 1, 2, 16, 1, 1, 38.38, 16.39),
    ("1.34", 8, 32, 1, 2, 8, 1, 1, 32.47, 16.27),
    ("1.34", 16, 64, 2, 1, 1, 4, 0, 29.46, 38.84),
    ("1.34", 32, 64, 4, 1, 1, 4, 0, 23.20, 19.57),
    ("1.34", 64, 128, 2, 2, 1, 2, 1, 5.25, 8.40),
    ("3.57", 1, 4, 1, 2, 32, 2, 1, 46.68, 56.87),
    ("3.57", 2, 8, 1, 2, 16, 2, 1, 43.77, 54.31),
    ("3.57", 4, 16, 1, 2, 8, 2, 1, 40.39, 53.33),
    ("3.57", 8, 32, 1, 2, 8, 1, 1, 35.53, 36.73),
    ("3.57", 16, 32, 4, 1, 1, 8, 0, 34.59, 66.20),
    ("3.57", 32, 64, 4, 1, 1, 4, 0, 26.77, 38.98),
    ("3.57", 64, 128, 4, 1, 1, 2, 1, 10.49, 16.42),
    ("8.86", 1, 2, 1, 4, 128, 1, 1, 45.22, 63.07),
    ("8.86", 2, 4, 4, 1, 16, 4, 1, 43.94, 58.34),
    ("8.86", 4, 16, 1, 2, 16, 1, 1, 43.31, 61.10),
    ("8.86", 8, 32, 1, 2, 8, 1, 1, 39.50, 59.09),
    ("8.86", 16, 16, 8, 1, 2, 8, 0, 36.33, 66.88),
    ("8.86", 32, 32, 8, 1, 1, 8, 0, 32.71, 63.39),
    ("8.86", 64, 128, 4, 1, 1, 2, 0, 18.69, 57.76),
    ("80.0", 4, 1, 8, 4, 256, 1, 0, 14.76, 65.97),
    ("80.0", 8, 1, 4, 16, 256, 1, 0, 30.65, 63.07),
    ("80.0", 16, 1, 4, 32, 256, 1, 0, 34.29, 61.18),
    ("80.0", 32, 4, 4, 16, 64, 1, 1, 30.75, 64.21),
    ("80.0", 64, 32, 16, 1, 4, 2, 1, 17.79, 53.46),
)


def _row(size: str, nodes: int, dp: int, tp: int, pp: int, gas: int, mbs: int, zero: int,
         mfu: float, memory: float) -> PublishedRun:
    """One heatmap cell as a :class:`PublishedRun` (Llama-style, MHA, seq 4096, vocab 131072)."""
    key, layers, hidden, heads, ffn, tied = SHAPES[size]
    return PublishedRun(
        name=f"nanotron-{size}b-{nodes}n-dp{dp}-tp{tp}-pp{pp}",
        source=SOURCE.format(size=size, nodes=nodes, key=key),
        hardware="h100_sxm",
        model=ModelShape("llama", layers, hidden, heads, heads, ffn, 131072, 4096, float(size),
                         tied_output=tied),
        layout=Layout(
            devices=8 * nodes, nodes=nodes, tp=tp, pp=pp, dp=dp, cp=1, sequence_parallel=tp > 1,
            virtual_stages=None, micro_batch_size=mbs, global_batch_size=dp * gas * mbs,
            precision="bf16", activation_checkpointing="none",
            data_parallel="zero1" if zero == 1 else "ddp",
            pipeline_schedule="1F1B" if pp > 1 else None),
        reported=Reported(mfu=mfu / 100, mfu_peak_tflops=H100_PEAK_DENSE_BF16_TFLOPS,
                          flops_kind="model", flops_formula=FORMULA, peak_memory_gib=memory),
        notes=f"ZeRO-{zero}; gradient accumulation {gas}; gradients accumulated in fp32; memory as "
              "the figure shows it (nanotron's benchmark log keeps rank 0's peak allocated and peak "
              "reserved: which one, and whether the max over ranks, is not stated); MFU's peak not "
              "stated (989 TFLOP/s assumed)" + ("; tied embeddings" if tied else ""),
    )


ROWS: tuple[PublishedRun, ...] = tuple(_row(*cell) for cell in _CELLS)
