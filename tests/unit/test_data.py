"""Unit tests of trainer.data: tokenizer, sources, loader. Run: ``python -m pytest tests/unit/test_data.py -q``."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.config.schema import (
    DATA_SECTIONS,
    LlamaConfig,
    MLPConfig,
    RegressionDataConfig,
    SyntheticDataConfig,
    TextDataConfig,
)
from trainer.data import (
    SOURCE_REGISTRY,
    ByteTokenizer,
    GlobalBatchLoader,
    MarkovSource,
    RegressionSource,
    TextSource,
    TokenWindows,
    build_source,
)
from trainer.data.synthetic import sample_chain, stationary_distribution

# ---------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("text", ["hello, world", "héllo wörld — 世界 🚀", ""])
def test_tokenizer_roundtrip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode_tensor(text)) == text
    assert tok.encode_tensor(text).dtype == torch.int64


def test_tokenizer_non_ascii_is_multibyte_and_invalid_bytes_are_replaced() -> None:
    tok = ByteTokenizer()
    assert len(tok.encode("é")) == 2 and len(tok.encode("🚀")) == 4
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"  # a window may cut a character in half
    with pytest.raises(ValueError):
        tok.decode([256])


# ---------------------------------------------------------------------------- text


def _write(path: Path, content: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)


ALL_TEXT = "a\u00e9".encode() * 200 + b"\n\n" + b"B" * 600 + b"\n\n" + b"C" * 600


@pytest.fixture
def text_dir(tmp_path: Path) -> Path:
    # Written out of order; site-packages and __pycache__ must be skipped.
    _write(tmp_path / "sub" / "c.txt", b"C" * 600)
    _write(tmp_path / "b.txt", b"B" * 600)
    _write(tmp_path / "a.txt", "a\u00e9".encode() * 200)
    _write(tmp_path / "site-packages" / "pkg.txt", b"S" * 300)
    _write(tmp_path / "x" / "__pycache__" / "y.txt", b"P" * 300)
    _write(tmp_path / "notes.md", b"M" * 300)
    return tmp_path


def test_text_source_reads_sorted_files_joined_by_blank_lines(text_dir: Path) -> None:
    src = TextSource(TextDataConfig(root=str(text_dir), glob="**/*.txt", max_bytes=4096), seq_len=16)
    assert [p.relative_to(text_dir).as_posix() for p in src.files] == ["a.txt", "b.txt", "sub/c.txt"]
    assert bytes(src.tokens.tolist()) == ALL_TEXT


def test_text_source_truncates_at_max_bytes_and_windows_shift_by_one(text_dir: Path) -> None:
    seq_len = 16
    src = TextSource(TextDataConfig(root=str(text_dir), glob="**/*.txt", max_bytes=1024), seq_len=seq_len)
    assert src.num_bytes == 1024 and bytes(src.tokens.tolist()) == ALL_TEXT[:1024]
    assert len(src) == (1024 - 1) // seq_len
    stream = src.tokens.to(torch.int64)
    for i in (0, 1, len(src) - 1):
        inputs, targets = src[i]
        assert inputs.dtype == targets.dtype == torch.int64
        assert inputs.shape == targets.shape == (seq_len,)
        assert torch.equal(inputs, stream[i * seq_len : (i + 1) * seq_len])
        assert torch.equal(targets, stream[i * seq_len + 1 : (i + 1) * seq_len + 1])
        assert torch.equal(targets[:-1], inputs[1:])
    with pytest.raises(IndexError):
        src[len(src)]


def test_text_source_stdlib_default_resolves_offline() -> None:
    src = TextSource(TextDataConfig(), seq_len=128)
    assert src.num_bytes >= 1_000_000
    assert all(p.suffix == ".py" for p in src.files)
    assert not any({"site-packages", "dist-packages", "__pycache__"} & set(p.parts) for p in src.files)
    assert b"def " in bytes(src.tokens[:100_000].tolist())


def test_text_source_missing_root_names_data_root(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"data\.root.*does not exist.*set data\.root"):
        TextSource(TextDataConfig(root=str(tmp_path / "nope")), seq_len=8)
    _write(tmp_path / "file.txt", b"x")
    with pytest.raises(FileNotFoundError, match=r"data\.root.*is not a directory"):
        TextSource(TextDataConfig(root=str(tmp_path / "file.txt")), seq_len=8)


def test_text_source_empty_glob_names_data_glob(text_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"data\.glob: '\*\*/\*\.rst' matches no files under data\.root.*e\.g\."):
        TextSource(TextDataConfig(root=str(text_dir), glob="**/*.rst"), seq_len=8)


def test_text_source_skips_links_that_lead_out_of_data_root(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    _write(root / "a.txt", b"A" * 300)
    _write(tmp_path / "meshflow.db", b"the job store")
    _write(root / "inner" / "b.txt", b"B" * 300)
    (root / "store.txt").symlink_to(tmp_path / "meshflow.db")          # a file link out: skipped
    (root / "alias.txt").symlink_to(root / "inner" / "b.txt")          # a link that stays inside: kept
    (root / "outdir").symlink_to(tmp_path, target_is_directory=True)   # a directory link: never walked
    src = TextSource(TextDataConfig(root=str(root), glob="**/*.txt", max_bytes=4096), seq_len=16)
    assert [p.relative_to(root).as_posix() for p in src.files] == ["a.txt", "alias.txt", "inner/b.txt"]
    assert b"job store" not in bytes(src.tokens.tolist())
    assert src.skipped_links == [root / "store.txt"] and "skipped 1 files" in src.notes()[0]
    with pytest.raises(ValueError, match=r"matches no files.*1 matching symbolic links lead outside it"):
        TextSource(TextDataConfig(root=str(root), glob="store.txt"), seq_len=8)


# ---------------------------------------------------------------------------- synthetic


def _markov(order: int = 1, num_tokens: int = 20_000, seed: int = 1234, num_symbols: int = 16) -> MarkovSource:
    cfg = SyntheticDataConfig(order=order, num_symbols=num_symbols, num_tokens=num_tokens, seed=seed)
    return MarkovSource(cfg, seq_len=32)


def empirical_conditional_entropy(tokens: np.ndarray, order: int, num_symbols: int) -> float:
    """Plug-in estimate of H(next token | previous ``order`` tokens) in nats."""
    tokens = tokens.astype(np.int64)
    n = len(tokens) - order
    states = np.zeros(n, dtype=np.int64)
    for d in range(order):
        states = states * num_symbols + tokens[d : d + n]
    counts = np.bincount(states * num_symbols + tokens[order:], minlength=num_symbols ** (order + 1))
    counts = counts.reshape(-1, num_symbols).astype(np.float64)
    row_totals = np.broadcast_to(counts.sum(axis=1, keepdims=True), counts.shape)
    seen = counts > 0
    return float(-(counts[seen] * np.log(counts[seen] / row_totals[seen])).sum() / n)


def test_markov_same_seed_same_stream_other_seed_other_stream() -> None:
    a, b, c = _markov(seed=7), _markov(seed=7), _markov(seed=8)
    assert torch.equal(a.tokens, b.tokens)
    assert not torch.equal(a.tokens, c.tokens)
    assert int(a.tokens.max()) < 16 and len(a.tokens) == 20_000
    inputs, targets = a[3]
    assert torch.equal(targets[:-1], inputs[1:]) and inputs.dtype == torch.int64


@pytest.mark.parametrize("order", [1, 2])
def test_markov_empirical_entropy_matches_entropy_rate(order: int) -> None:
    src = _markov(order=order, num_tokens=400_000)
    exact = src.entropy_rate()
    measured = empirical_conditional_entropy(src.tokens.numpy(), order, src.num_symbols)
    print(f"order={order}: entropy_rate={exact:.4f} nats, empirical={measured:.4f} nats")
    assert abs(measured - exact) / exact < 0.02
    assert 0 < exact < math.log(src.num_symbols)


def test_markov_stationary_distribution_is_a_fixed_point() -> None:
    src = _markov(order=2)
    pi, table = src.stationary, src.table
    states = np.arange(src.num_states)[:, None] * src.num_symbols + np.arange(src.num_symbols)[None, :]
    pushed = np.bincount((states % src.num_states).ravel(), weights=(pi[:, None] * table).ravel())
    assert np.allclose(pushed, pi, atol=1e-12) and math.isclose(pi.sum(), 1.0)
    assert np.allclose(stationary_distribution(table), pi)


@pytest.mark.parametrize("num_chains", [2, 7, 100, 5000])
def test_parallel_generation_equals_sequential_chain(num_chains: int) -> None:
    # Exactness of the block-parallel sampler: the stream does not depend on how it was cut.
    table = _markov(order=2).table
    uniforms = np.random.default_rng(0).random(5000)
    sequential = sample_chain(table, 5, uniforms, num_chains=1)
    assert np.array_equal(sample_chain(table, 5, uniforms, num_chains=num_chains), sequential)


def test_markov_refuses_oversized_table() -> None:
    with pytest.raises(ValueError, match=r"data\.num_symbols \*\* \(data\.order \+ 1\)"):
        _markov(order=3, num_symbols=256)


# ---------------------------------------------------------------------------- loader


def _windows(num_windows: int, seq_len: int = 4) -> TokenWindows:
    # Window i's first input token is i * seq_len: a sample names itself.
    return TokenWindows(torch.arange(num_windows * seq_len + 1), seq_len)


def _loaders(source: TokenWindows, dp_size: int, global_batch_size: int = 8, seed: int = 0) -> list[GlobalBatchLoader]:
    return [
        GlobalBatchLoader(source, global_batch_size=global_batch_size, dp_rank=r, dp_size=dp_size, seed=seed)
        for r in range(dp_size)
    ]


def _concat_next(loaders: list[GlobalBatchLoader]) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [loader.next_batch() for loader in loaders]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def test_loader_dp_ranks_partition_the_single_rank_batch() -> None:
    source = _windows(50)
    (single,), pair = _loaders(source, 1), _loaders(source, 2)
    for _ in range(3):
        inputs, targets = single.next_batch()
        assert inputs.shape == (8, 4)
        halves = [loader.next_batch() for loader in pair]
        assert [h[0].shape for h in halves] == [(4, 4), (4, 4)]
        pair_inputs, pair_targets = torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])
        assert torch.equal(pair_inputs, inputs) and torch.equal(pair_targets, targets)
    assert single.state_dict() == pair[1].state_dict() == {"next_sample": 24, "global_batch_size": 8, "seed": 0,
                                                           "num_samples": len(source)}


def test_loader_refuses_a_position_saved_over_other_data() -> None:
    saved = _loaders(_windows(50), 1)[0]
    saved.next_batch()
    (other,) = _loaders(_windows(60), 1)
    with pytest.raises(ValueError, match=r"data: the checkpoint's data had \d+ samples per epoch, this run's has"):
        other.load_state_dict(saved.state_dict())


def test_loader_resumes_on_another_dp_size() -> None:
    source = _windows(50)
    (reference,) = _loaders(source, 1)
    expected = [reference.next_batch() for _ in range(4)]
    for saved_on in (1, 2):
        before = _loaders(source, saved_on)
        for _ in range(3):
            _concat_next(before)
        state = before[0].state_dict()
        resumed = _loaders(source, 4)
        for loader in resumed:
            loader.load_state_dict(state)
        inputs, targets = _concat_next(resumed)
        assert resumed[0].local_batch_size == 2
        assert torch.equal(inputs, expected[3][0]) and torch.equal(targets, expected[3][1])


def test_loader_wraps_epochs_with_fresh_permutations() -> None:
    num_windows, batch = 10, 4
    (loader,) = _loaders(_windows(num_windows), 1, global_batch_size=batch)
    seen = torch.cat([loader.next_batch()[0][:, 0] // 4 for _ in range(5)])  # 20 samples = 2 epochs
    first, second = seen[:num_windows], seen[num_windows:]
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(num_windows))
    assert not torch.equal(first, second)
    assert loader.epoch == 2 and torch.equal(first, loader.permutation(0))


def test_loader_order_depends_on_seed_and_rejects_bad_setups() -> None:
    source = _windows(50)
    (a,), (b,) = _loaders(source, 1, seed=0), _loaders(source, 1, seed=1)
    assert not torch.equal(a.next_batch()[0], b.next_batch()[0])
    with pytest.raises(ValueError, match=r"train\.global_batch_size: 8 is not divisible by the 3"):
        _loaders(source, 3)
    with pytest.raises(ValueError, match=r"train\.seed"):
        b.load_state_dict(a.state_dict())


# ---------------------------------------------------------------------------- regression


def test_regression_shapes_determinism_and_scale() -> None:
    cfg = RegressionDataConfig(num_samples=64, noise_std=0.01, seed=3)
    src, again = RegressionSource(cfg, 12, 5), RegressionSource(cfg, 12, 5)
    other = RegressionSource(cfg.model_copy(update={"seed": 4}), 12, 5)
    x, y = src[7]
    assert len(src) == 64 and x.shape == (12,) and y.shape == (5,)
    assert x.dtype == y.dtype == torch.float32
    assert torch.equal(x, again[7][0]) and torch.equal(y, again[7][1])
    assert not torch.equal(x, other[7][0])
    ys = torch.stack([src[i][1] for i in range(64)])
    assert 0.5 < float(ys.std()) < 2.0  # outputs O(1)
    residual = ys - src.teacher(torch.stack([src[i][0] for i in range(64)]))
    assert 0.005 < float(residual.std()) < 0.02  # the noise, and nothing else
    with pytest.raises(IndexError):
        src[64]


# ---------------------------------------------------------------------------- build_source


def test_build_source_dispatches_on_kind() -> None:
    kinds = {cls.model_fields["kind"].default for cls in DATA_SECTIONS}
    assert set(SOURCE_REGISTRY) == kinds
    markov = build_source(SyntheticDataConfig(num_tokens=4096), seq_len=16, model_cfg=LlamaConfig())
    assert isinstance(markov, MarkovSource) and markov[0][0].shape == (16,)
    mlp = MLPConfig(in_features=6, out_features=3, hidden_features=8)
    regression = build_source(RegressionDataConfig(num_samples=32), seq_len=16, model_cfg=mlp)
    assert isinstance(regression, RegressionSource) and regression[0][1].shape == (3,)
    with pytest.raises(ValueError, match=r"data\.kind: regression.*model\.arch is llama"):
        build_source(RegressionDataConfig(), seq_len=16, model_cfg=LlamaConfig())
    with pytest.raises(ValueError, match=r"model\.vocab_size: 8"):
        build_source(SyntheticDataConfig(num_tokens=4096), seq_len=16, model_cfg=LlamaConfig(vocab_size=8))
