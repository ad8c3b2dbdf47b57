"""ruff's rules of pyproject.toml ([tool.ruff.lint]: pyflakes, pycodestyle errors, isort, bugbear) hold everywhere."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is missing: install the test extra (make test does)"
    run = subprocess.run([ruff, "check", "--no-cache", "islands", "benchmarks", "tests", "examples"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
