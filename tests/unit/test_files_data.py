"""data=files: documents from jsonl / parquet / text files, a tokenizer trained here, packing, order, cache.

    python -m pytest tests/unit/test_files_data.py -q
"""

from __future__ import annotations

import multiprocessing
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from parallel.errors import ConfigError
from tests.hf_assets import documents, write_jsonl, write_parquet, write_tokenizer
from trainer.config.schema import FilesDataConfig, LlamaConfig
from trainer.data import GlobalBatchLoader, build_splits
from trainer.data.files import FilesSource
from trainer.data.tokenizer import ByteTokenizer, load_tokenizer

DOCS = documents(200)
SEQ = 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    write_tokenizer(root / "tok", vocab_size=320)
    write_jsonl(root / "a.jsonl", DOCS[:120])
    write_jsonl(root / "b.jsonl", DOCS[120:])
    write_parquet(root / "all.parquet", DOCS)
    (root / "txt").mkdir()
    for i, doc in enumerate(DOCS[:10]):
        (root / "txt" / f"{i:02d}.txt").write_text(doc)
    return root


def _cfg(corpus: Path, tmp_path: Path, **kw) -> FilesDataConfig:
    base = dict(paths=[str(corpus / "*.jsonl")], tokenizer=str(corpus / "tok"), cache_dir=str(tmp_path / "cache"))
    return FilesDataConfig(**{**base, **kw})


def _expected_stream(docs: list[str], tokenizer) -> list[int]:
    return [token for doc in docs for token in (*tokenizer.encode(doc), tokenizer.eos_id)]


def test_documents_are_packed_with_eos_and_no_token_is_lost_or_repeated_in_an_epoch(corpus, tmp_path):
    source = FilesSource(_cfg(corpus, tmp_path), SEQ)
    tok = source.tokenizer
    assert tok.eos_id == 2 and tok.vocab_size == 320  # </s>, named by tokenizer_config.json
    stream = _expected_stream(DOCS, tok)  # a.jsonl then b.jsonl: sorted paths, records in file order
    assert source.tokens.dtype == np.uint16 and source.tokens.tolist() == stream
    assert source.num_documents == len(DOCS) and stream.count(tok.eos_id) == len(DOCS)
    # One epoch through the shuffled loader: each window once, so the targets are the stream's
    # tokens 1 .. n*SEQ exactly once each (counted), and the inputs its tokens 0 .. n*SEQ - 1.
    loader = GlobalBatchLoader(source, global_batch_size=len(source), dp_rank=0, dp_size=1, seed=3)
    inputs, targets = loader.next_batch()
    covered = len(source) * SEQ
    assert Counter(targets.flatten().tolist()) == Counter(stream[1 : covered + 1])
    assert Counter(inputs.flatten().tolist()) == Counter(stream[:covered])
    assert len(stream) - 1 - covered < SEQ  # only a tail shorter than one window is left out


def test_parquet_and_jsonl_give_the_same_stream_and_text_files_are_one_document_each(corpus, tmp_path):
    jsonl = FilesSource(_cfg(corpus, tmp_path), SEQ)
    parquet = FilesSource(_cfg(corpus, tmp_path, paths=[str(corpus / "all.parquet")]), SEQ)
    assert np.array_equal(jsonl.tokens, parquet.tokens)
    text = FilesSource(_cfg(corpus, tmp_path, paths=[str(corpus / "txt" / "**" / "*.txt")], tokenizer=None), SEQ)
    assert isinstance(text.tokenizer, ByteTokenizer) and text.num_documents == 10
    assert text.tokens.tolist() == _expected_stream(DOCS[:10], ByteTokenizer())


def test_shuffling_is_deterministic_by_seed(corpus, tmp_path):
    source = FilesSource(_cfg(corpus, tmp_path), SEQ)

    def first_batches(seed: int) -> list[torch.Tensor]:
        loader = GlobalBatchLoader(source, global_batch_size=8, dp_rank=0, dp_size=1, seed=seed)
        return [loader.next_batch()[0] for _ in range(3)]

    same, again, other = first_batches(0), first_batches(0), first_batches(1)
    assert all(torch.equal(a, b) for a, b in zip(same, again))
    assert not all(torch.equal(a, b) for a, b in zip(same, other))


def test_the_token_file_is_built_once_and_rebuilt_when_a_file_changes(corpus, tmp_path):
    cfg = _cfg(corpus, tmp_path, paths=[str(tmp_path / "c.jsonl")])
    write_jsonl(tmp_path / "c.jsonl", DOCS[:50])
    first = FilesSource(cfg, SEQ)
    built = sorted((tmp_path / "cache").glob("tokens-*.bin"))
    mtime = built[0].stat().st_mtime_ns
    assert len(FilesSource(cfg, SEQ)) == len(first) and built[0].stat().st_mtime_ns == mtime  # reused
    write_jsonl(tmp_path / "c.jsonl", DOCS[:60])
    assert len(FilesSource(cfg, SEQ)) > len(first)
    assert len(list((tmp_path / "cache").glob("tokens-*.bin"))) == 2
    assert not list((tmp_path / "cache").glob("*.tmp-*"))  # no partial file left behind


def _build(cfg_json: str, out: str) -> None:
    source = FilesSource(FilesDataConfig.model_validate_json(cfg_json), SEQ)
    Path(out).write_text(str(len(source.tokens)))


def test_ranks_of_a_host_building_at_once_share_one_token_file(corpus, tmp_path):
    cfg = _cfg(corpus, tmp_path)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_build, args=(cfg.model_dump_json(), str(tmp_path / f"n{i}"))) for i in range(3)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    counts = {(tmp_path / f"n{i}").read_text() for i in range(3)}
    assert counts == {str(len(_expected_stream(DOCS, load_tokenizer(str(corpus / "tok")))))}
    assert len(list((tmp_path / "cache").glob("tokens-*.bin"))) == 1


def test_validation_split_by_fraction_or_by_files(corpus, tmp_path):
    full = FilesSource(_cfg(corpus, tmp_path), SEQ)
    by_fraction = build_splits(_cfg(corpus, tmp_path, val_fraction=0.25), seq_len=SEQ,
                               model_cfg=LlamaConfig(vocab_size=320))
    assert len(by_fraction.train) + len(by_fraction.val) == len(full)
    assert len(by_fraction.val) == int(len(full) * 0.25)
    assert torch.equal(by_fraction.val[0][0], full[len(by_fraction.train)][0])  # the tail of the corpus
    by_files = build_splits(_cfg(corpus, tmp_path, paths=[str(corpus / "a.jsonl")],
                                 val_paths=[str(corpus / "b.jsonl")]),
                            seq_len=SEQ, model_cfg=LlamaConfig(vocab_size=320))
    assert by_files.val.tokens.tolist() == _expected_stream(DOCS[120:], by_files.train.tokenizer)


def test_bad_files_configs_name_the_path_reason_and_fix(corpus, tmp_path):
    from trainer.config.compose import compose_dict
    from trainer.validate.checks import validate_config

    def issues(*overrides: str) -> dict[str, str]:
        with pytest.raises(ConfigError) as err:
            validate_config(compose_dict(["data=files", f"data.cache_dir={tmp_path / 'cache'}", *overrides]))
        return {i.path: f"{i.reason} ({i.fix})" for i in err.value.issues}

    found = issues(f"data.paths=[{corpus}/a.jsonl,{corpus}/nope*.jsonl]", f"data.tokenizer={tmp_path}/missing")
    assert "matches no file" in found["data.paths[1]"] and "does not exist" in found["data.tokenizer"]
    assert "vocab_size >= 320" in issues(f"data.paths=[{corpus}/a.jsonl]",
                                         f"data.tokenizer={corpus}/tok")["model.vocab_size"]
    assert "mixes formats" in issues(f"data.paths=[{corpus}/a.jsonl,{corpus}/all.parquet]")["data.paths"]
    assert "no validation split" in issues(f"data.paths=[{corpus}/a.jsonl]", "train.eval_every=5")["train.eval_every"]
    assert "names no files" in issues()["data.paths"]
    zbv = issues(f"data.paths=[{corpus}/a.jsonl]", "data.val_fraction=0.1", "+parallel=pp",
                 "parallel.pipeline.schedule=ZBV", "parallel.pipeline.stages_per_rank=2")
    assert "no forward-only pass" in zbv["parallel.pipeline.schedule"]
    with pytest.raises(ConfigError, match=r"data\.text_field: 'body' is not a field .* they have \['id', 'text'\]"):
        FilesSource(_cfg(corpus, tmp_path, text_field="body"), SEQ)
    with pytest.raises(ConfigError, match=r"data\.eos_token: .*has no end-of-document token"):
        load_tokenizer(str(corpus / "tok"), eos_token="<|nope|>")


def test_rest_confines_files_paths_tokenizer_and_cache(corpus, tmp_path):
    """data=files over REST: paths, globs and the tokenizer under the workspace's datasets/ or models/
    areas (or the job's workdir); absolute paths, `..` and a symlink leading out are refused."""
    from service.submit import confine

    workspace, workdir = tmp_path / "ws", tmp_path / "ws" / "jobs" / "j1"
    (workspace / "datasets").mkdir(parents=True)
    workdir.mkdir(parents=True)
    (workspace / "datasets" / "leak.jsonl").symlink_to(corpus / "a.jsonl")
    write_jsonl(workspace / "datasets" / "ok.jsonl", DOCS[:5])
    raw = {"data": {"kind": "files", "paths": ["../../datasets/ok.jsonl", str(corpus / "*.jsonl"), "datasets/*.jsonl"],
                    "tokenizer": str(corpus / "tok")}}
    out, issues = confine(raw, workspace=workspace, workdir=workdir, tracking_uri="sqlite://", run_id=None)
    assert {i.path for i in issues} == {"data.paths[0]", "data.paths[1]", "data.paths[2]", "data.tokenizer"}
    raw = {"data": {"kind": "files", "paths": ["datasets/ok.jsonl"]}}
    out, issues = confine(raw, workspace=workspace, workdir=workdir, tracking_uri="sqlite://", run_id=None)
    assert not issues and out["data"]["paths"] == [str(workspace / "datasets" / "ok.jsonl")]
    assert out["data"]["cache_dir"] == str(workspace / ".cache" / "meshflow-tokens")


def test_packing_restarts_positions_after_each_end_of_document(corpus, tmp_path):
    from trainer.data.files import FilesSource

    plain, packed = FilesSource(_cfg(corpus, tmp_path), SEQ), FilesSource(_cfg(corpus, tmp_path, packing=True), SEQ)
    eos = packed.tokenizer.eos_id
    for index in range(5):
        inputs, targets, positions = packed[index]
        assert torch.equal(inputs, plain[index][0]) and torch.equal(targets, plain[index][1])
        expected, at = [], 0
        for token in inputs.tolist():  # counted one token at a time: 0 at the row's start and after every EOS
            expected.append(at)
            at = 0 if token == eos else at + 1
        assert positions.tolist() == expected
    starts = sum(int((packed[i][2] == 0).sum()) for i in range(len(packed)))
    assert starts > len(packed)  # some rows hold a boundary
    assert len(plain[0]) == 2 and "documents kept apart" in packed.notes()[0]
