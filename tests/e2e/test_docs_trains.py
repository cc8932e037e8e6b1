"""Every training command of the README and the docs pages runs as written on a fresh clone, page by
page: each run in a fresh directory, followed there by the commands of its page that read it (an export,
a generate, a resume, a run from its weights), in the page's order, each exiting 0. Marked ``docs``:
about an hour on a 2-core host, so neither of CI's passes runs it (the default pass validates each of
these commands in-process, tests/e2e/test_docs_commands.py; the slow pass runs the checks, the README's main command and
docs/fine-tuning.md, tests/e2e/test_docs_runs.py and tests/e2e/test_readme.py).

    python -m pytest -q -m docs tests/e2e/test_docs_trains.py
"""

from __future__ import annotations

import re
import pytest

from tests.docs_text import REPO, documented_commands
from tests.e2e.test_docs_commands import READS_A_RUN, REFUSED, _not_run, make_fresh_clone
from tests.e2e.test_docs_runs import CHECKS, typed

# commands run by another test already (the slow pass), by page: prefix -> that test
RUN_ELSEWHERE = {"docs/fine-tuning.md": {"python -m ": "tests/e2e/test_docs_runs.py"}}
# commands no test can run on one host, by page: prefix -> the words of that page that say what they need
NEEDS_A_CLUSTER = {
    "docs/deploy.md": {"python -m trainer +parallel=3d mesh=[2,2,2] launch.executor=slurm launch.nnodes=2":
                       "From a login node of a Slurm cluster"},
    "docs/slurm.md": {"python -m trainer +parallel=3d mesh=[2,2,2] launch.executor=slurm launch.nnodes=2":
                      "On a cluster scheduled by Slurm"},
    "docs/control-plane.md": {"MESHFLOW_TOKENS=": "tests/api"},  # a server: the control plane's tests start it
}


def _skipped(page: str, command: str) -> bool:
    for table in (RUN_ELSEWHERE, NEEDS_A_CLUSTER):
        if any(command.startswith(prefix) for prefix in table.get(page, {})):
            return True
    return _not_run(page, command) is not None or command in CHECKS or command in REFUSED


def _pages() -> dict[str, list[str]]:
    pages: dict[str, list[str]] = {}
    for page, command in documented_commands():
        if not _skipped(page, command):
            pages.setdefault(page, []).append(command)
    return pages


PAGES = _pages()


def test_commands_no_test_runs_are_named_by_their_pages():
    for table in (RUN_ELSEWHERE, NEEDS_A_CLUSTER):
        for page, entries in table.items():
            text = (REPO / page).read_text()
            assert all(prefix in text and (words in text or words.startswith("tests/"))
                       for prefix, words in entries.items()), page


def chains(commands: list[str]) -> list[list[str]]:
    """A page's commands, cut where a run would save into the directory an earlier run of the page saved
    into (the default ``checkpoints/``): a reader tries such alternatives one at a time, each on a fresh
    clone; a run with its own ``train.checkpoint.dir``, a sweep and what reads a run stay with it."""
    out: list[list[str]] = [[]]
    default_taken = False
    for command in commands:
        saves_by_default = (re.match(r"^python -m trainer( |$)", command) is not None
                            and not command.startswith(READS_A_RUN) and "train.checkpoint.dir=" not in command
                            and "--multirun" not in command and "dry_run=true" not in command)
        if saves_by_default and default_taken:
            out.append([])
        default_taken = default_taken or saves_by_default
        out[-1].append(command)
    return [chain for chain in out if chain]


@pytest.mark.docs
@pytest.mark.parametrize("page", sorted(PAGES))
def test_page_trains_as_written(page, tmp_path):
    for index, chain in enumerate(chains(PAGES[page])):
        cwd = make_fresh_clone(tmp_path / str(index))
        for command in chain:
            # an hour a command: docs/context-parallel.md's 100 steps of 4,096 tokens over 4 cp ranks took
            # 26 s a step on the 2-core host under load (timed out at 30 minutes, near step 60 of 100, on 2026-11-29)
            out = typed(command, cwd, env={"HOME": str(cwd / "home")}, timeout=3600)
            assert out.returncode == 0, f"{page}: {command}\n" + out.stdout[-3000:] + out.stderr[-3000:]
            if re.match(r"^python -m trainer( |$)", command) and "--multirun" not in command:
                assert "last checkpoint: " in out.stdout, (command, out.stdout[-2000:])
