"""Low resolution first against full resolution at equal training FLOPs on Fashion-MNIST (issue 28, section 4).

A small class-conditional U-Net (benchmarks.common's at half its width) trains on 28x28 images from the start,
without and with SD3's time shift (Esser et al. 2024, eq. 23) of 2, the square root of the pixel-count ratio 784 /
196; against it, the same U-Net trains on 14x14 images (`data.resolution=14`) for half the budget and goes on at
28x28 with `train.init_from` for the other half, with `flow.time_shift=2` and without it. Every weight passes from
14x14 to 28x28 as it is (the attention sits at the same level: side 4 at 14x14, 7 at 28x28). FLOPs per image are
counted as every run's flops.json counts them, and the low-resolution run's images are set so that its two stages
together cost what a 28x28 run costs. Each run samples 500 images with the same noise (DPM-Solver++(2M), 8 steps, its
time grid shifted as it trained) and is scored by `islands eval`'s FD and KID on the classifier features of section 6.

Two small budgets, 3200 and 12800 images at 28x28 (batch 32), to see which way the comparison moves with compute.
Every run uses one thread: two threads wait on each other on a machine that other jobs keep busy. The runs live in
runs/benchmarks/low_res_first/<budget>: rerunning continues where an interrupted run stopped (delete the folder to
start over).

    python -m benchmarks low_res_first
"""

import math
import time
from pathlib import Path

import torch

from benchmarks.common import UNET, cpu_seconds, others_share, save, setup, table
from islands.config import validate
from islands.data import build_data
from islands.ddm.pipeline import training_flops
from islands.eval.evaluate import Evaluator, generated
from islands.generate import open_run
from islands.parallel.launch import bf16_is_native
from islands.train.flops import flops_per_image
from islands.train.objectives import build_objective
from islands.trainer import train

WORK = Path("runs/benchmarks/low_res_first")
BUDGETS, BATCH = (3200, 12800), 32  # images of a 28x28 run; the low-resolution runs cost the same
LOW, HIGH = 14, 28
SHIFT = math.sqrt(HIGH**2 / LOW**2)  # SD3: the square root of the pixel-count ratio
LOW_SHARE = 0.5  # of the budget spent at 14x14
MODEL = dict(UNET, channels=16)  # half the width of the other benchmarks' U-Net, for more images in the budget
NUM, THREADS = 500, 1
FULL, SHIFTED = "28x28 from the start", f"28x28 from the start, shift {SHIFT:g}"
LOWRES, UNSHIFTED = f"14x14 then 28x28, shift {SHIFT:g}", "14x14 then 28x28, no shift"
METRICS = {"fd": 1, "kid": 1e3, "kid_se": 1e3, "precision": 1, "recall": 1}  # printed at these factors


def config(run_dir: Path, side: int, images: int, shift: float = 1.0, init_from: Path | None = None) -> dict:
    precision = "bf16" if bf16_is_native("cpu") else "fp32"
    cfg = {"run_dir": str(run_dir), "seed": 0,
           "data": {"source": "fashion_mnist", "resolution": side},
           # the attention at the lowest level: its side is 7 at 28x28 and 4 at 14x14
           "model": {**MODEL, "attention_resolutions": [(side // 2 + 1) // 2]},
           "flow": {"path": "rectified_flow", "prediction": "velocity", "time_sampler": "logit_normal",
                    "time_shift": shift},
           "train": {"images": images, "batch_size": BATCH, "lr": 1e-3, "warmup_images": 1000,
                     "precision": precision, "ema_halflife_images": 4000, "checkpoint_every": images,
                     "log_every": images, "sample_every": images, "threads": THREADS},
           "sample": {"num": 64, "steps": 8, "solver": "dpm2m", "guidance": 1.0, "batch_size": 500,
                      "precision": precision},
           "eval": {"num": NUM, "val_size": 0}}
    if init_from is not None:
        cfg["train"]["init_from"] = str(init_from)
    return cfg


def per_image(raw: dict) -> float:
    """Training FLOPs per image, counted as the run's own flops.json counts them."""
    cfg = validate(raw)
    side = cfg.data.resolution
    return flops_per_image(cfg.model, (1, side, side), 10, build_objective(cfg, 10), BATCH)


def trained(raw: dict) -> tuple[Path, dict]:
    """Train the run; -> (its folder, its wall seconds and the share of the CPUs others took meanwhile)."""
    since, start = cpu_seconds(), time.perf_counter()
    run = train(validate(raw), progress=False)
    return run, {"seconds": time.perf_counter() - start, "others_cpu_share": others_share(since)}


def compare(images: int, evaluator: Evaluator | None) -> tuple[dict, Evaluator]:
    """The four runs at the cost of `images` 28x28 images, trained and scored. -> (their figures, the evaluator)."""
    high, low = per_image(config(WORK, HIGH, images)), per_image(config(WORK, LOW, images))
    low_images = BATCH * round(LOW_SHARE * images * high / low / BATCH)
    rest = BATCH * math.ceil((images * high - low_images * low) / high / BATCH)
    print(f"{images} images: GFLOP per training image {high / 1e9:.3f} at {HIGH}x{HIGH}, {low / 1e9:.3f} at "
          f"{LOW}x{LOW}; low resolution first: {low_images} images at {LOW}x{LOW}, then {rest} at {HIGH}x{HIGH}",
          flush=True)
    work, runs, costs = WORK / str(images), {}, {}
    runs[FULL], costs[FULL] = trained(config(work / "full", HIGH, images))
    runs[SHIFTED], costs[SHIFTED] = trained(config(work / "full_shift", HIGH, images, SHIFT))
    first, cost = trained(config(work / "low", LOW, low_images))
    for label, shift in ((LOWRES, SHIFT), (UNSHIFTED, 1.0)):  # both from the same 14x14 run
        runs[label], then = trained(config(work / f"then_high_shift{shift:g}", HIGH, rest, shift, init_from=first))
        seconds = cost["seconds"] + then["seconds"]  # both stages; the others' share weighted by time
        costs[label] = {"seconds": seconds, "others_cpu_share": (cost["others_cpu_share"] * cost["seconds"] +
                                                                 then["others_cpu_share"] * then["seconds"]) / seconds}
    flops = {label: training_flops(run) for label, run in runs.items()}
    for label in (LOWRES, UNSHIFTED):
        flops[label] += training_flops(first)
    found = {}
    for label, run_dir in runs.items():
        sampler = open_run(run_dir)
        cfg = sampler.cfg
        evaluator = evaluator or Evaluator(build_data(cfg.data, cfg.seed), cfg.eval, cfg.seed)
        since, start = cpu_seconds(), time.perf_counter()
        found[label] = {**evaluator(generated(sampler, NUM), sampler.denoiser),
                        "sampling_seconds": time.perf_counter() - start,
                        "sampling_others_cpu_share": others_share(since), "time_shift": sampler.opts.time_shift}
        print(f"  {label}: FD {found[label]['fd']:.3f}", flush=True)
    print(table(["run", "training TFLOP", "training s", "others' CPU share", "FD", "KID x1e3", "KID s.e. x1e3",
                 "precision", "recall"],
                [[label, flops[label] / 1e12, costs[label]["seconds"], costs[label]["others_cpu_share"],
                  *(scale * found[label][m] for m, scale in METRICS.items())] for label in runs]), flush=True)
    return {"results": found, "training": costs, "training_flops": flops, "low_images": low_images,
            "high_images_after_low": rest, "gflop_per_image": {"14": low / 1e9, "28": high / 1e9}}, evaluator


def run() -> dict:
    setup()
    torch.set_num_threads(THREADS)
    budgets, evaluator = {}, None
    for images in BUDGETS:
        budgets[images], evaluator = compare(images, evaluator)
    won = all(b["results"][LOWRES]["fd"] < min(b["results"][FULL]["fd"], b["results"][SHIFTED]["fd"])
              for b in budgets.values())
    print(f"low resolution first {'beats' if won else 'does NOT beat'} both 28x28 runs by FD at equal FLOPs at every "
          "budget")
    save("low_res_first", {"budgets": budgets, "batch": BATCH, "shift": SHIFT, "model": MODEL, "threads": THREADS,
                           "samples": NUM,
                           "claim": "at each budget, 14x14 then 28x28 (shift 2) has a lower FD than 28x28 from the "
                                    "start, with or without the shift, at equal training FLOPs", "met": won})
    return {"met": won}


if __name__ == "__main__":
    run()
