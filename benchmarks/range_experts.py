"""Timestep-range experts against one model at equal training FLOPs, on the 32-D Gaussian mixture of ddm_gmm.

Every expert is the same MLP as the one model, so FLOPs per training image are the same and equal FLOPs means
equal images: R range experts get IMAGES / R each. From scratch, each range expert starts from random weights;
with eDiff-I's recipe (Balaji et al. 2022) one model is first trained on all t for half the images, then each
range expert is a copy of it fine-tuned on its range for the other half / R. Every model samples the same noise
through Heun with 16 steps (the gate adds the range boundaries to the grid); metrics are exact: the mean negative
log-likelihood under the true mixture, the sliced W2 distance, the error in mode masses and the velocity error
against the exact field.

    python -m benchmarks range_experts
"""

import tempfile
from pathlib import Path

from benchmarks.common import save, setup, table
from benchmarks.ddm_gmm import config
from islands.config import validate
from islands.data import build_data
from islands.ddm.time_gate import load_time_gate
from islands.eval.evaluate import Evaluator, generated
from islands.flow.samplers import HEUN_T_MIN, evaluations_per_sample, time_grid, with_boundaries
from islands.generate import load_denoiser
from islands.trainer import train
from islands.trainer.ranges import tstage_config

IMAGES = 64_000
RANGES = {"R=2": [0.0, 0.5, 1.0], "R=3": [0.0, 1 / 3, 2 / 3, 1.0], "R=2 skewed": [0.0, 0.2, 1.0]}
METRICS = ("nll", "swd", "mode_mass_error", "velocity_mse")


def raw(run_dir: Path, images: int, **flow) -> dict:
    cfg = config(run_dir)
    cfg["train"].update(images=images, checkpoint_every=images)
    cfg["flow"] = {**cfg.get("flow", {}), **flow}
    return cfg


def ranges(run_dir: Path, bounds: list, images: int, init_from: Path | None = None) -> Path:
    """Train every range of `bounds` for `images` each (from `init_from`, if given) into run_dir/tstages."""
    cfg = raw(run_dir, images, t_ranges=bounds)
    if init_from is not None:
        cfg["train"].update(init_from=str(init_from), warmup_images=0)
    for i in range(len(bounds) - 1):
        train(tstage_config(validate(cfg), i), progress=False)
    return run_dir


def evaluate(denoiser, cfg) -> dict:
    evaluator = Evaluator(build_data(cfg.data, cfg.seed), cfg.eval, cfg.seed)
    batches = generated(denoiser, (len(cfg.data.means[0]),), cfg.eval.num, cfg.sample, cfg.seed, 0)
    return evaluator(batches, denoiser)


def run() -> dict:
    setup()
    found, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        one = train(validate(raw(work / "one", IMAGES)), progress=False)
        denoiser, cfg, _ = load_denoiser(one)
        found["one model"] = evaluate(denoiser, cfg)
        base = train(validate(raw(work / "base", IMAGES // 2)), progress=False)
        runs = {}
        for name, bounds in RANGES.items():
            runs[f"{name}, from scratch"] = (ranges(work / name, bounds, IMAGES // (len(bounds) - 1)), bounds)
            runs[f"{name}, eDiff-I"] = (ranges(work / f"{name} init", bounds, IMAGES // 2 // (len(bounds) - 1),
                                               base), bounds)
        for label, (run_dir, _) in runs.items():
            gate, cfg, _ = load_time_gate(run_dir)
            found[label] = evaluate(gate, cfg)
            print(f"  {label}: nll {found[label]['nll']:.3f}", flush=True)
    evals = {"one model": evaluations_per_sample("heun", 16)}
    for label, (_, bounds) in runs.items():  # Heun's evaluations on the grid with the boundaries added
        grid = with_boundaries(time_grid(16, t_min=HEUN_T_MIN), bounds[1:-1])
        evals[label] = 2 * (len(grid) - 1) - 1
    for label, result in found.items():
        rows.append([label, *(result[m] for m in METRICS), evals[label]])
    print(table(["model", "NLL", "sliced W2", "mode mass err", "velocity MSE", "evals/sample"], rows))
    mono = found["one model"]["nll"]
    best = min((v["nll"], k) for k, v in found.items() if k != "one model")
    won = best[0] < mono
    print(f"best range experts by NLL: {best[1]} {best[0]:.3f} against one model's {mono:.3f} (data itself: "
          f"{found['one model']['nll_data']:.3f}): range experts {'win' if won else 'do NOT win'} at equal FLOPs")
    save("range_experts", {"results": found, "images": IMAGES, "ranges": RANGES, "evaluations_per_sample": evals,
                           "claim": "some range experts' NLL below one model's at equal training FLOPs",
                           "met": won})
    return {"met": won}


if __name__ == "__main__":
    run()
