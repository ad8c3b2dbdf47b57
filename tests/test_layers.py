"""The layer contract of DESIGN.md section 2 (pyproject.toml, [tool.importlinter]): no module imports a layer
above its own. Before this test, the trainer imported the ensemble for distillation; lint-imports named it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_layer_imports_one_above_it():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert lint, "lint-imports is missing: install the test extra (make test does)"
    run = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "1 kept, 0 broken" in run.stdout
