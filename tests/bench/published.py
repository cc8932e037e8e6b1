"""Measured training runs from public papers and repositories: what the planner is checked against.

    python tests/bench/published.py                     # print the table
    python tests/bench/published.py --hardware a100_80g

Each :class:`PublishedRun` holds one measured row: the model's shape, the hardware profile it ran
on, the layout (tensor / pipeline / data / context sizes, batch, precision, activation
checkpointing) and what the source reports (throughput, utilization, peak memory). Every number was
read in the cited source; a field the source does not state is ``None``, and a value that had to be
taken from the run's own configuration rather than from the table is said so in ``notes``. The
rows are data for the comparison, never fitted here.

Sources, in the order of the table:

* Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (arXiv 2104.04473), Table 1. The numbers come from the table as published in
  NVIDIA/Megatron-LM's README (``images/cases_april2021.png`` at commit 50a4b5fa, April 2021); the
  per-row layout (tensor / pipeline split, micro-batch, heads, interleaving, fp16, full
  recomputation) from the paper's own reproduction script,
  ``examples/sc21/run_table_1.sh`` and ``CONFIG.sh`` at commit 6985e589 (the commit the scripts'
  README names for reproducing the paper).
* Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv 2205.05198): MFU / HFU from NVIDIA/Megatron-LM's README (commit 01ad96e5, "data parallel
  size of one"); the configurations (paper Table 3) and end-to-end iteration times (paper Table 5)
  as transcribed by NVIDIA's Calculon (calculon-ai/calculon at caa4b11f, ``models/*.json``,
  ``validation/seqsel/tab5/*.json``, ``calculon/llm/validation.py``). The iteration times
  reproduce the README's MFU to its rounding with the paper's model-FLOPs formula (the unit test
  checks it), which ties the two sources together.
* NVIDIA/Megatron-LM README at commit 937571cf (July 2024): the H100 weak-scaling table
  (``images/model_table.png``), GPT shapes with vocab 131072 and sequence 4096; the MLP type,
  precision, recomputation and micro-batch are not stated there (see each row's ``notes``).
* torchtitan (pytorch/torchtitan): ``benchmarks/llama3_h100_202412_torchtitan.md`` (Llama 3.1 on
  H100 96 GB HBM2e at 500 W), ``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md`` and
  ``benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md``; sequence length and activation
  checkpointing mode, where the benchmark does not restate them, from the ``train_configs`` of the
  torchtitan commit the benchmark names. TPS/GPU is torchtitan's "tokens per second per device":
  the global tokens per second divided by the number of GPUs.

* MosaicML llm-foundry, ``scripts/train/benchmarking/README.md`` @5e85bd62: every sequence-2048
  row of its four 16-bit tables (MPT 125M-70B, PyTorch FSDP FULL_SHARD / SHARD_GRAD_OP on 8-512
  A100 40/80 GB and H100 GPUs; micro-batch, accumulation, checkpointing, tokens/s/GPU and MFU per
  row). Rows and citations: ``published_rows/llm_foundry.py``.
* Hugging Face nanotron, ``docs/benchmark_summary.svg`` @c2528430 (the Ultra-Scale Playbook's
  heatmaps of the best layouts of 1.34B-80B Llama-style models on 1-64 nodes of 8 H100s: DP / TP /
  PP / accumulation / micro-batch / ZeRO stage, MFU and memory per cell; sequence 4096, batch 1M
  tokens). Rows and citations: ``published_rows/nanotron.py``.
* NVIDIA/dgxc-benchmarking @35a9aec (v24.11.1): the BF16 "Expected Performance" tables of GPT-3
  175B (TP 4, PP 8, VP 12), Nemotron-4 340B (TP 8, PP 8, VP 12) and Nemotron-4 15B (TP 4) on 16-2048
  DGX H100 GPUs (step time, tokens/s, MFU); the rest of each layout from the recipe's Hydra file.
  Rows and citations: ``published_rows/dgxc.py``.
* The same repository and commit, the BF16 tables of Llama 3.1 8B (TP 1, CP 2), 70B (TP 4, PP 4,
  CP 2, VP 5) and 405B (TP 8, PP 9, CP 2, VP 7; its first columns a truncated model) on 8-2304 H100s:
  the context-parallel rows. Rows and citations: ``published_rows/dgxc_cp.py``.

The dataclasses live in ``published_rows/schema.py`` and are re-exported here.

FLOP counting (see :func:`megatron_flops_per_iteration` and :func:`model_flops_per_token`):
Narayanan et al.'s TFLOP/s count the recomputed forward of full activation checkpointing, i.e. they
are hardware FLOPs, ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` per iteration (their Eq. 3, Section
5.1). Korthikanti et al.'s MFU uses ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))`` (no recomputation)
and their HFU for selective recomputation ``72 B s l h^2 (1 + s/(3h) + V/(12 l h))``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

# published_rows/ sits beside this file, which the unit tests load by path (not as a package).
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from published_rows import dgxc, dgxc_cp, llm_foundry, nanotron  # noqa: E402
from published_rows.schema import (  # noqa: E402,F401 - re-exported: the bench and tests use published.X
    A100_PEAK_DENSE_16BIT_TFLOPS, H100_PEAK_DENSE_BF16_TFLOPS, Arch, Checkpointing, DataParallelMode,
    FlopsKind, HardwareName, Layout, ModelShape, Precision, PublishedRun, Reported)


NARAYANAN = (
    "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters Using "
    "Megatron-LM, arXiv 2104.04473, Table 1, row {row}; numbers: NVIDIA/Megatron-LM README "
    "images/cases_april2021.png @50a4b5fa; layout: examples/sc21/run_table_1.sh case {row} and "
    "examples/sc21/CONFIG.sh @6985e589"
)
NARAYANAN_FORMULA = "96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) per iteration (Eq. 3; 4 passes)"
KORTHIKANTI = (
    "Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models, "
    "arXiv 2205.05198, Table 3 and Table 5 ({mode}), row {row}; MFU/HFU: NVIDIA/Megatron-LM README "
    "@01ad96e5; configuration and time as transcribed in calculon-ai/calculon @caa4b11f "
    "(models/{calc}.json, validation/seqsel/tab5/{calc}_{suffix}.json, calculon/llm/validation.py)"
)
TITAN_2412 = (
    "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @820504e2, Table {table}, "
    "row '{row}'; seq_len and AC mode: train_configs/llama3_{size}.toml @9dec370a"
)
TITAN_ASYNC = (
    "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md @2887250b, "
    "'Llama3 {size} on {gpus} H100s' table, row 'None (bfloat16)', column '{column}'; seq_len "
    "and AC mode: torchtitan/models/llama3/train_configs/llama3_{size}.toml @820504e2"
)
TITAN_H200 = (
    "pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md @4a61bd87, Results, "
    "row NUM_NODES={nodes}; seq_len: torchtitan/models/llama3/train_configs/llama3_8b.toml "
    "@e7c0cae9"
)


def _schedule(pp: int, virtual_stages: int | None) -> str | None:
    """Megatron's schedule: none without a pipeline, interleaved 1F1B with model chunks."""
    if pp == 1:
        return None
    return "interleaved-1F1B" if virtual_stages else "1F1B"


def _narayanan(row: str, params: float, heads: int, hidden: int, layers: int, tp: int, pp: int,
               devices: int, micro_batch: int, batch: int, virtual_stages: int | None,
               tflops: float, peak_percent: float, pflops: float) -> PublishedRun:
    """A Table 1 row: GPT, seq 2048, vocab 51200, fp16, full recomputation, 8 A100s a node."""
    return PublishedRun(
        name=f"megatron2021-{row}",
        source=NARAYANAN.format(row=row),
        hardware="a100_80g",
        model=ModelShape("gpt", layers, hidden, heads, heads, 4 * hidden, 51200, 2048, params),
        layout=Layout(
            devices=devices, nodes=devices // 8, tp=tp, pp=pp, dp=devices // (tp * pp), cp=1,
            sequence_parallel=False, virtual_stages=virtual_stages, micro_batch_size=micro_batch,
            global_batch_size=batch, precision="fp16", activation_checkpointing="full",
            data_parallel="ddp", pipeline_schedule=_schedule(pp, virtual_stages)),
        reported=Reported(tflops_per_device=tflops, flops_kind="hardware",
                          flops_formula=NARAYANAN_FORMULA, aggregate_pflops=pflops,
                          hfu=peak_percent / 100),
        notes="fp16 with loss scale 8192; --activations-checkpoint-method uniform (full); DDP impl "
              + ("torch" if pp == 1 else "local") + "; Selene, 8x A100 80 GB per node (README)",
    )


def _korthikanti(row: str, calc: str, selective: bool, params: float, heads: int, hidden: int,
                 layers: int, pp: int, devices: int, batch: int, micro_batch: int,
                 virtual_stages: int | None, seconds: float, mfu: float | None = None,
                 hfu: float | None = None) -> PublishedRun:
    """A Table 5 row: tp 8, data-parallel size one, seq 2048, vocab 51200, A100 80 GB."""
    mode = "present work: sequence parallel + selective" if selective else "full recompute"
    return PublishedRun(
        name=f"korthikanti2022-{row}-{'seqsel' if selective else 'full'}",
        source=KORTHIKANTI.format(mode=mode, row=row, calc=calc,
                                  suffix="seqsel" if selective else "full"),
        hardware="a100_80g",
        model=ModelShape("gpt", layers, hidden, heads, heads, 4 * hidden, 51200, 2048, params),
        layout=Layout(
            devices=devices, nodes=devices // 8, tp=8, pp=pp, dp=1, cp=1,
            sequence_parallel=selective, virtual_stages=virtual_stages,
            micro_batch_size=micro_batch, global_batch_size=batch, precision="fp16",
            activation_checkpointing="selective" if selective else "full", data_parallel="ddp",
            pipeline_schedule=_schedule(pp, virtual_stages)),
        reported=Reported(iteration_time_s=seconds, mfu=mfu, hfu=hfu,
                          flops_formula="MFU: 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)); HFU adds "
                                        "the recomputed attention: s/(3h) in place of s/(6h)"),
        notes="16-bit mixed precision (Calculon's transcription says float16; the sources read do "
              "not say fp16 or bf16); A100 80 GB on Selene as in the README; micro-batch and "
              "interleaving from Calculon's execution files",
    )


MEGATRON_H100 = (
    "NVIDIA/Megatron-LM README @937571cf (July 2024), images/model_table.png, row {row}; "
    "vocab 131072 and seq 4096 from the README's 'Benchmark Configuration'"
)


def _megatron_h100(row: str, heads: int, hidden: int, layers: int, tp: int, pp: int,
                   devices: int, batch: int, tflops: float, mfu_percent: float,
                   pflops: float) -> PublishedRun:
    """A row of Megatron-LM's 2024 H100 weak-scaling table (data-parallel size 48 throughout)."""
    return PublishedRun(
        name=f"megatron2024-h100-{row}",
        source=MEGATRON_H100.format(row=row),
        hardware="h100_sxm",
        model=ModelShape("gpt", layers, hidden, heads, heads, 4 * hidden, 131072, 4096,
                         float(row.rstrip("B")), tied_output=False),
        layout=Layout(
            devices=devices, nodes=devices // 8, tp=tp, pp=pp, dp=devices // (tp * pp), cp=1,
            sequence_parallel=tp > 1, virtual_stages=None, micro_batch_size=None,
            global_batch_size=batch, precision="bf16", activation_checkpointing=None,
            data_parallel="zero1", pipeline_schedule=_schedule(pp, None)),
        reported=Reported(tflops_per_device=tflops, flops_kind="model",
                          flops_formula="72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)) (megatron/training/"
                                        "training.py num_floating_point_operations @937571cf, MHA, "
                                        "no SwiGLU)",
                          aggregate_pflops=pflops, mfu=mfu_percent / 100),
        notes="not stated: MLP type (parameter counts fit a 4h MLP or SwiGLU of equal size, "
              "untied output), precision (bf16 assumed: MFU = TFLOP/s / 989), activation "
              "checkpointing, micro-batch, sequence parallelism, interleaving; zero1 because the "
              "README's --overlap-param-gather needs the distributed optimizer; H100 SXM assumed "
              "(the README says H100 clusters)",
    )


LLAMA31_8B = ModelShape("llama", 32, 4096, 32, 8, 14336, 128256, 8192, 8.0, tied_output=False)
LLAMA31_70B = ModelShape("llama", 80, 8192, 64, 8, 28672, 128256, 8192, 70.0, tied_output=False)
LLAMA31_405B = ModelShape("llama", 126, 16384, 128, 8, 53248, 128256, 8192, 405.0,
                          tied_output=False)
"""Llama 3.1 shapes as torchtitan builds them (torchtitan/models/llama/__init__.py @9dec370a:
ffn = multiple_of * ceil(ffn_dim_multiplier * int(8 * dim / 3) / multiple_of); vocab 128,256 =
the Llama 3 tokenizer's 128,000 tokens + 256 reserved special tokens)."""


def _titan(name: str, source: str, hardware: HardwareName, model: ModelShape, *, devices: int,
           tp: int = 1, pp: int = 1, fsdp: int, cp: int = 1, local_batch: int,
           checkpointing: Checkpointing, tps: float, memory: float | None, compile: bool = False,
           float8: str | None = None, async_tp: bool = False, schedule: str | None = None,
           notes: str = "") -> PublishedRun:
    """A torchtitan row: FSDP2 over ``fsdp`` ranks, bf16 mixed precision, 8 GPUs a node.
    ``local_batch`` is per data-parallel rank, so the global batch is ``local_batch * fsdp``."""
    return PublishedRun(
        name=name, source=source, hardware=hardware, model=model,
        layout=Layout(
            devices=devices, nodes=devices // 8, tp=tp, pp=pp, dp=fsdp, cp=cp,
            sequence_parallel=tp > 1, virtual_stages=None,
            micro_batch_size=local_batch if pp == 1 else None,
            global_batch_size=local_batch * fsdp, precision="fp8" if float8 else "bf16",
            activation_checkpointing=checkpointing, data_parallel="fsdp",
            pipeline_schedule=schedule, compile=compile, float8=float8, async_tp=async_tp),
        reported=Reported(tokens_per_s_per_device=tps, peak_memory_gib=memory),
        notes=notes,
    )


_F8 = "tensorwise"  # torchtitan's Float8Linear default recipe at these commits
_T1 = "torchtitan 2024-12 Table {0}"

PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    # --- Narayanan et al. 2021, Table 1 (weak scaling). Order of arguments:
    # row, params(B), heads, hidden, layers, tp, pp, GPUs, micro-batch, batch, virtual stages,
    # TFLOP/s per GPU, % of peak, aggregate PFLOP/s
    _narayanan("1.7B", 1.7, 24, 2304, 24, 1, 1, 32, 16, 512, None, 137, 44, 4.4),
    _narayanan("3.6B", 3.6, 32, 3072, 30, 2, 1, 64, 16, 512, None, 138, 44, 8.8),
    _narayanan("7.5B", 7.5, 32, 4096, 36, 4, 1, 128, 16, 512, None, 142, 46, 18.2),
    _narayanan("18B", 18.4, 48, 6144, 40, 8, 1, 256, 8, 1024, None, 135, 43, 34.6),
    _narayanan("39B", 39.1, 64, 8192, 48, 8, 2, 512, 4, 1536, None, 138, 44, 70.8),
    _narayanan("76B", 76.1, 80, 10240, 60, 8, 4, 1024, 2, 1792, 3, 140, 45, 143.8),
    _narayanan("145B", 145.6, 96, 12288, 80, 8, 8, 1536, 2, 2304, 2, 148, 47, 227.1),
    _narayanan("310B", 310.1, 128, 16384, 96, 8, 16, 1920, 1, 2160, 2, 155, 50, 297.4),
    _narayanan("530B", 529.6, 128, 20480, 105, 8, 35, 2520, 1, 2520, 3, 163, 52, 410.2),
    _narayanan("1T", 1008.0, 160, 25600, 128, 8, 64, 3072, 1, 3072, None, 163, 52, 502.0),
    # --- Korthikanti et al. 2022, Table 5: present work (sequence parallel + selective) ...
    _korthikanti("22B", "megatron-22B", True, 22, 64, 6144, 48, 1, 8, 4, 4, None, 1.10,
                 mfu=0.415, hfu=0.437),
    _korthikanti("175B", "gpt3-175B", True, 175, 96, 12288, 96, 8, 64, 64, 1, 3, 13.75,
                 mfu=0.514, hfu=0.528),
    _korthikanti("530B", "turing-530B", True, 530, 128, 20480, 105, 35, 280, 280, 1, 3, 37.83,
                 mfu=0.560, hfu=0.570),
    _korthikanti("1T", "megatron-1T", True, 1008, 160, 25600, 128, 64, 512, 512, 1, None, 71.49,
                 mfu=0.563, hfu=0.570),
    # ... and the full-recompute baseline on the same configurations.
    _korthikanti("22B", "megatron-22B", False, 22, 64, 6144, 48, 1, 8, 4, 4, None, 1.42),
    _korthikanti("175B", "gpt3-175B", False, 175, 96, 12288, 96, 8, 64, 64, 1, 3, 18.13),
    _korthikanti("530B", "turing-530B", False, 530, 128, 20480, 105, 35, 280, 280, 1, 3, 49.05),
    _korthikanti("1T", "megatron-1T", False, 1008, 160, 25600, 128, 64, 512, 512, 1, None, 94.42),
    # --- Megatron-LM README, 2024: weak scaling on H100. Order of arguments: row, heads, hidden,
    # layers, tp, pp, GPUs, batch, TFLOP/s per GPU, MFU %, aggregate PFLOP/s
    _megatron_h100("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8, 41, 19.6),
    _megatron_h100("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9, 47, 44.7),
    _megatron_h100("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1, 49, 93.9),
    _megatron_h100("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6, 46, 176.5),
    _megatron_h100("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7, 42, 322.3),
    _megatron_h100("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5, 43, 645.9),
    _megatron_h100("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8, 44, 997.2),
    _megatron_h100("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4, 48, 1457.4),
    _megatron_h100("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9, 47, 2825.6),
    # --- torchtitan, end of 2024, Llama 3.1 on H100 96 GB HBM2e at 500 W (Grand Teton).
    _titan("torchtitan-8b-fsdp8", TITAN_2412.format(table=1, row="FSDP", size="8b"), "h100_hbm2e",
           LLAMA31_8B, devices=8, fsdp=8, local_batch=2, checkpointing="selective", tps=5762,
           memory=82.4),
    _titan("torchtitan-8b-fsdp8-compile", TITAN_2412.format(table=1, row="FSDP + torch.compile",
           size="8b"), "h100_hbm2e", LLAMA31_8B, devices=8, fsdp=8, local_batch=2,
           checkpointing="selective", tps=6667, memory=77.0, compile=True),
    _titan("torchtitan-8b-fsdp8-compile-float8", TITAN_2412.format(
           table=1, row="FSDP + torch.compile + Float8", size="8b"), "h100_hbm2e", LLAMA31_8B,
           devices=8, fsdp=8, local_batch=2, checkpointing="selective", tps=8532, memory=76.8,
           compile=True, float8=_F8),
    *(
        _titan(f"torchtitan-8b-fsdp{fsdp}-cp{cp}", TITAN_2412.format(
               table=2, row=f"FSDP {fsdp}, CP {cp}", size="8b"), "h100_hbm2e",
               replace(LLAMA31_8B, seq_len=seq), devices=8, fsdp=fsdp, cp=cp, local_batch=1,
               checkpointing="full", tps=tps, memory=memory, compile=True, float8=_F8)
        for fsdp, cp, seq, tps, memory in (
            (8, 1, 32768, 3890, 83.9), (4, 2, 65536, 2540, 84.2),
            (2, 4, 131072, 1071, 84.0), (1, 8, 262144, 548, 84.5))
    ),
    _titan("torchtitan-8b-fsdp128", TITAN_2412.format(table=3, row="FSDP", size="8b"),
           "h100_hbm2e", LLAMA31_8B, devices=128, fsdp=128, local_batch=2,
           checkpointing="selective", tps=5605, memory=67.0),
    _titan("torchtitan-8b-fsdp128-compile", TITAN_2412.format(
           table=3, row="FSDP + torch.compile", size="8b"), "h100_hbm2e", LLAMA31_8B,
           devices=128, fsdp=128, local_batch=2, checkpointing="selective", tps=6514, memory=62.0,
           compile=True),
    _titan("torchtitan-8b-fsdp128-compile-float8", TITAN_2412.format(
           table=3, row="FSDP + torch.compile + Float8", size="8b"), "h100_hbm2e", LLAMA31_8B,
           devices=128, fsdp=128, local_batch=2, checkpointing="selective", tps=8380, memory=61.8,
           compile=True, float8=_F8),
    _titan("torchtitan-70b-fsdp32-tp8", TITAN_2412.format(table=4, row="2D", size="70b"),
           "h100_hbm2e", LLAMA31_70B, devices=256, tp=8, fsdp=32, local_batch=16,
           checkpointing="full", tps=829, memory=71.9, compile=True, float8=_F8),
    _titan("torchtitan-70b-fsdp32-tp8-asynctp", TITAN_2412.format(
           table=4, row="2D + AsyncTP", size="70b"), "h100_hbm2e", LLAMA31_70B, devices=256,
           tp=8, fsdp=32, local_batch=16, checkpointing="full", tps=876, memory=67.6, compile=True,
           float8=_F8, async_tp=True),
    _titan("torchtitan-405b-fsdp8-tp8-pp8-1f1b", TITAN_2412.format(
           table=5, row="1F1B", size="405b"), "h100_hbm2e", LLAMA31_405B, devices=512, tp=8, pp=8,
           fsdp=8, local_batch=32, checkpointing="full", tps=100, memory=82.5, compile=True,
           float8=_F8, async_tp=True, schedule="1F1B",
           notes="micro-batch size not stated"),
    _titan("torchtitan-405b-fsdp8-tp8-pp8-interleaved", TITAN_2412.format(
           table=5, row="Interleaved 1F1B", size="405b"), "h100_hbm2e", LLAMA31_405B, devices=512,
           tp=8, pp=8, fsdp=8, local_batch=32, checkpointing="full", tps=128, memory=72.7,
           compile=True, float8=_F8, async_tp=True, schedule="interleaved-1F1B",
           notes="micro-batch size and stages per rank not stated"),
    *(
        _titan(f"torchtitan-405b-fsdp{fsdp}-cp{cp}-tp8-pp8", TITAN_2412.format(
               table=6, row=f"FSDP {fsdp}, CP {cp}", size="405b"), "h100_hbm2e",
               replace(LLAMA31_405B, seq_len=seq), devices=512, tp=8, pp=8, fsdp=fsdp, cp=cp,
               local_batch=8, checkpointing="full", tps=tps, memory=memory, compile=True,
               float8=_F8, async_tp=True, schedule="1F1B",
               notes="micro-batch size not stated; global batch = local batch 8 x FSDP degree")
        for fsdp, cp, seq, tps, memory in (
            (8, 1, 32768, 76, 75.3), (4, 2, 65536, 47, 75.9),
            (2, 4, 131072, 31, 77.1), (1, 8, 262144, 16, 84.9))
    ),
    # --- torchtitan, June 2025, async TP on the same H100s: plain bf16 rows (no memory given).
    _titan("torchtitan-70b-fsdp32-tp8-bf16", TITAN_ASYNC.format(
           size="70b", gpus=256, column="Vanilla TP tokens/sec"), "h100_hbm2e", LLAMA31_70B,
           devices=256, tp=8, fsdp=32, local_batch=16, checkpointing="full", tps=597.3,
           memory=None, compile=True),
    _titan("torchtitan-70b-fsdp32-tp8-bf16-asynctp", TITAN_ASYNC.format(
           size="70b", gpus=256, column="Async TP tokens/sec"), "h100_hbm2e", LLAMA31_70B,
           devices=256, tp=8, fsdp=32, local_batch=16, checkpointing="full", tps=652.4,
           memory=None, compile=True, async_tp=True),
    _titan("torchtitan-8b-fsdp8-tp8-bf16", TITAN_ASYNC.format(
           size="8b", gpus=64, column="Vanilla TP tokens/sec"), "h100_hbm2e", LLAMA31_8B,
           devices=64, tp=8, fsdp=8, local_batch=12, checkpointing="selective", tps=4378,
           memory=None, compile=True),
    _titan("torchtitan-8b-fsdp8-tp8-bf16-asynctp", TITAN_ASYNC.format(
           size="8b", gpus=64, column="Async TP tokens/sec"), "h100_hbm2e", LLAMA31_8B,
           devices=64, tp=8, fsdp=8, local_batch=12, checkpointing="selective", tps=4809.4,
           memory=None, compile=True, async_tp=True),
    # --- torchtitan, June 2025, Llama 3.1 8B FSDP on H200 (Trainy on WhiteFiber).
    *(
        _titan(f"torchtitan-8b-fsdp{8 * nodes}-h200", TITAN_H200.format(nodes=nodes), "h200",
               LLAMA31_8B, devices=8 * nodes, fsdp=8 * nodes, local_batch=2,
               checkpointing="selective", tps=tps, memory=memory, compile=True, float8=_F8,
               notes="float8 with FSDP float8 all-gather and fp8 weight recomputed in backward")
        for nodes, tps, memory in ((4, 10938, 47.96), (8, 10753, 46.97))
    ),
    # --- MosaicML llm-foundry, MPT on A100 / H100 with PyTorch FSDP (published_rows/llm_foundry.py).
    *llm_foundry.ROWS,
    # --- Hugging Face nanotron, best layouts on 1-64 nodes of 8 H100s (published_rows/nanotron.py).
    *nanotron.ROWS,
    # --- NVIDIA DGX Cloud recipes, Megatron tp x pp (interleaved) on DGX H100 (published_rows/dgxc.py).
    *dgxc.ROWS,
    # --- The same recipes for Llama 3.1 with context parallel 2 (published_rows/dgxc_cp.py).
    *dgxc_cp.ROWS,
)


def rows(hardware: HardwareName | None = None) -> tuple[PublishedRun, ...]:
    """The published rows, or those measured on one hardware profile."""
    return tuple(r for r in PUBLISHED_RUNS if hardware is None or r.hardware == hardware)


def megatron_flops_per_iteration(row: PublishedRun, *, count_recompute: bool = True) -> float:
    """FLOPs of one iteration (the global batch) by the Megatron papers' formulas (GPT rows).

    ``24 k B s l h^2 (1 + s/(6h)) + 6 B s h V`` with ``k`` passes over the layers: 3 (forward and
    backward), 4 with full recomputation counted (Narayanan et al.'s Eq. 3, their 96 = 24 * 4).
    Selective recomputation counted adds the attention core once more (Korthikanti et al.'s HFU:
    s/(3h) in place of s/(6h)). With ``count_recompute=False`` it is the model FLOPs.
    """
    m, batch = row.model, row.layout.global_batch_size
    s, l, h, v = m.seq_len, m.n_layers, m.dim, m.vocab_size
    mode = row.layout.activation_checkpointing if count_recompute else "none"
    passes = 4 if mode == "full" else 3
    attention = s / (3 * h) if mode == "selective" else s / (6 * h)
    return 24 * passes * batch * s * l * h**2 * (1 + attention) + 6 * batch * s * h * v


def matmul_params(model: ModelShape) -> int:
    """Weights that enter a matmul per token: every layer's projections and the output head;
    the input embedding, positions, norms and biases are left out (as torchtitan's MFU does)."""
    head_dim = model.dim // model.n_heads
    attention = 2 * model.dim * (model.n_heads + model.n_kv_heads) * head_dim  # q, o; k, v
    mlp_matrices = 3 if model.arch == "llama" else 2
    return model.n_layers * (attention + mlp_matrices * model.dim * model.ffn_hidden_dim) \
        + model.vocab_size * model.dim


def model_flops_per_token(row: PublishedRun) -> float:
    """Training model FLOPs per token: ``6 N + 12 l h s`` (PaLM's convention, torchtitan's MFU),
    N = :func:`matmul_params`, the attention term without causal savings or recomputation.
    For a GPT row it equals :func:`megatron_flops_per_iteration` with ``count_recompute=False``
    divided by the tokens of the batch."""
    m = row.model
    return 6 * matmul_params(m) + 12 * m.n_layers * m.dim * m.seq_len


def parameter_count(model: ModelShape) -> int:
    """All parameters: Megatron's GPT (learned positions, biases, LayerNorms; its count leaves
    out the final LayerNorm) or Llama (RMSNorms, no biases); the output head once if untied."""
    embeddings = (1 if model.tied_output else 2) * model.vocab_size * model.dim
    if model.arch == "gpt":  # q, k, v, out with the model's K/V heads (4 h^2 when all heads are K/V heads)
        per_layer = matmul_params(replace(model, n_layers=1, vocab_size=0)) \
            + 9 * model.dim + model.ffn_hidden_dim  # biases (qkv, out, fc1, fc2) and 2 LayerNorms
        return model.n_layers * per_layer + embeddings + model.seq_len * model.dim
    norms = 2 * model.dim
    per_layer = matmul_params(replace(model, n_layers=1, vocab_size=0))
    return model.n_layers * (per_layer + norms) + embeddings + model.dim


def _fmt(value: float | None, spec: str) -> str:
    """``value`` in ``spec`` (width first, e.g. '8.1f'), or a dash as wide."""
    return f"{'-':>{int(spec.split('.')[0])}}" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hardware", default=None, help="only rows on this profile")
    args = parser.parse_args()
    print(f"{'name':44} {'hw':10} {'GPUs':>5} {'tp':>3} {'pp':>3} {'dp':>4} {'cp':>3} "
          f"{'gbs':>5} {'TFLOP/s':>8} {'tok/s':>8} {'MFU':>5} {'iter s':>7} {'GiB':>6}")
    for r in rows(args.hardware):
        lay, rep = r.layout, r.reported
        print(f"{r.name:44} {r.hardware:10} {lay.devices:5} {lay.tp:3} {lay.pp:3} {lay.dp:4} "
              f"{lay.cp:3} {lay.global_batch_size:5} {_fmt(rep.tflops_per_device, '8.1f')} "
              f"{_fmt(rep.tokens_per_s_per_device, '8.1f')} {_fmt(rep.mfu, '5.3f')} "
              f"{_fmt(rep.iteration_time_s, '7.2f')} {_fmt(rep.peak_memory_gib, '6.1f')}")


if __name__ == "__main__":
    main()
