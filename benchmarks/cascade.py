"""A cascade against one model at equal training FLOPs on Fashion-MNIST (issue 37, section 5): a class-conditional
14x14 base model followed by an image-conditioned 14 -> 28 super-resolution model (SR3's cascade; `model.condition:
image`, `data.condition_resolution: 14`), against one class-conditional 28x28 model.

The networks and the recipe are section 22's (benchmarks/low_res_first.py: its half-width U-Net, rectified flow,
bf16, batch 32, one thread a run), at its larger budget: 12800 images at 28x28. The cascade spends half the budget
on each stage; its super-resolution network reads the upsampled 14x14 image as a second input channel (a first
convolution with one more input channel: its FLOPs are counted as the run's flops.json counts them). Each model
draws 500 samples with the same noise (DPM-Solver++(2M), 8 steps), every class in turn; the cascade's
super-resolution stage draws its samples for the base model's. Scored by `islands eval`'s FD and KID on the
classifier features of section 6, beside the super-resolution stage on the data's own 14x14 images (what it does
given a perfect base model).

    python -m benchmarks cascade
"""

import math
import time
from pathlib import Path

import torch

from benchmarks.common import cpu_seconds, others_share, save, setup, table
from benchmarks.low_res_first import BATCH, HIGH, LOW, METRICS, MODEL, NUM, THREADS, config, per_image, trained
from islands.conditions import SampleRequest
from islands.config import validate
from islands.data import build_data
from islands.ddm.pipeline import training_flops
from islands.eval.evaluate import Evaluator
from islands.generate import open_run
from islands.train.flops import flops_per_image
from islands.train.objectives import build_objective

WORK = Path("runs/benchmarks/cascade")
IMAGES = 12800  # a 28x28 run's; the cascade costs the same
BASE_SHARE = 0.5  # of the budget spent on the 14x14 base model


def super_resolution(run_dir: Path, images: int) -> dict:
    """Section 22's 28x28 run, conditioned on its 14x14 image instead of its class."""
    cfg = config(run_dir, HIGH, images)
    cfg["data"]["condition_resolution"] = LOW
    cfg["model"] = {**cfg["model"], "num_classes": 0, "condition": "image"}
    return cfg


def sr_per_image(raw: dict) -> float:
    cfg = validate(raw)
    return flops_per_image(cfg.model, (1, HIGH, HIGH), 0, build_objective(cfg, 0), BATCH)


def scored(evaluator: Evaluator, x: torch.Tensor, labels: torch.Tensor | None) -> dict:
    """`islands eval`'s figures of samples x (in [-1, 1] once clamped), drawn for `labels`."""
    batches = [(x[i:i + 250].clamp(-1, 1), None if labels is None else labels[i:i + 250])
               for i in range(0, len(x), 250)]
    return evaluator(batches)


def run() -> dict:
    setup()
    torch.set_num_threads(THREADS)
    high, low = per_image(config(WORK, HIGH, IMAGES)), per_image(config(WORK, LOW, IMAGES))
    sr = sr_per_image(super_resolution(WORK, IMAGES))
    base_images = BATCH * round(BASE_SHARE * IMAGES * high / low / BATCH)
    sr_images = BATCH * math.ceil((IMAGES * high - base_images * low) / sr / BATCH)
    print(f"GFLOP per training image: {high / 1e9:.3f} at {HIGH}x{HIGH}, {low / 1e9:.3f} at {LOW}x{LOW}, "
          f"{sr / 1e9:.3f} for super-resolution; the cascade: {base_images} images at {LOW}x{LOW}, then "
          f"{sr_images} for {LOW} -> {HIGH}", flush=True)
    runs, costs = {}, {}
    runs["one 28x28 model"], costs["one 28x28 model"] = trained(config(WORK / "full", HIGH, IMAGES))
    runs["base"], costs["base"] = trained(config(WORK / "base", LOW, base_images))
    runs["super-resolution"], costs["super-resolution"] = trained(super_resolution(WORK / "sr", sr_images))
    flops = {name: training_flops(run_dir) for name, run_dir in runs.items()}

    one, base, refine = (open_run(runs[name]) for name in ("one 28x28 model", "base", "super-resolution"))
    data = build_data(one.cfg.data, one.cfg.seed)
    evaluator = Evaluator(data, one.cfg.eval, one.cfg.seed)
    labels = one.conditions(NUM)
    found, seconds = {}, {}
    for name, draw in {
        "one 28x28 model": lambda: one.generate(NUM, labels),
        "cascade (base 14x14, then 14 -> 28)": lambda: refine.generate(
            NUM, refine.conditions(NUM, SampleRequest(images=base.generate(NUM, labels)))),
        "14 -> 28 on the data's own 14x14 images": lambda: refine.generate(
            NUM, refine.conditions(NUM, SampleRequest(images=data.get(list(range(NUM)))[0]))),
    }.items():
        since, start = cpu_seconds(), time.perf_counter()
        x = draw()
        seconds[name] = {"sampling_seconds": time.perf_counter() - start,
                         "sampling_others_cpu_share": others_share(since)}
        found[name] = {**scored(evaluator, x, None if "data's own" in name else labels), **seconds[name]}
        print(f"  {name}: FD {found[name]['fd']:.3f}", flush=True)
    cascade_flops = flops["base"] + flops["super-resolution"]
    rows = [[name, (flops["one 28x28 model"] if name.startswith("one") else cascade_flops) / 1e12,
             *(scale * found[name][m] for m, scale in METRICS.items())] for name in found]
    print(table(["samples", "training TFLOP", "FD", "KID x1e3", "KID s.e. x1e3", "precision", "recall"], rows))
    ratio = found["cascade (base 14x14, then 14 -> 28)"]["fd"] / found["one 28x28 model"]["fd"]
    print(f"cascade FD / one model's: {ratio:.2f} at {cascade_flops / flops['one 28x28 model']:.2f}x its FLOPs")
    save("cascade", {"results": found, "training": costs, "training_flops": flops, "base_images": base_images,
                     "sr_images": sr_images, "gflop_per_image": {"14": low / 1e9, "28": high / 1e9, "sr": sr / 1e9},
                     "fd_ratio": ratio, "model": MODEL, "threads": THREADS, "samples": NUM,
                     "claim": "the cascade's FD against one 28x28 model's at equal training FLOPs (measured, no "
                              "target)", "met": True})
    return {"met": True}


if __name__ == "__main__":
    run()
