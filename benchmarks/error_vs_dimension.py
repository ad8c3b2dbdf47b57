"""The seed's experiment (Qiao et al., ICML 2025; issue 14, item 6): the generation error of diffusion models trained
by heterogeneous workers that synchronise rarely, against the data dimension d, the update frequency H and the
learning rate, on Gaussian mixtures where every error is exact.

Two replicas on 2 gloo ranks run local SGD with unequal batches (16 and 48 images a step), learning rates (lr and
lr / 2) and steps per round (H and H / 2), averaged by the images each consumed. The data: 8 Gaussians of std 0.5
with unequal weights, their means 3 apart from the origin in random directions of R^d. Errors, from the trained
network and its samples: the velocity MSE against the mixture's exact velocity (summed over coordinates, the
flow-matching loss above its minimum: the quantity such bounds are stated in), the cross-entropy of the samples
under the true density against the data's own (nats per sample; its size is the error: samples that crowd the
modes score below the data), and the sliced Wasserstein-2 distance.

The bound grows linearly in d. A straight line and a power law are fitted to each error against d; the exponent
says whether the growth is linear (1), slower or faster.

    python -m benchmarks error_vs_dimension
"""

import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import yaml

from benchmarks.common import FIGURES, save, table
from islands.eval.evaluate import evaluate_target
from islands.parallel.launch import free_port

DIMENSIONS = (2, 8, 32, 128)
BASE = {"d": 32, "H": 10, "lr": 1e-3}
SWEEPS = {"d": DIMENSIONS, "H": (1, 10, 50), "lr": (3e-4, 1e-3, 3e-3)}
IMAGES, BATCHES, MODES = 96_000, (16, 48), 8
ERRORS = ("velocity_mse", "nll_error", "swd")


def mixture(d: int) -> dict:
    generator = torch.Generator().manual_seed(d)
    directions = torch.randn(MODES, d, generator=generator)
    means = 3.0 * directions / directions.norm(dim=1, keepdim=True)
    weights = torch.arange(1, MODES + 1, dtype=torch.float64)
    return {"source": "gmm", "means": means.tolist(), "std": 0.5, "weights": (weights / weights.sum()).tolist(),
            "size": 50_000}


def config(run_dir: Path, d: int, every: int, lr: float) -> dict:
    return {"run_dir": str(run_dir), "seed": 0, "data": mixture(d),
            "model": {"arch": "mlp", "hidden": 256, "depth": 4},
            "train": {"images": IMAGES, "batch_size": sum(BATCHES), "lr": lr, "warmup_images": 4096,
                      "ema_halflife_images": 4000, "checkpoint_every": IMAGES, "log_every": 8192},
            "parallel": {"strategy": "local_sgd", "sync_every": every, "worker_batch": list(BATCHES),
                         "worker_lr": [lr, lr / 2], "worker_sync_every": [every, max(1, every // 2)]},
            "sample": {"num": 16, "steps": 32, "solver": "heun"}, "eval": {"num": 4096}}


def trained(root: Path, d: int, every: int, lr: float) -> dict:
    name = f"d{d}_H{every}_lr{lr:g}"
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config(root / name, d, every, lr)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "islands", "train", str(path), "--quiet"]
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    result, _ = evaluate_target(root / name, metric_names=["nll", "swd", "velocity_mse"], progress=False)
    gap = result["nll"] - result["nll_data"]  # negative when the samples crowd the modes more than the data do
    errors = {"velocity_mse": result["velocity_mse"], "nll_gap": gap, "nll_error": abs(gap), "swd": result["swd"]}
    print(f"  d={d} H={every} lr={lr:g}: " + ", ".join(f"{k} {v:.4f}" for k, v in errors.items()), flush=True)
    return errors


def fits(ds: list, values: list) -> dict:
    """A straight line e = a + b d (its R^2) and a power law e = c d^k (k by least squares on logs)."""
    x, y = np.asarray(ds, dtype=float), np.asarray(values, dtype=float)
    b, a = np.polyfit(x, y, 1)
    r2 = 1 - ((y - (a + b * x)) ** 2).sum() / ((y - y.mean()) ** 2).sum()
    positive = y > 0
    k = float(np.polyfit(np.log(x[positive]), np.log(y[positive]), 1)[0]) if positive.sum() >= 2 else math.nan
    return {"slope": float(b), "intercept": float(a), "r2": float(r2), "exponent": k}


def figure(results: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), dpi=100)
    for ax, (key, values) in zip(axes, SWEEPS.items(), strict=True):
        for error in ERRORS:
            ax.plot(values, [results[key][str(v)][error] for v in values], marker="o", label=error)
        ax.set(xscale="log", yscale="log", xlabel={"d": "data dimension d", "H": "steps per synchronisation H",
                                                   "lr": "learning rate"}[key], ylabel="error")
        ax.set_title(f"{key} swept; " + ", ".join(f"{k}={v:g}" for k, v in BASE.items() if k != key), fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = FIGURES / "error_vs_dimension.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def run() -> dict:
    torch.set_num_threads(2)
    done: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for key, values in SWEEPS.items():
            results[key] = {}
            for v in values:
                point = {**BASE, key: v}
                cell = (point["d"], point["H"], point["lr"])
                if cell not in done:
                    done[cell] = trained(Path(tmp), *cell)
                results[key][str(v)] = done[cell]
    rows = [[key, v, *(results[key][str(v)][e] for e in ERRORS)] for key, values in SWEEPS.items() for v in values]
    print(table(["swept", "value", *ERRORS], rows))
    by_d = {e: fits(list(DIMENSIONS), [results["d"][str(d)][e] for d in DIMENSIONS]) for e in ERRORS}
    for e, f in by_d.items():
        print(f"{e} against d: {f['intercept']:.4f} + {f['slope']:.5f} d (R^2 {f['r2']:.3f}); power law exponent "
              f"{f['exponent']:.2f}")
    figure(results)
    linear = 0.7 <= by_d["velocity_mse"]["exponent"] <= 1.3
    save("error_vs_dimension", {"results": results, "fits_against_d": by_d, "base": BASE, "images": IMAGES,
                                "worker_batch": BATCHES, "met": linear,
                                "claim": "the velocity error grows linearly in d (power-law exponent 0.7 to 1.3)"})
    return {"met": linear}


if __name__ == "__main__":
    run()
