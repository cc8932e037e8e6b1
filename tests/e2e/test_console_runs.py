"""The console of a run and of a sweep, as a user reads it through a pipe: step lines and the summary
agree on what they report, every log path printed exists, the config's changes come first, plain
progress lines come off a terminal, a warning every worker raises shows once, a sweep names each
job's overrides and ends with a table and the winner, and an in-process job's peak memory is its own.

    pytest tests/e2e/test_console_runs.py -q
"""

from __future__ import annotations

import os
import re
import textwrap

import pytest

from tests.conftest import run_cli
from trainer.run.metrics import NullProgress, Progress
from trainer.tracking.run_record import summary
from trainer.tracking.tracker import NullTracker

TINY = ("train.global_batch_size=4", "train.seq_len=32", "data.max_bytes=200000", "tracking.pictures=false",
        "tracking.system_metrics=false")
_TOKS = re.compile(r"([\d,]+) tok/s")


def _train(cfg, progress):
    from trainer.run.loop import train  # start-up: the loop's imports, for the tests that train in-process

    return train(cfg, tracker=NullTracker(), progress=progress)


def test_the_summary_reports_what_the_step_lines_do(compose, capsys, tmp_path, monkeypatch):
    """The summary's last-window numbers are the last step line's (mean loss, tokens / window time);
    its whole-run tokens/s is tokens over the steps after the first / their time. And a second job in
    the same process measures its own peak memory (it read 0-1 MiB when the mark was process-wide)."""
    monkeypatch.chdir(tmp_path)  # the jobs' final checkpoints go to ./checkpoints: here, not the checkout
    cfg = compose("tracking=none", *TINY, "train.steps=6", "train.log_every=4")
    result = _train(cfg, Progress(live=False))
    printed = capsys.readouterr().out.splitlines()
    steps = [line for line in printed if line.startswith("step ")]
    assert len(steps) == 2 and steps[0].startswith("step 4/6 | mean of steps 1-4: loss ")
    assert steps[1].startswith("step 6/6 | mean of steps 5-6: loss ")
    tokens, times, losses = result.tokens_per_step, result.step_times, result.losses
    assert tokens == 4 * 32
    # the step line's definition: means over its window, tokens/s = tokens in the window / its time
    assert f"loss {sum(losses[4:6]) / 2:.4f}," in steps[1]
    assert f"{tokens * 2 / sum(times[4:6]):,.0f} tok/s" in steps[1]
    text = summary(cfg, result.summary(), NullTracker(), wall_s=1.0)
    speed_line = text.splitlines()[2]
    whole, last = speed_line.split(" | ")
    assert whole == f"  mean {tokens * 5 / sum(times[1:]):,.0f} tok/s over steps 2-6 (step 1 left out: start-up)"
    tokens_per_s = _TOKS.search(steps[1]).group(1)
    assert last == f"last step line (steps 5-6): loss {sum(losses[4:6]) / 2:.4f}, {tokens_per_s} tok/s"

    # 16x the tokens of the job above: its peak stands clear of what earlier tests' freed heap hides (the 128-token
    # job, whose blocks keep little since trainer/models/layers.py, measured 3.5 MiB after others in the same worker)
    bigger = compose("tracking=none", *TINY, "train.steps=2", "train.seq_len=256", "train.global_batch_size=8")
    first_peak = _train(bigger, NullProgress()).peak_memory_mb
    second_peak = _train(bigger, NullProgress()).peak_memory_mb
    print(f"peak memory of the same job in one process: {first_peak:.1f} then {second_peak:.1f} MiB")
    assert first_peak > 5 and second_peak >= 0.5 * first_peak


def _printed_log_paths(out: str) -> list[str]:
    """The paths on the summary's ``log:`` / ``logs:`` lines."""
    lines = [line for line in out.splitlines() if line.startswith(("  log: ", "  logs: "))]
    assert lines, out[-3000:]
    return [word.rstrip(";,") for line in lines for word in line.split() if "/" in word]


def test_a_piped_run_shows_its_config_progress_and_real_log_paths(tmp_path):
    proc = run_cli(["tracking=none", *TINY, "train.steps=5", "train.log_every=4", "train.progress_every_s=0"],
                   cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Callback" not in proc.stderr, proc.stderr  # the sweep's callback keeps quiet in a single run
    out = proc.stdout.splitlines()
    assert out[0:3] == ["config (differs from the defaults; --help lists them):", "  data: {max_bytes: 200000}",
                        "  tracking: {backend: none, pictures: false, system_metrics: false}"]
    assert out[3] == "  train: {steps: 5, global_batch_size: 4, seq_len: 32, log_every: 4, progress_every_s: 0.0}"
    progress = [line for line in out if line.startswith("progress: ")]
    # every step but the one with a step line (4) and the last (the summary's)
    assert [line.split(",")[0] for line in progress] == [f"progress: {k}/5 steps ({20 * k}%)" for k in (1, 2, 3)]
    assert all(re.search(r"eta \d+s \| step \d: loss \d\.\d{4}, [\d,]+ tok/s$", line) for line in progress), progress
    paths = _printed_log_paths(proc.stdout)
    assert paths == [str(next(tmp_path.glob("logs/*_local")).relative_to(tmp_path) / "attempt_0" / "0" / "stdout.log")]
    assert all((tmp_path / p).is_file() for p in paths)
    assert "<" not in "".join(line for line in out if "log" in line)  # no placeholder such as attempt_<n>


NET = textwrap.dedent('''
    import torch
    from torch import nn


    class Net(nn.Module):
        """The head is a Linear with a bias over [B, T, width]: on CPU its output is a view, which
        FSDP2 warns about on every rank."""

        def __init__(self, vocab=256, width=32):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.head = nn.Linear(width, vocab)

        def forward(self, tokens):
            return self.head(torch.relu(self.embed(tokens)))


    def build():
        return Net()
''')


def test_a_warning_every_worker_raises_shows_once(tmp_path):
    (tmp_path / "view_net.py").write_text(NET)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = run_cli(["+parallel=fsdp", "mesh=[2]", "model=custom", "model.builder=view_net:build", "tracking=none",
                    *TINY, "train.steps=2"], cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    assert console.count("returned a view tensor") == 1, console[-4000:]
    assert console.count("_register_pre_backward_hook(output)") == 1  # the source line under it, once too
    assert "(1 repeat of a warning shown above left out" in proc.stderr
    paths = _printed_log_paths(proc.stdout)
    assert all((tmp_path / p).exists() for p in paths), paths
    attempt = tmp_path / paths[0]
    assert sorted(p.name for p in attempt.iterdir()) == ["0", "1"]
    # each rank's own log keeps its warning
    assert all("returned a view tensor" in (attempt / rank / "stderr.log").read_text() for rank in ("0", "1"))


def test_a_sweep_names_each_jobs_overrides_and_its_winner(tmp_path):
    """Without MLflow (tests/e2e/test_mlflow_runs.py checks the table's run IDs against the children)."""
    proc = run_cli(["--multirun", "optim.lr=1e-3,3e-3", "tracking=none", *TINY, "train.steps=2", "train.log_every=1",
                    "train.print_config=false"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout.splitlines()
    assert [line for line in out if line.startswith("sweep: job ")] == [
        "sweep: job 0 starts: optim.lr=0.001", "sweep: job 1 starts: optim.lr=0.003"]
    assert not any(line.startswith("config") for line in out)  # train.print_config=false
    finals = [float(line.split("final loss ")[1].split()[0]) for line in out if line.startswith("  wall time")]
    start = out.index("sweep: 2 jobs, 2 completed")
    assert out[start + 1].split() == ["job", "final", "loss", "peak", "MiB", "run", "overrides"]
    rows = [line.split() for line in out[start + 2:start + 4]]
    assert [(row[0], float(row[1]), row[3], row[4]) for row in rows] == [
        ("0", pytest.approx(finals[0], abs=1e-4), "-", "optim.lr=0.001"),
        ("1", pytest.approx(finals[1], abs=1e-4), "-", "optim.lr=0.003")]
    peaks = [float(row[2]) for row in rows]
    assert peaks[1] >= 0.5 * peaks[0] > 2, peaks  # the second in-process job's own peak, not 0-5 MiB
    best = min(range(2), key=finals.__getitem__)
    assert out[start + 4] == (f"sweep: best job {best} (optim.lr={('0.001', '0.003')[best]}): "
                              f"final loss {finals[best]:.4f}, the lowest of 2")
    # the sweep's own files in its own folder, none in the current directory
    (sweep_dir,) = (tmp_path / "multirun").iterdir()
    assert (sweep_dir / "multirun.yaml").is_file() and not (tmp_path / "multirun.yaml").exists()
    assert f"its files (multirun.yaml) go to multirun/{sweep_dir.name}" in proc.stdout
