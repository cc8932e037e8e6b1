"""The import direction api -> service -> trainer -> parallel is checked, not hoped for."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_import_contracts_hold():
    out = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"],
                         cwd=REPO, capture_output=True, text=True)
    assert "Contracts: 1 kept, 0 broken." in out.stdout, out.stdout + out.stderr


def test_parallel_does_not_import_trainer_or_mlflow():
    code = "import sys, parallel.engine, parallel.placements, parallel.plan.boundaries; " \
           "print(sorted(m for m in sys.modules if m.split('.')[0] in ('trainer', 'mlflow', 'fastapi', 'service', 'api')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
