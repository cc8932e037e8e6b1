"""The docs' commands run as written, in subprocesses, on what a fresh clone has (the slow pass; the
default pass validates every one in-process: tests/e2e/test_docs_commands.py).

- every command that plans or checks and starts nothing (``dry_run=true``, ``validate_only=true``,
  ``--help``, ``--cfg job``): its exit code, and a documented refusal's words;
- docs/fine-tuning.md, block by block in a fresh directory after ``python -m trainer.tools.tiny_hf data/``:
  each run trains, the commands after it read the checkpoint the run reports (the page's path must be
  that one), the export loads in transformers with its tokenizer's chat template, and generate answers.

    python -m pytest -q -m slow tests/e2e/test_docs_runs.py
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs_text import REPO, blocks, command_blocks, documented_commands, read_docs
from tests.e2e.test_docs_commands import REFUSED, READS_A_RUN, TRAINER, _not_run
from timing import scaled

pytestmark = pytest.mark.slow
CHECKS = sorted({command for page, command in documented_commands()
                 if TRAINER.match(command) and _not_run(page, command) is None
                 and re.search(r"dry_run=true|validate_only=true|--help|--cfg job", command)})


def typed(command: str, cwd: Path, *, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``command`` as a POSIX shell runs it in ``cwd`` (``python`` is this interpreter)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    line = command.replace("python -m ", f"{shlex.quote(sys.executable)} -m ", 1)
    return subprocess.run(["bash", "-c", line], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=scaled(timeout))


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """A user's home with planning.md's hardware file, made by the page's own ``mkdir``/``cp`` line."""
    path = tmp_path_factory.mktemp("home")
    copy = next(line for block in blocks(read_docs("planning.md")) for line in block if line.startswith("mkdir -p ~/"))
    assert subprocess.run(["bash", "-c", copy], cwd=REPO, env={**os.environ, "HOME": str(path)}).returncode == 0
    return path


@pytest.mark.parametrize("command", CHECKS)
def test_documented_check_runs_as_written(command, tmp_path, home):
    out = typed(command, tmp_path, env={"HOME": str(home)})
    if command in REFUSED:
        assert out.returncode == 2 and REFUSED[command][0] in out.stderr, out.stdout + out.stderr
    else:
        assert out.returncode == 0, out.stdout + out.stderr


def _reported_checkpoint(stdout: str, cwd: Path) -> str:
    """The last checkpoint the run's summary names, relative to where it ran."""
    line = next(x for x in stdout.splitlines() if x.strip().startswith("last checkpoint: "))
    return os.path.relpath(line.split(": ", 1)[1].strip(), cwd)


@pytest.mark.parametrize("index", range(3))
def test_fine_tuning_page_runs_as_written(index, tmp_path):
    """One block of docs/fine-tuning.md in a fresh directory: its run, then what reads its checkpoint."""
    import transformers

    block = command_blocks(REPO / "docs" / "fine-tuning.md")[index]
    made = typed("python -m trainer.tools.tiny_hf data/", tmp_path, timeout=300)
    assert made.returncode == 0, made.stderr
    run, *uses = block
    out = typed(run, tmp_path, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    checkpoint = _reported_checkpoint(out.stdout, tmp_path)
    for use in uses:
        assert use.startswith(READS_A_RUN) and checkpoint in shlex.split(use), (use, checkpoint)
        done = typed(use, tmp_path, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        if "--chat" in use:
            assert done.stdout.strip(), done.stdout  # the reply alone
        if "--out" in use:
            exported = tmp_path / shlex.split(use)[shlex.split(use).index("--out") + 1]
            if "--format hf" in use:
                model = transformers.AutoModelForCausalLM.from_pretrained(exported)
                assert model.config.vocab_size == 512
            else:
                assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in exported.iterdir()}
