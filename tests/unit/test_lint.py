"""ruff and mypy as the test run calls them: `pip install -e ".[dev]"` installs both, pyproject.toml configures
both (ruff on the packages and the tests; mypy on the packages, the --strict flags on parallel/).

    python -m pytest -q -n 0 tests/unit/test_lint.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True)


def test_ruff_finds_nothing():
    out = _run("ruff", "check", "--no-cache", "trainer", "parallel", "service", "api", "tests")
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_finds_nothing():
    # The files and the flags are pyproject.toml's; the cache is .mypy_cache (about a minute cold, seconds warm).
    out = _run("mypy")
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_reports_what_it_is_asked_to(tmp_path):
    """The configuration is the one in force: an unused import and a 121-column line are found in a file
    checked with the repository's settings."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\nx = '" + "a" * 115 + "'\n")
    out = _run("ruff", "check", "--no-cache", "--config", str(REPO / "pyproject.toml"), str(bad))
    assert out.returncode == 1
    assert "F401" in out.stdout and "E501" in out.stdout
