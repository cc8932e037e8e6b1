"""NVIDIA's DGX Cloud benchmarking recipes: Megatron (NeMo 24.11) on DGX H100, BF16, tensor x pipeline.

Source: NVIDIA/dgxc-benchmarking at commit 35a9aec (tag v24.11.1), the "Expected Performance"
tables of ``nemo_megatron/README_175b.md`` (GPT-3 175B), ``nemotron/README_340b.md`` (Nemotron-4
340B) and ``nemotron/README_15b.md`` (Nemotron-4 15B): per GPU count (8 H100s a node, DGX H100) the
global batch, the training step time in seconds, the throughput in tokens per second (``sequence
length * global batch / step time``) and the MFU. Each table's title states TP, PP, VP (model
chunks per pipeline rank, the interleaved schedule), the micro-batch and accumulation; only the
BF16 tables are here (the FP8 ones are the same layouts). Every column of the three BF16 tables
is a row: 5 + 5 + 8.

The rest of the configuration is the recipe's own Hydra file at the same commit,
``nemo_megatron/gpt3_175b_hydra.yaml``, ``nemotron/nemotron4-340b-synth.yaml`` and
``nemotron4-15b-synth.yaml``: sequence length, layers, hidden and FFN sizes, heads and query groups,
``sequence_parallel: true``, ``activations_checkpoint_granularity`` (null: none; selective:
Megatron's recomputation of the attention core, for the 340B only), the distributed optimizer
(``distributed_fused_adam``: optimizer states sharded over data parallel, zero1 here),
``ub_tp_comm_overlap`` (the TP communication overlapped with GEMMs: 175B and 15B on, 340B off).
The vocabulary is the READMEs' "Notes" (51200; 256000). Nemotron-4's MLP is squared-ReLU with
two matrices of 4h (``activation: squared-relu``), RoPE, no biases: a ``gpt`` shape here has the
same matmuls (its learned positions and biases are under 0.1% of the parameters).

MFU (README): ``global batch * model flops per sample / step time / GPUs / 989e12`` with the
READMEs' model flops per sample ``s * (24 l h^2 + 12 l h s + 48 l h^2 + 6 V h)``: multi-head
attention and a 4h MLP whatever the model's K/V heads (Nemotron-4 has 8 query groups), rounded
to the printed value (2.20E+15, 1.01e16, 434.5e12).
"""

from __future__ import annotations

from published_rows.schema import H100_PEAK_DENSE_BF16_TFLOPS, Layout, ModelShape, PublishedRun, Reported

SOURCE = ("NVIDIA/dgxc-benchmarking {readme} @35a9aec (v24.11.1), table '{title}', column "
          "'{gpus}x H100 GPUs (GBS={gbs})'; configuration: {config} @35a9aec")
FORMULA = "s*(24*l*h^2 + 12*l*h*s + 48*l*h^2 + 6*V*h) per sample (the README's Notes), over 989 TFLOP/s"

# name: (README, Hydra config, table title, model, TP, PP, VP, MBS, checkpointing, TP comm overlap,
#        model flops per sample as printed)
RECIPES = {
    "gpt3-175b": (
        "nemo_megatron/README_175b.md", "nemo_megatron/gpt3_175b_hydra.yaml",
        "NeMo Megatron 24.11 BF16 (TP=4,PP=8, MBS=1, VP=12, SEQ=2048)",
        ModelShape("gpt", 96, 12288, 96, 96, 49152, 51200, 2048, 175.0), 4, 8, 12, 1, "none", True, 2.20e15),
    "nemotron4-340b": (
        "nemotron/README_340b.md", "nemotron/nemotron4-340b-synth.yaml",
        "Nemotron4 340b 24.11 BF16 (TP=8, PP=8, MBS=1, GA=16, VP=12)",
        ModelShape("gpt", 96, 18432, 96, 8, 73728, 256000, 4096, 340.0, tied_output=False),
        8, 8, 12, 1, "selective", False, 1.01e16),
    "nemotron4-15b": (
        "nemotron/README_15b.md", "nemotron/nemotron4-15b-synth.yaml",
        "Nemotron4 15b 24.11 BF16 (TP=4, PP=1, MBS=4, GA=4)",
        ModelShape("gpt", 32, 6144, 48, 8, 24576, 256000, 4096, 15.6, tied_output=False),  # "15b": 15.6 counted
        4, 1, None, 4, "none", True, 434.5e12),
}

# (recipe, GPUs, global batch, step time s, tokens/s, MFU %), in the tables' column order.
_COLUMNS = (
    ("gpt3-175b", 128, 256, 8.91, 58843, 49.93),
    ("gpt3-175b", 256, 512, 8.95, 117159, 49.71),
    ("gpt3-175b", 512, 1024, 9.09, 230710, 48.94),
    ("gpt3-175b", 1024, 2048, 9.01, 465517, 49.38),
    ("gpt3-175b", 2048, 4096, 9.02, 930001, 49.32),
    ("nemotron4-340b", 128, 32, 4.61, 28432, 55.38),
    ("nemotron4-340b", 256, 64, 4.67, 56134, 54.67),
    ("nemotron4-340b", 512, 128, 4.7, 111551, 54.32),
    ("nemotron4-340b", 1024, 256, 4.73, 221686, 53.98),
    ("nemotron4-340b", 2048, 512, 4.84, 433296, 52.75),
    ("nemotron4-15b", 16, 64, 2.83, 92630, 62.10),
    ("nemotron4-15b", 32, 128, 2.86, 183317, 61.45),
    ("nemotron4-15b", 64, 256, 2.86, 366635, 61.45),
    ("nemotron4-15b", 128, 512, 2.89, 725658, 60.81),
    ("nemotron4-15b", 256, 1024, 2.88, 1456356, 61.02),
    ("nemotron4-15b", 512, 2048, 2.92, 2872811, 60.18),
    ("nemotron4-15b", 1024, 4096, 2.92, 5745622, 60.18),
    ("nemotron4-15b", 2048, 8192, 2.96, 11335957, 59.37),
)


def _row(recipe: str, gpus: int, batch: int, seconds: float, tokens_per_s: int, mfu: float) -> PublishedRun:
    """One table column as a :class:`PublishedRun`."""
    readme, config, title, model, tp, pp, vp, mbs, checkpointing, tp_overlap, flops = RECIPES[recipe]
    return PublishedRun(
        name=f"dgxc-{recipe}-{gpus}gpu",
        source=SOURCE.format(readme=readme, title=title, gpus=gpus, gbs=batch, config=config),
        hardware="h100_sxm",
        model=model,
        layout=Layout(
            devices=gpus, nodes=gpus // 8, tp=tp, pp=pp, dp=gpus // (tp * pp), cp=1,
            sequence_parallel=True, virtual_stages=vp, micro_batch_size=mbs, global_batch_size=batch,
            precision="bf16", activation_checkpointing=checkpointing, data_parallel="zero1",
            pipeline_schedule=("interleaved-1F1B" if vp else "1F1B") if pp > 1 else None),
        reported=Reported(iteration_time_s=seconds, aggregate_tokens_per_s=tokens_per_s, mfu=mfu / 100,
                          mfu_peak_tflops=H100_PEAK_DENSE_BF16_TFLOPS, flops_kind="model",
                          flops_formula=f"{FORMULA}; {flops:.4g} per sample as printed"),
        notes=f"NeMo 24.11 container; distributed optimizer with grad and param sync overlap; TP "
              f"communication overlap (ub_tp_comm_overlap) {'on' if tp_overlap else 'off'}; the step "
              "time is the run's last step (README)",
    )


ROWS: tuple[PublishedRun, ...] = tuple(_row(*column) for column in _COLUMNS)
