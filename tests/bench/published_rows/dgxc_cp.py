"""NVIDIA's DGX Cloud benchmarking recipes for Llama 3.1: Megatron (NeMo 24.09) on DGX H100, BF16,
context parallel 2 (with tensor x pipeline for the 70B and 405B).

Source: NVIDIA/dgxc-benchmarking at commit 35a9aec (tag v24.11.1), the "Expected Performance"
tables of ``llama3.1/README_8b.md``, ``README_70b.md`` and ``README_405b.md``: per GPU count (8 H100s
a node) the training step time in seconds, the throughput in tokens per second (``sequence length *
global batch / step time``) and the MFU. Each table's title states TP, PP, CP, VP (model chunks per
pipeline rank), the micro-batch and the accumulation; the columns' headers state the global batch
(8B, 70B). Only the BF16 tables are here (the FP8 ones have the same layouts). Every column of the
three BF16 tables is a row: 5 + 6 + 6.

The 405B table is a weak-scaling table whose first three columns train a truncated model: its own
rows "Layers", "GBS", "PP" and "VP" give 7 layers on PP 1 (32 GPUs, no interleaving), 21 and 42
layers on PP 3 with VP 7 (96, 192 GPUs), then the full 126 layers on PP 9, VP 7. The recipe's
``configure.sh`` at the same commit sets exactly these (``NUM_LAYERS``, ``PP``, ``VP=null``, ``GBS``
per GPU count) and scales the global batch with the GPUs elsewhere (128 per 8 GPUs for the 8B, 128
per 64 for the 70B, 252 per 576 for the 405B).

The rest of the configuration is the recipe's Hydra file, ``llama3.1/llama3.1_{8b,70b,405b}.yaml``
@35a9aec: ``encoder_seq_length: 8192``, layers, ``hidden_size``, ``ffn_hidden_size``,
``num_attention_heads``, ``num_query_groups`` (8, 8 and 16: the 405B recipe uses 16 K/V groups, not
the released model's 8), ``activation: fast-swiglu``, RMSNorm, RoPE, no biases, untied output
(``share_embeddings_and_output_weights: false``), ``activations_checkpoint_granularity: null`` (no
recomputation), ``sequence_parallel`` (false for the 8B at TP 1, true for the others), the distributed
optimizer (``distributed_fused_adam``: optimizer states over data parallel, zero1 here) and
``ub_tp_comm_overlap`` (70B, 405B on). No ``account_for_embedding_in_pipeline_split`` or
``num_layers_in_first/last_pipeline_stage`` is set: Megatron splits the layers evenly over the
PP x VP model chunks (126 / 63 = 2 layers each; 80 / 20 = 4), the embedding on the first chunk and
the output layer and loss on the last. The vocabulary (128256) is the READMEs' Notes; the 8B and
70B runs use the Llama 3.1 tokenizer (``configure.sh``: ``model.tokenizer.type=/dataset/llama``).

MFU (README): ``global batch * model flops per sample / step time / GPUs / 989e12``, with the Notes'
model flops per sample ``s * (12 l h^2 (1 + g/a + s/h) + 18 l f h + 6 V h)`` (g query groups, a
heads, f FFN size): exactly ``(6 N + 12 l h s) * s`` of ``published.model_flops_per_token``. The
truncated 405B columns' MFU is the same formula at their layer count (the unit test checks it).
The printed MFUs are 0.05-0.15% (relative) below that formula on the printed step time, every column
alike. The 70B's 2048-GPU column is a copy slip: its tokens/s (2248957) is twice the 1024 column's
(1124478) and its MFU repeats that column's 53.38%, where its own step time, 14.98 s, gives 2239949
tokens/s and 53.24%; both are kept as printed, and the bench compares step times.
"""

from __future__ import annotations

from published_rows.schema import H100_PEAK_DENSE_BF16_TFLOPS, Layout, ModelShape, PublishedRun, Reported

SOURCE = ("NVIDIA/dgxc-benchmarking llama3.1/README_{size}.md @35a9aec (v24.11.1), table '{title}', "
          "column 'Throughput on {gpus}x H100 GPUs'{extra}; configuration: llama3.1/llama3.1_{size}.yaml "
          "and llama3.1/configure.sh @35a9aec")
FORMULA = ("s*(12*l*h^2*(1 + g/a + s/h) + 18*l*f*h + 6*V*h) per sample (the README's Notes), over "
           "989 TFLOP/s; {flops} per sample as printed for the full model")


def _llama(layers: int, dim: int, heads: int, groups: int, ffn: int, params: float) -> ModelShape:
    """A Llama 3.1 recipe's shape: vocab 128256, sequence 8192, untied output."""
    return ModelShape("llama", layers, dim, heads, groups, ffn, 128256, 8192, params, tied_output=False)


# name: (table title, TP, CP, MBS, TP comm overlap, model flops per sample as printed (full model))
RECIPES = {
    "8b": ("Llama 3.1 8b 24.09 BF16 (TP=1, PP=1, CP=2, MBS=1, GA=32)", 1, 2, 1, False, 4.74e14),
    "70b": ("Llama 3.1 70b 24.09 BF16 (TP=4, PP=4, CP=2, VP=5, MBS=1, GA=64)", 4, 2, 1, True, 3.94e15),
    "405b": ("Llama 3.1 405b 24.09 BF16 (TP=8, PP=9, CP=2, VP=7, MBS=1, GA=63)", 8, 2, 1, True, 2.17e16),
}
# Sizes as the recipes name them ("8b", "70b", "405b": 8.03, 70.6 and, with 16 K/V groups, 410.1
# counted); the truncated 405B models as counted (26.8, 71.8, 139.5).
_8B = _llama(32, 4096, 32, 8, 14336, 8.0)
_70B = _llama(80, 8192, 64, 8, 28672, 70.0)
_405B = {layers: _llama(layers, 16384, 128, 16, 53248, params)
         for layers, params in ((7, 26.8), (21, 71.8), (42, 139.5), (126, 405.0))}

# (size, model, GPUs, PP, VP, global batch, step time s, tokens/s, MFU %), in the tables' column order.
_COLUMNS = (
    ("8b", _8B, 8, 1, None, 128, 12.91, 81222, 59.37),
    ("8b", _8B, 16, 1, None, 256, 13.00, 161319, 58.96),
    ("8b", _8B, 32, 1, None, 512, 13.05, 321403, 58.73),
    ("8b", _8B, 64, 1, None, 1024, 13.08, 641331, 58.60),
    ("8b", _8B, 128, 1, None, 2048, 13.10, 1280704, 58.51),
    ("70b", _70B, 64, 4, 5, 128, 14.72, 71235, 54.10),
    ("70b", _70B, 128, 4, 5, 256, 14.73, 142373, 54.06),
    ("70b", _70B, 256, 4, 5, 512, 14.8, 283399, 53.81),
    ("70b", _70B, 512, 4, 5, 1024, 14.89, 563372, 53.48),
    ("70b", _70B, 1024, 4, 5, 2048, 14.92, 1124478, 53.38),
    ("70b", _70B, 2048, 4, 5, 4096, 14.98, 2248957, 53.38),  # as printed: see the docstring
    ("405b", _405B[7], 32, 1, None, 126, 8.85, 116632, 58.63),
    ("405b", _405B[21], 96, 3, 7, 126, 8.75, 117965, 56.17),  # printed "8.7  5"
    ("405b", _405B[42], 192, 3, 7, 252, 16.93, 121936, 57.25),
    ("405b", _405B[126], 576, 9, 7, 252, 17.20, 120022, 55.78),
    ("405b", _405B[126], 1152, 9, 7, 504, 17.52, 235660, 54.76),
    ("405b", _405B[126], 2304, 9, 7, 1008, 17.62, 468646, 54.45),
)


def _notes(size: str, model: ModelShape, pp: int, vp: int | None, tp_overlap: bool) -> str:
    """What the row's layout takes from the recipe rather than the table."""
    split = (f"layers split evenly over {pp} x {vp} model chunks ({model.n_layers // (pp * vp)} each; no "
             "account_for_embedding_in_pipeline_split in the recipe), embedding on the first, output and "
             "loss on the last" if vp else "no pipeline")
    truncated = (f"; a {model.n_layers}-layer truncation of the 405B (the table's 'Layers' row and "
                 "configure.sh's NUM_LAYERS)" if size == "405b" and model.n_layers < 126 else "")
    if pp == 1 and size == "405b":  # configure.sh's 32-GPU case
        truncated += ", defer_embedding_wgrad_compute=false"
    tokenizer = ("; the 405B recipe runs mock data with a GPT2BPETokenizer from ${data_dir}/vocab.json, a "
                 "file the repository does not ship: the vocabulary is the Notes' 128256"
                 if size == "405b" else "")
    return (f"NeMo 24.09 container; no activation recomputation; distributed optimizer with grad and param "
            f"sync overlap; TP communication overlap (ub_tp_comm_overlap) {'on' if tp_overlap else 'off'}; "
            f"{split}{truncated}{tokenizer}; the step time is the run's last step (README)")


def _row(size: str, model: ModelShape, gpus: int, pp: int, vp: int | None, batch: int, seconds: float,
         tokens_per_s: int, mfu: float) -> PublishedRun:
    """One table column as a :class:`PublishedRun`."""
    title, tp, cp, mbs, tp_overlap, flops = RECIPES[size]
    extra = (f", rows Layers={model.n_layers}, GBS={batch}, PP={pp}, VP={vp or 'n/a'}" if size == "405b"
             else f" (GBS={batch})")
    return PublishedRun(
        name=f"dgxc-llama3.1-{size}-{gpus}gpu",
        source=SOURCE.format(size=size, title=title, gpus=gpus, extra=extra),
        hardware="h100_sxm",
        model=model,
        layout=Layout(
            devices=gpus, nodes=gpus // 8, tp=tp, pp=pp, dp=gpus // (tp * pp * cp), cp=cp,
            sequence_parallel=tp > 1, virtual_stages=vp, micro_batch_size=mbs, global_batch_size=batch,
            precision="bf16", activation_checkpointing="none", data_parallel="zero1",
            pipeline_schedule=("interleaved-1F1B" if vp else "1F1B") if pp > 1 else None),
        reported=Reported(iteration_time_s=seconds, aggregate_tokens_per_s=tokens_per_s, mfu=mfu / 100,
                          mfu_peak_tflops=H100_PEAK_DENSE_BF16_TFLOPS, flops_kind="model",
                          flops_formula=FORMULA.format(flops=f"{flops:.3g}")),
        notes=_notes(size, model, pp, vp, tp_overlap),
    )


ROWS: tuple[PublishedRun, ...] = tuple(_row(*column) for column in _COLUMNS)
