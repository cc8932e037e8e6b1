"""The data pipeline's throughput beside the trainer's, on the 3d preset: is data ever the bottleneck?

    python tests/bench/bench_data.py            # ~2 minutes on 2 cores

A jsonl corpus (``DOCS`` documents of the test vocabulary) and a byte-level BPE tokenizer are
written to a temporary directory. Measured, in this one run:

* tokenize: ``build_token_file`` from scratch (datasets + tokenizers -> the memory-mapped token
  file), tokens/s; paid once per corpus and tokenizer, later runs reuse the file;
* open: a ``FilesSource`` on the built file (what each rank does at start), seconds;
* load: ``GlobalBatchLoader.next_batch`` on one rank of the 3d preset (dp 2: 8 of the 16
  sequences of 128 tokens per step), tokens/s of that rank;
* train: ``python -m trainer +parallel=3d mesh=[2,2,2] data=files ...``, the median tokens/s
  the trainer reports (global tokens per step over step time, steps after the first two).

Each rank must load ``train tokens/s / dp`` tokens per second; the last column says how many
times faster than that its loader is.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO)]
from tests.hf_assets import documents, write_jsonl, write_tokenizer  # noqa: E402

DOCS = 40_000
DP, GLOBAL_BATCH, SEQ_LEN, STEPS = 2, 16, 128, 12
VOCAB = 1024


def main() -> None:
    from trainer.config.schema import FilesDataConfig
    from trainer.data import GlobalBatchLoader
    from trainer.data.files import FilesSource, build_token_file, expand_paths
    from trainer.data.tokenizer import load_tokenizer

    with TemporaryDirectory(prefix="meshflow-bench-data-") as tmp:
        root = Path(tmp)
        write_tokenizer(root / "tok", vocab_size=VOCAB)
        docs = documents(DOCS, seed=1)
        for part in range(4):
            write_jsonl(root / f"part-{part}.jsonl", docs[part::4])
        cfg = FilesDataConfig(paths=[str(root / "*.jsonl")], tokenizer=str(root / "tok"), cache_dir=str(root / "cache"))

        began = time.perf_counter()
        path = build_token_file(expand_paths(cfg.paths), load_tokenizer(cfg.tokenizer), text_field="text",
                                cache_dir=root / "cache")
        tokenize_s = time.perf_counter() - began
        began = time.perf_counter()
        source = FilesSource(cfg, SEQ_LEN)
        open_s = time.perf_counter() - began
        n_tokens = len(source.tokens)
        assert path.exists()

        loader = GlobalBatchLoader(source, global_batch_size=GLOBAL_BATCH, dp_rank=0, dp_size=DP, seed=0)
        batches = 2000
        began = time.perf_counter()
        for _ in range(batches):
            loader.next_batch()
        load_tps = batches * loader.local_batch_size * SEQ_LEN / (time.perf_counter() - began)

        proc = subprocess.run(
            [sys.executable, "-m", "trainer", "+parallel=3d", "mesh=[2,2,2]", "data=files",
             f"data.paths=[{root}/*.jsonl]",
             f"data.tokenizer={root / 'tok'}", f"data.cache_dir={root / 'cache'}", f"model.vocab_size={VOCAB}",
             f"train.steps={STEPS}", "train.log_every=1", "tracking.backend=none",
             f"train.global_batch_size={GLOBAL_BATCH}", f"train.seq_len={SEQ_LEN}"],
            cwd=root, capture_output=True, text=True, timeout=900)
        if proc.returncode:
            sys.exit(proc.stdout[-2000:] + proc.stderr[-2000:])
        rates = [float(m.replace(",", "")) for m in re.findall(r"(?:\||,) ([\d,]+) tok/s", proc.stdout)]
        train_tps = statistics.median(rates[2:])

    need = train_tps / DP
    print(f"corpus: {DOCS} documents, {n_tokens:,} tokens (BPE vocab {VOCAB}); 3d preset, dp {DP}, "
          f"global batch {GLOBAL_BATCH} x {SEQ_LEN}\n")
    print(f"| {'stage':<34} | {'tokens/s':>12} | {'seconds':>8} | {'x ahead of training':>19} |")
    print(f"|{'-' * 36}|{'-' * 14}|{'-' * 10}|{'-' * 21}|")
    print(f"| {'tokenize (once per corpus)':<34} | {n_tokens / tokenize_s:>12,.0f} | {tokenize_s:>8.2f} | {'':>19} |")
    print(f"| {'open the token file (each rank)':<34} | {'':>12} | {open_s:>8.3f} | {'':>19} |")
    print(f"| {'load, one rank (its dp share)':<34} | {load_tps:>12,.0f} | {'':>8} | {load_tps / need:>18,.0f}x |")
    print(f"| {'train, 3d preset (all ranks)':<34} | {train_tps:>12,.0f} | {'':>8} | {'':>19} |")
    print(f"| {'needed per rank (train / dp)':<34} | {need:>12,.0f} | {'':>8} | {'':>19} |")


if __name__ == "__main__":
    main()
