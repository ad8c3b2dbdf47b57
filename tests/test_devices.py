"""Device errors made visible on a machine without a GPU: the process group's backend on GPUs, and the checks of
tests/fake_gpu_checks.py, run on a fake accelerator in a process of their own."""

import os
import re
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from islands.parallel import launch

TESTS = Path(__file__).parent


def test_a_gpu_world_joins_a_group_with_gloo_beside_nccl(monkeypatch):
    """NCCL alone refuses every CPU tensor; the group must carry both (torch's `cpu:gloo,cuda:nccl`)."""
    joined = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(launch, "_store", lambda *args: None)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: joined.update(backend=backend))
    world = launch.init_world()
    assert joined["backend"] == "cpu:gloo,cuda:nccl"
    assert world.device == torch.device("cuda", 1) and (world.rank, world.size) == (1, 2)
    assert launch.backend_for(torch.device("cpu")) == "gloo"


def test_every_check_passes_on_a_fake_gpu():
    """tests/fake_gpu_checks.py in a fresh process: its device's registration cannot be undone."""
    checks = str(TESTS / "fake_gpu_checks.py")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", checks], cwd=TESTS.parent,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert re.search(r"\b(\d+) passed", out.stdout) and "skipped" not in out.stdout, out.stdout[-2000:]
