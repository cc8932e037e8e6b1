"""Schemathesis (its CLI, against the live server's /openapi.json): no 5xx, no schema violations.

The server has capacity 0, so the jobs schemathesis manages to submit are queued and never run.
``positive_data_acceptance`` is left out on purpose: the schema says `config` is any object, and
the trainer's validator then refuses most random objects with 422, which is the point of it.
``follow`` is pinned to false: a followed log of a job that never starts streams until the job
ends, i.e. until the request times out (tests/api/test_jobs.py covers the stream).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from api_testkit import ADMIN

pytestmark = pytest.mark.slow


def test_openapi_schema_holds_under_schemathesis(queue_server, tmp_path):
    if shutil.which("schemathesis") is None and not (Path(sys.executable).parent / "schemathesis").exists():
        pytest.fail("schemathesis is not installed: pip install -e '.[dev]'")
    server = queue_server
    executable = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    (tmp_path / "schemathesis.toml").write_text('[parameters]\n"query.follow" = false\n')
    command = [executable, "run", f"{server.url}/openapi.json", "-H", f"Authorization: {ADMIN['Authorization']}",
               "--checks", "all", "--exclude-checks", "positive_data_acceptance", "--max-examples", "8",
               "--phases", "examples,coverage,fuzzing", "--request-timeout", "30", "--seed", "1",
               "--report", "junit", "--report-dir", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "Server error" not in result.stdout
    assert "Traceback" not in server.log_text()
