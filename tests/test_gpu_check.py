"""The GPU check (benchmarks/gpu.py) runs every part in its dry mode, so that it is ready for the first GPU it meets."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import fashion_mnist_or_skip

ROOT = Path(__file__).resolve().parent.parent
GPU_RESULTS = ROOT / "benchmarks" / "results" / "gpu.json"


def stamp(path: Path):
    return path.stat().st_mtime_ns if path.exists() else None


def test_the_dry_gpu_check_trains_both_dits_runs_the_collectives_and_islands_train_end_to_end(tmp_path):
    fashion_mnist_or_skip()
    out, before = tmp_path / "gpu.json", stamp(GPU_RESULTS)
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--dry", "--out", str(out)], cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["dry"] and r["errors"] == {} and r["skipped"] == {} and r["works"], (r["errors"], r["skipped"])
    assert stamp(GPU_RESULTS) == before  # a dry run never replaces a GPU's figures

    peak = r["peak"]["bf16_matmul_flop_per_s"]
    assert math.isfinite(peak) and peak > 0
    assert set(r["dit"]) == {"islands eager", "diffusers eager", "islands compiled", "diffusers compiled"}
    for name, f in r["dit"].items():
        assert f["steps"] == 2 and f["batch"] == 4, name
        for key in ("images_per_s", "flops_per_image", "mfu", "params"):
            assert math.isfinite(f[key]) and f[key] > 0, (name, key, f[key])
        assert f["images_per_s"] == pytest.approx(f["steps"] * f["batch"] / f["seconds"])
        assert f["mfu"] == pytest.approx(f["flops_per_image"] * f["images_per_s"] / peak)
    for mode in ("eager", "compiled"):  # the diffusers peer ran beside Islands, and the ratio is theirs
        assert r["islands_over_diffusers"][mode] == pytest.approx(
            r["dit"][f"islands {mode}"]["images_per_s"] / r["dit"][f"diffusers {mode}"]["images_per_s"])
    # the two DiTs are the same size: their counted FLOPs agree within the peer's extra learned-variance outputs
    assert r["dit"]["diffusers eager"]["flops_per_image"] == pytest.approx(
        r["dit"]["islands eager"]["flops_per_image"], rel=0.1)

    comm = r["collectives"]
    expected = {"gloo", "nccl"} if torch.cuda.device_count() >= 2 else {"gloo"}
    assert expected <= set(comm)
    for kind in expected:  # each rank put in rank + 1: the sum on every element is 3
        assert comm[kind]["correct"] and comm[kind]["bus_gb_per_s"] > 0, comm[kind]
    assert comm["islands_world_correct"]

    # 64 images at batch 16: 4 steps, the checkpoint at image 64, on one rank and on two
    assert set(r["end_to_end"]) == {"1 rank", "2 ranks"}
    for name, e in r["end_to_end"].items():
        assert e["exit"] == [0] * e["ranks"], (name, e["stderr_tail"])
        assert (e["images"], e["steps"], e["checkpoint"]) == (64, 4, "000000000064"), name
        assert math.isfinite(e["images_per_s"]) and e["images_per_s"] > 0, name


@pytest.mark.skipif(torch.cuda.is_available(), reason="without a GPU only")
def test_without_a_gpu_the_full_check_says_so_in_one_line_and_writes_nothing():
    before = stamp(GPU_RESULTS)
    run = subprocess.run([sys.executable, "-m", "benchmarks", "gpu"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    said = [line for line in run.stdout.splitlines() if "no CUDA device" in line]
    assert len(said) == 1 and "--dry" in said[0], run.stdout
    assert any(line.split()[:2] == ["gpu", "skipped"] for line in run.stdout.splitlines()), run.stdout
    assert stamp(GPU_RESULTS) == before
