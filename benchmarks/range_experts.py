"""Timestep-range experts against one model at equal training FLOPs: on the 32-D Gaussian mixture of ddm_gmm (exact
metrics), and on Fashion-MNIST with the U-Net of ddm_fashion (FD and KID on the evaluation's classifier features).

Every expert is the same network as the one model, so FLOPs per training image are the same and equal FLOPs means
equal images: R range experts get IMAGES / R each. From scratch, each range expert starts from random weights;
with eDiff-I's recipe (Balaji et al. 2022) one model is first trained on all t for half the images, then each
range expert is a copy of it fine-tuned on its range for the other half / R. Every model samples the same noise
through Heun with 16 steps (the gate adds the range boundaries to the grid). On the mixture the metrics are exact:
the mean negative log-likelihood under the true mixture, the sliced W2 distance, the error in mode masses and the
velocity error against the exact field.

    python -m benchmarks range_experts
"""

import tempfile
from pathlib import Path

from benchmarks.common import save, setup, table
from benchmarks.ddm_fashion import config as fashion_config
from benchmarks.ddm_gmm import config as gmm_config
from islands.config import validate
from islands.data import build_data
from islands.ddm.sampling import open_sampler
from islands.eval.evaluate import Evaluator, generated
from islands.flow.samplers import HEUN_T_MIN, evaluations_per_sample, time_grid, with_boundaries
from islands.parallel.launch import bf16_is_native
from islands.trainer import train
from islands.trainer.ranges import tstage_config

IMAGES = 64_000
RANGES = {"R=2": [0.0, 0.5, 1.0], "R=3": [0.0, 1 / 3, 2 / 3, 1.0], "R=2 skewed": [0.0, 0.2, 1.0]}
METRICS = ("nll", "swd", "mode_mass_error", "velocity_mse")
FASHION_IMAGES, FASHION_RANGES, FASHION_NUM = 60_000, {"R=2": [0.0, 0.5, 1.0]}, 1000
# the Evaluator's keys, with the factor each is printed at (KID x1e3, as in ddm_fashion)
FASHION_METRICS = {"fd": 1, "kid": 1e3, "kid_se": 1e3, "precision": 1, "recall": 1}


def gmm_raw(run_dir: Path, images: int) -> dict:
    cfg = gmm_config(run_dir)
    cfg["train"].update(images=images, checkpoint_every=images)
    return cfg


def fashion_raw(run_dir: Path, images: int) -> dict:
    """ddm_fashion's monolith for `images`, in fp32 where this CPU only emulates bf16 (10x slower)."""
    cfg = fashion_config(run_dir, images=images)
    cfg["train"].update(checkpoint_every=images, sample_every=images)
    cfg["eval"]["num"] = FASHION_NUM
    if not bf16_is_native("cpu"):
        cfg["train"]["precision"] = cfg["sample"]["precision"] = "fp32"
    return cfg


def ranges(cfg: dict, bounds: list, init_from: Path | None = None) -> Path:
    """Train every range of `bounds` for the config's images each (from `init_from`, if given) into RUN/tstages."""
    cfg = {**cfg, "flow": {**cfg.get("flow", {}), "t_ranges": bounds}, "train": dict(cfg["train"])}
    if init_from is not None:
        cfg["train"].update(init_from=str(init_from), warmup_images=0)
    for i in range(len(bounds) - 1):
        train(tstage_config(validate(cfg), i), progress=False)
    return Path(cfg["run_dir"])


def evaluate(sampler) -> dict:
    cfg = sampler.cfg
    evaluator = Evaluator(build_data(cfg.data, cfg.seed), cfg.eval, cfg.seed)
    return evaluator(generated(sampler, cfg.eval.num), sampler.denoiser)


def compare(work: Path, raw, images: int, range_sets: dict, shape: tuple, num_classes: int) -> tuple[dict, dict]:
    """The one model, then every range set from scratch and from eDiff-I's half-budget base, all evaluated.
    -> (metrics by label, the bounds of each label's range set)."""
    one = train(validate(raw(work / "one", images)), progress=False)
    found, runs = {"one model": evaluate(open_sampler(one))}, {}
    base = train(validate(raw(work / "base", images // 2)), progress=False)
    for name, bounds in range_sets.items():
        r = len(bounds) - 1
        runs[f"{name}, from scratch"] = (ranges(raw(work / name, images // r), bounds), bounds)
        runs[f"{name}, eDiff-I"] = (ranges(raw(work / f"{name} init", images // 2 // r), bounds, base), bounds)
    for label, (run_dir, _) in runs.items():
        found[label] = evaluate(open_sampler(run_dir))
        print(f"  {label}: {', '.join(f'{k} {v:.3f}' for k, v in found[label].items() if k in ('nll', 'fd'))}",
              flush=True)
    return found, {label: bounds for label, (_, bounds) in runs.items()}


def heun_evaluations(bounds: dict) -> dict:
    """Heun's network evaluations per sample on 16 steps, the grid with each range set's boundaries added."""
    evals = {"one model": evaluations_per_sample("heun", 16)}
    for label, b in bounds.items():
        grid = with_boundaries(time_grid(16, t_min=HEUN_T_MIN), b[1:-1])
        evals[label] = 2 * (len(grid) - 1) - 1
    return evals


def run() -> dict:
    setup()
    with tempfile.TemporaryDirectory() as tmp:  # the longer half first, its table printed as soon as it is done
        print("Fashion-MNIST, U-Net:", flush=True)
        fashion, fashion_bounds = compare(Path(tmp) / "fashion", fashion_raw, FASHION_IMAGES, FASHION_RANGES,
                                          (1, 28, 28), 10)
        fashion_evals = heun_evaluations(fashion_bounds)
        print(table(["model", "FD", "KID x1e3", "KID s.e. x1e3", "precision", "recall", "evals/sample"],
                    [[label, *(scale * r[m] for m, scale in FASHION_METRICS.items()), fashion_evals[label]]
                     for label, r in fashion.items()]), flush=True)
        print("32-D mixture, MLP:", flush=True)
        gmm, gmm_bounds = compare(Path(tmp) / "gmm", gmm_raw, IMAGES, RANGES, (32,), 0)
    evals = heun_evaluations(gmm_bounds)
    print(table(["model", "NLL", "sliced W2", "mode mass err", "velocity MSE", "evals/sample"],
                [[label, *(r[m] for m in METRICS), evals[label]] for label, r in gmm.items()]))
    verdicts = {}
    for data, found, metric in (("mixture", gmm, "nll"), ("fashion", fashion, "fd")):
        one, (best, label) = found["one model"][metric], min((v[metric], k) for k, v in found.items()
                                                             if k != "one model")
        verdicts[data] = best < one
        print(f"{data}: best range experts by {metric}: {label} {best:.3f} against one model's {one:.3f}: range "
              f"experts {'win' if best < one else 'do NOT win'} at equal FLOPs")
    won = any(verdicts.values())
    save("range_experts", {"results": gmm, "fashion": fashion, "images": IMAGES, "fashion_images": FASHION_IMAGES,
                           "ranges": RANGES, "fashion_ranges": FASHION_RANGES, "evaluations_per_sample": evals,
                           "fashion_evaluations_per_sample": fashion_evals, "verdicts": verdicts,
                           "claim": "some range experts beat one model at equal training FLOPs (NLL on the "
                                    "mixture, FD on Fashion-MNIST)", "met": won})
    return {"met": won}


if __name__ == "__main__":
    run()
