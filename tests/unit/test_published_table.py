"""The published-runs table (tests/bench/published.py) is well formed and agrees with itself.

Layouts multiply to their device counts, every source ran 8 GPUs a node, batches divide into
micro-batches, and the FLOP formulas reproduce the papers' own columns from the rows' shapes:
Narayanan et al.'s parameter counts, aggregate PFLOP/s and percent of peak, and Korthikanti et al.'s
MFU / HFU from their iteration times. A transcription slip in a row fails one of these.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "published.py"
_SPEC = importlib.util.spec_from_file_location("published_runs_table", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
published = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = published  # dataclasses look their module up while the class is built
_SPEC.loader.exec_module(published)

ROWS = published.rows()
NARAYANAN = [r for r in ROWS if r.name.startswith("megatron2021-")]
KORTHIKANTI = [r for r in ROWS if r.name.startswith("korthikanti2022-")]
PEAK = published.A100_PEAK_DENSE_16BIT_TFLOPS
H100_PEAK_DENSE_BF16_TFLOPS = 989.0  # H100 SXM datasheet; Megatron's 408.8 TFLOP/s = 41% MFU


def _ids(rows):
    return [r.name for r in rows]


def test_table_has_the_required_rows_with_unique_names():
    assert _ids(NARAYANAN) == [f"megatron2021-{size}" for size in
                               ("1.7B", "3.6B", "7.5B", "18B", "39B", "76B", "145B", "310B",
                                "530B", "1T")]
    assert len(KORTHIKANTI) == 8
    assert len({r.name for r in ROWS}) == len(ROWS)
    assert sum(r.reported.peak_memory_gib is not None for r in ROWS) >= 16
    assert published.rows("h200") == tuple(r for r in ROWS if r.hardware == "h200")
    assert len(published.rows("h200")) == 2


@pytest.mark.parametrize("row", ROWS, ids=_ids(ROWS))
def test_layout_multiplies_to_devices_and_fills_whole_nodes(row):
    lay = row.layout
    assert lay.tp * lay.pp * lay.dp * lay.cp == lay.devices
    assert lay.nodes * 8 == lay.devices  # every source here ran 8 GPUs a node
    if lay.micro_batch_size is not None:
        assert lay.global_batch_size % (lay.micro_batch_size * lay.dp) == 0
    if lay.virtual_stages is not None:
        assert lay.virtual_stages > 1
        assert row.model.n_layers % (lay.pp * lay.virtual_stages) == 0
    if lay.pp > 1:
        assert lay.pipeline_schedule is not None
    assert (lay.precision == "fp8") == (lay.float8 is not None)


@pytest.mark.parametrize("row", ROWS, ids=_ids(ROWS))
def test_model_shape_and_reported_units_are_sane(row):
    m, rep = row.model, row.reported
    assert m.dim % m.n_heads == 0 and m.n_heads % m.n_kv_heads == 0
    assert m.seq_len % row.layout.cp == 0
    # Within the published rounding (one decimal) or 2% of a nominal size ("70B").
    tolerance = max(0.06, 0.02 * m.params_billion)  # 0.06: positions counted or not (RoPE)
    assert abs(published.parameter_count(m) / 1e9 - m.params_billion) <= tolerance
    for fraction in (rep.mfu, rep.hfu):  # nanotron's 1.34B on 64 nodes: 5%; llm-foundry's A100 HFU: 74%
        assert fraction is None or 0.03 < fraction < 0.8
    peak = H100_PEAK_DENSE_BF16_TFLOPS if row.hardware.startswith(("h100", "h200")) else PEAK
    assert rep.tflops_per_device is None or 50 < rep.tflops_per_device < peak
    if rep.tflops_per_device is not None and rep.mfu is not None:
        assert round(100 * rep.tflops_per_device / peak) == round(100 * rep.mfu)
    if rep.tokens_per_s_per_device is not None:  # below the peak at 16-bit (fp8 rows: twice it)
        implied = rep.tokens_per_s_per_device * published.model_flops_per_token(row) / (peak * 1e12)
        assert 0.01 < implied < (2 if row.layout.precision == "fp8" else 1)
    assert rep.peak_memory_gib is None or 1 < rep.peak_memory_gib < 141
    assert any(v is not None for v in (rep.tflops_per_device, rep.tokens_per_s_per_device,
                                       rep.iteration_time_s, rep.mfu))
    assert row.source and ("@" in row.source)  # a commit or a table row is named


@pytest.mark.parametrize("row", NARAYANAN, ids=_ids(NARAYANAN))
def test_narayanan_columns_agree_with_the_papers_formulas(row):
    rep, lay = row.reported, row.layout
    # Parameter column: Megatron's count rounds to the published value.
    assert round(published.parameter_count(row.model) / 1e9, 1) == row.model.params_billion
    # Aggregate PFLOP/s = per-GPU TFLOP/s x GPUs, the per-GPU value rounded to a whole TFLOP/s.
    assert abs(rep.aggregate_pflops * 1e3 / lay.devices - rep.tflops_per_device) <= 0.5 + 0.05
    # Percent of the 312 TFLOP/s peak, rounded to a whole percent.
    assert round(100 * rep.tflops_per_device / PEAK) == round(100 * rep.hfu)
    # The implied iteration time (Eq. 3 FLOPs over the aggregate rate) is a plausible step.
    seconds = published.megatron_flops_per_iteration(row) / (rep.aggregate_pflops * 1e15)
    assert 1 < seconds < 200


@pytest.mark.parametrize("row", [r for r in KORTHIKANTI if r.reported.mfu is not None],
                         ids=_ids([r for r in KORTHIKANTI if r.reported.mfu is not None]))
def test_korthikanti_iteration_time_reproduces_mfu_and_hfu(row):
    rep, devices = row.reported, row.layout.devices
    model = published.megatron_flops_per_iteration(row, count_recompute=False)
    hardware = published.megatron_flops_per_iteration(row)
    peak_flops = rep.iteration_time_s * devices * PEAK * 1e12
    assert model / peak_flops == pytest.approx(rep.mfu, abs=0.002)
    assert hardware / peak_flops == pytest.approx(rep.hfu, abs=0.002)


@pytest.mark.parametrize("row", [r for r in ROWS if r.reported.aggregate_pflops is not None],
                         ids=_ids([r for r in ROWS if r.reported.aggregate_pflops is not None]))
def test_aggregate_is_per_device_times_devices(row):
    rep, devices = row.reported, row.layout.devices
    # Both columns are rounded: per-device to 1 TFLOP/s (2021) or 0.1 (2024), aggregate to 0.1 PF.
    tolerance = (0.5 if rep.tflops_per_device == int(rep.tflops_per_device) else 0.05) \
        + 0.05e3 / devices
    assert abs(rep.aggregate_pflops * 1e3 / devices - rep.tflops_per_device) <= tolerance


def test_selective_beats_full_recompute_on_every_korthikanti_model():
    times = {r.name: r.reported.iteration_time_s for r in KORTHIKANTI}
    for size in ("22B", "175B", "530B", "1T"):
        full = times[f"korthikanti2022-{size}-full"]
        seqsel = times[f"korthikanti2022-{size}-seqsel"]
        assert 1.2 < full / seqsel < 1.4  # the paper's ~29-32% speed-up


def test_flop_helpers_on_known_values():
    one_t = next(r for r in NARAYANAN if r.name == "megatron2021-1T")
    b, s, l, h, v = 3072, 2048, 128, 25600, 51200
    expected = 96 * b * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))
    assert published.megatron_flops_per_iteration(one_t) == pytest.approx(expected, rel=1e-12)
    # Model FLOPs per token (6N + 12 l h s) is the 3-pass Megatron count divided by the tokens.
    per_token = published.megatron_flops_per_iteration(one_t, count_recompute=False) / (b * s)
    assert published.model_flops_per_token(one_t) == pytest.approx(per_token, rel=1e-12)
    llama_8b = next(r for r in ROWS if r.name == "torchtitan-8b-fsdp8")
    assert published.parameter_count(llama_8b.model) == 8_030_261_248  # Llama 3.1 8B
    assert llama_8b.model.ffn_hidden_dim == 14336
    # 6 x (8.03e9 - 525M embedding) + 12 x 32 x 4096 x 8192 attention
    assert published.model_flops_per_token(llama_8b) == pytest.approx(
        6 * (8_030_261_248 - 128256 * 4096 - 65 * 4096) + 12 * 32 * 4096 * 8192, rel=1e-12)


LLM_FOUNDRY = [r for r in ROWS if r.name.startswith("llmfoundry-")]
NANOTRON = [r for r in ROWS if r.name.startswith("nanotron-")]


def test_new_sources_have_their_rows_and_state_their_layouts():
    assert len(LLM_FOUNDRY) == 88 and len(NANOTRON) == 26  # every seq-2048 table row; every heatmap cell
    for row in LLM_FOUNDRY + NANOTRON:
        assert row.layout.micro_batch_size is not None and row.layout.activation_checkpointing is not None
    assert all(r.reported.peak_memory_gib is not None for r in NANOTRON)
    assert sum(r.layout.tp > 1 and r.layout.pp > 1 for r in NANOTRON) == 5  # tp x pp on H100


@pytest.mark.parametrize("row", LLM_FOUNDRY, ids=_ids(LLM_FOUNDRY))
def test_llm_foundry_params_and_mfu_agree_with_the_table(row):
    m, rep = row.model, row.reported
    # NumParams column = Megatron's GPT count (learned positions, biases, tied) + the final LayerNorm.
    assert published.parameter_count(m) + 2 * m.dim == round(m.params_billion * 1e9)
    # MFU = (6 N + 12 l d s) * tokens/s / peak with the table's N; tokens/s/GPU is truncated.
    per_token = 6 * m.params_billion * 1e9 + 12 * m.n_layers * m.dim * m.seq_len
    tps = rep.tokens_per_s_per_device

    def mfu(tokens):
        return per_token * tokens / (rep.mfu_peak_tflops * 1e12)

    assert mfu(tps) - 5e-5 <= rep.mfu <= mfu(tps + 1) + 5e-5
    # HFU counts the recomputed forward (4 passes, not 3) when activations are checkpointed.
    passes = 4 / 3 if row.layout.activation_checkpointing == "full" else 1.0
    assert rep.hfu == pytest.approx(rep.mfu * passes, abs=1.5e-4)


def test_llm_foundry_batches_multiply_out():
    for _table, _size, gpus, *_, micro, accum, batch, _tps, _prec, _shard, _ac, _params in \
            published.llm_foundry._TABLE:
        assert batch == micro * accum * gpus


def _nanotron_estimate(layers, hidden, heads, intermediate, tied, vocab=131072):
    """scripts/scaling_benchmarks.py estimate_num_params @c2528430, K/V heads = heads."""
    embeddings = vocab * hidden if tied else 2 * vocab * hidden
    return embeddings + layers * (3 * hidden * intermediate + 4 * hidden * hidden)


def _nanotron_flops_per_token(layers, hidden, heads, ffn, vocab, seq):
    """nanotron get_flops (src/nanotron/models/llama.py @c2528430) for one sequence, per token."""
    head = hidden // heads
    forward = (2 * layers * seq * hidden * heads * head + 2 * layers * seq * hidden * 2 * heads * head
               + 2 * layers * heads * seq * head * seq * 2 + 2 * layers * heads * seq * head * hidden
               + 4 * layers * seq * hidden * ffn + 2 * layers * seq * ffn * hidden
               + 2 * seq * hidden * vocab)
    return 3 * forward / seq


@pytest.mark.parametrize("row", NANOTRON, ids=_ids(NANOTRON))
def test_nanotron_cells_agree_with_the_figure_and_the_script(row):
    m, lay = row.model, row.layout
    # The figure's model label is the script's parameter estimate with vocab 131072 and MHA.
    estimate = _nanotron_estimate(m.n_layers, m.dim, m.n_heads, m.ffn_hidden_dim, m.tied_output)
    assert float(f"{estimate / 1e9:.3g}") == m.params_billion  # three significant digits, as drawn
    # 8 GPUs a node; the playbook's 1M-token batch at sequence 4096.
    assert lay.dp * lay.tp * lay.pp == 8 * lay.nodes
    assert lay.global_batch_size * m.seq_len == 2**20
    # The MFU's FLOPs (nanotron's count) are this table's model FLOPs per token.
    assert published.model_flops_per_token(row) == pytest.approx(_nanotron_flops_per_token(
        m.n_layers, m.dim, m.n_heads, m.ffn_hidden_dim, m.vocab_size, m.seq_len), rel=1e-12)


DGXC = [r for r in ROWS if r in published.dgxc.ROWS]
DGXC_CP = [r for r in ROWS if r in published.dgxc_cp.ROWS]


@pytest.mark.parametrize("row", DGXC, ids=_ids(DGXC))
def test_dgxc_columns_agree_with_the_readmes_formulas(row):
    m, lay, rep = row.model, row.layout, row.reported
    recipe = row.name.removeprefix("dgxc-").rsplit("-", 1)[0]
    printed_flops = published.dgxc.RECIPES[recipe][-1]
    # Tokens/s = sequence length x global batch / step time (printed as an integer).
    assert rep.aggregate_tokens_per_s == pytest.approx(m.seq_len * lay.global_batch_size / rep.iteration_time_s, abs=1)
    # MFU = global batch x model flops per sample / step time / GPUs / 989e12, with the printed flops.
    mfu = lay.global_batch_size * printed_flops / rep.iteration_time_s / lay.devices / 989e12
    assert rep.mfu == pytest.approx(mfu, abs=1e-4)
    # The printed flops are the Notes' formula on this row's shape (MHA, 4h MLP), rounded (the 15B's
    # Notes print an attention term 0.03% off their own formula: 434.5e12 for 434.0e12).
    s, l, h, v = m.seq_len, m.n_layers, m.dim, m.vocab_size
    notes = s * (24 * l * h**2 + 12 * l * h * s + 48 * l * h**2 + 6 * v * h)
    assert notes == pytest.approx(printed_flops, rel=2.5e-3)  # printed to 3-4 digits
    # Accumulation steps: the titles' 16 (340B) and 4 (15B); the 175B's 2 sequences per GPU give 64.
    accumulation = lay.global_batch_size // (lay.dp * lay.micro_batch_size)
    assert accumulation == {"nemotron4-340b": 16, "nemotron4-15b": 4, "gpt3-175b": 64}[recipe]


def test_dgxc_cp_has_every_bf16_column():
    assert len(DGXC_CP) == 17  # 5 (8B) + 6 (70B) + 6 (405B) columns
    assert {r.layout.cp for r in DGXC_CP} == {2}
    truncated = [(r.layout.devices, r.model.n_layers, r.layout.pp, r.layout.virtual_stages)
                 for r in DGXC_CP if r.model.n_layers < 126 and "405b" in r.name]
    assert truncated == [(32, 7, 1, None), (96, 21, 3, 7), (192, 42, 3, 7)]  # the table's Layers / PP / VP rows


@pytest.mark.parametrize("row", DGXC_CP, ids=_ids(DGXC_CP))
def test_dgxc_cp_columns_agree_with_the_readmes_formulas(row):
    m, lay, rep = row.model, row.layout, row.reported
    size = row.name.removeprefix("dgxc-llama3.1-").split("-")[0]
    _title, tp, cp, mbs, _overlap, printed_flops = published.dgxc_cp.RECIPES[size]
    assert (lay.tp, lay.cp, lay.micro_batch_size) == (tp, cp, mbs)
    # Tokens/s = sequence length x global batch / step time (printed as an integer), but for the 70B's
    # 2048-GPU column, whose tokens/s (twice the 1024 column's) and MFU (the 1024 column's) are copied
    # from its neighbour: only its step time, 14.98 s, is its own.
    slip = row.name == "dgxc-llama3.1-70b-2048gpu"
    if slip:
        neighbour = next(r.reported for r in DGXC_CP if r.name == "dgxc-llama3.1-70b-1024gpu")
        assert (rep.aggregate_tokens_per_s, rep.mfu) == (round(2 * 1124478.5), neighbour.mfu)
        assert neighbour.aggregate_tokens_per_s == 1124478
    else:
        assert rep.aggregate_tokens_per_s == pytest.approx(m.seq_len * lay.global_batch_size / rep.iteration_time_s,
                                                           abs=1)
    # The Notes' model flops per sample, s (12 l h^2 (1 + g/a + s/h) + 18 l f h + 6 V h), is 6N + 12 l h s.
    s, l, h, f, v = m.seq_len, m.n_layers, m.dim, m.ffn_hidden_dim, m.vocab_size
    notes = s * (12 * l * h**2 * (1 + m.n_kv_heads / m.n_heads + s / h) + 18 * l * f * h + 6 * v * h)
    assert published.model_flops_per_token(row) * s == pytest.approx(notes, rel=1e-12)
    if l in (32, 80, 126):  # the full models: the printed value, to its 3 digits
        assert notes == pytest.approx(printed_flops, rel=5e-3)
    # MFU = global batch x flops per sample / step time / GPUs / 989e12 (the truncated 405B columns
    # at their own layer count). The printed MFUs sit 0.05-0.15% (relative) below it, every column
    # alike (an unrounded step time).
    mfu = lay.global_batch_size * notes / rep.iteration_time_s / lay.devices / 989e12
    if not slip:
        assert rep.mfu == pytest.approx(mfu, rel=2e-3)
    # Accumulation: the titles' GA (32, 64, 63) at every GPU count.
    assert lay.global_batch_size // (lay.dp * lay.micro_batch_size) == {"8b": 32, "70b": 64, "405b": 63}[size]
