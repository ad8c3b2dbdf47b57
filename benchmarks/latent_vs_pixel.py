"""Latent against pixel diffusion on Fashion-MNIST at equal training wall time (issue 28, section 5).

Our own AutoencoderKL (configs/fashion_autoencoder.yaml: 28x28 -> 4x7x7) trains first for AE_IMAGES images; that
one-time cost is reported apart and not counted in the arms' time. Then three class-conditional U-Nets train for
SECONDS of wall time each, one thread, bf16 where the CPU has it:

- pixels: benchmarks.common's U-Net (32 channels, 28 -> 14 -> 7, attention at 7x7) on the 1x28x28 images;
- latents, encoded on the fly (`data.autoencoder`): the same U-Net without its 28x28 level, (64, 64) channels at 7x7
  and 4x4, attention at 4x4: nearly the parameters (1.00M against 1.12M), a seventh of the FLOPs per image;
- latents, precomputed (`islands encode` once, then `data.source: shards`): the same network on the same latents
  (each example's latent drawn from its stored posterior as the on-the-fly stage draws it), without the encoder in
  the step; the encoding is a one-time cost reported apart.

Equal wall time: each arm trains PROBE images, then continues in calls that each aim at 95% of the time left at the
pace of the call before, until less than a log window's worth is left (`trained_for`). Its time per image is the
median of its metrics.jsonl windows after the first (which holds the start-up). Each run samples 500 images
(DPM-Solver++(2M), 8 steps, the latent runs' samples decoded by `Sampler.generate`), scored by `islands eval`'s FD
and KID on the classifier features of section 6 against the training set. Beside them two floors at 500 images:
500 training images themselves (FD's bias at this sample size), and the autoencoder's reconstructions of the same
500 (decode of the posterior mean): what the latent runs cannot go below.

The runs live in runs/benchmarks/latent_vs_pixel/: rerunning continues where an interrupted run stopped (delete the
folder to start over).

    python -m benchmarks latent_vs_pixel
    python -m benchmarks.latent_vs_pixel --seconds 240 --ae-images 8192    # a shorter run
"""

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch
import yaml

from benchmarks.common import UNET, cached, cpu_seconds, median, others_share, save, setup, table
from islands.cli import main as islands
from islands.conditions import network_spec
from islands.config import load_config, validate
from islands.data import build_data, judged_on
from islands.eval.evaluate import Evaluator, generated
from islands.generate import open_run
from islands.nets import build_network
from islands.nets.vae_folder import load_autoencoder
from islands.parallel.launch import bf16_is_native
from islands.train.flops import flops_per_image
from islands.train.logbook import read_metrics
from islands.train.objectives import build_objective
from islands.trainer import train

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "runs" / "benchmarks" / "latent_vs_pixel"
SECONDS, AE_IMAGES = 540, 40960  # training wall time of each arm; images of the autoencoder
BATCH, PROBE, LOG_EVERY, NUM, THREADS = 32, 2048, 1024, 500, 1
PIXEL_NET = UNET
LATENT_NET = dict(UNET, channel_mult=[2, 2], attention_resolutions=[4])  # the pixel U-Net without its 28x28 level
PIXELS, ON_THE_FLY, STORED = "pixels", "latents, encoded on the fly", "latents, precomputed"
METRICS = {"fd": 1, "kid": 1e3, "kid_se": 1e3}  # printed at these factors


def autoencoder(images: int) -> tuple[Path, dict]:
    """Our AutoencoderKL trained for `images` images (continued where a run stopped). -> (its folder, its cost)."""
    run = WORK / "autoencoder"
    cfg = load_config(ROOT / "configs" / "fashion_autoencoder.yaml",
                      [f"run_dir={run}", f"train.images={images}", f"train.checkpoint_every={min(images, 8192)}",
                       f"train.log_every={LOG_EVERY}", f"train.threads={THREADS}"])
    since, start = cpu_seconds(), time.perf_counter()
    train(cfg, progress=False)
    cost = cached(WORK / "timings.json", f"autoencoder {images}",
                  lambda: {"seconds": time.perf_counter() - start, "others_cpu_share": others_share(since)})
    seconds = seconds_per_image(run)
    reconstruction = json.loads((run / "autoencoder" / "reconstruction.json").read_text())
    return run / "autoencoder", {**cost, "images": images, "seconds_per_image": seconds,
                                 "one_time_seconds": seconds * images, "reconstruction": reconstruction}


def config(run_dir: Path, model: dict, images: int, data: dict) -> dict:
    precision = "bf16" if bf16_is_native("cpu") else "fp32"
    return {"run_dir": str(run_dir), "seed": 0, "data": data, "model": model,
            "flow": {"path": "rectified_flow", "prediction": "velocity", "time_sampler": "logit_normal"},
            "train": {"images": images, "batch_size": BATCH, "lr": 1e-3, "warmup_images": 1000,
                      "precision": precision, "ema_halflife_images": 4000, "checkpoint_every": 8 * LOG_EVERY,
                      "log_every": LOG_EVERY, "sample_every": 0, "threads": THREADS},
            "sample": {"num": 64, "steps": 8, "solver": "dpm2m", "guidance": 1.0, "batch_size": NUM,
                       "precision": precision},
            "eval": {"num": NUM, "val_size": 0}}


def seconds_per_image(run: Path) -> float:
    """The median of the run's log windows after the first (the start-up), as benchmarks/autoencoder.py takes it."""
    windows = read_metrics(run)
    return 1 / median([w["images_per_s"] for w in windows[1:]] or [windows[-1]["images_per_s"]])


def encoded(folder: Path, ae_images: int) -> tuple[Path, dict]:
    """The training set's latents written once by `islands encode` -> (the shard folder, its one-time cost)."""
    out, path = WORK / f"latents_ae{ae_images}", WORK / "encode.yaml"
    path.write_text(yaml.safe_dump({"run_dir": str(WORK / "encode"), "seed": 0, "data": {"source": "fashion_mnist"}}))

    def encode() -> dict:
        shutil.rmtree(out, ignore_errors=True)  # a write that an interruption left unfinished
        since, start = cpu_seconds(), time.perf_counter()
        assert islands(["encode", str(path), str(out), "--autoencoder", str(folder), "--quiet"]) == 0
        return {"seconds": time.perf_counter() - start, "others_cpu_share": others_share(since)}

    cost = cached(WORK / "timings.json", out.name, encode)
    return out, {**cost, "images": json.loads((out / "manifest.json").read_text())["examples"]}


def trained_for(raw: dict, seconds: int) -> dict:
    """Train the run for `seconds` of wall time, in calls that each aim at most of the time left at the pace of the one
    before (start-up included), until what is left would not fill one log window: a pace measured once misleads when
    other jobs load the machine more later on. The learning rate is constant after the warm-up, so the calls train as
    one run would."""
    run, timings, images, calls = Path(raw["run_dir"]), WORK / "timings.json", PROBE, []

    def timed(images: int) -> dict:
        since, start = cpu_seconds(), time.perf_counter()
        train(validate({**raw, "train": {**raw["train"], "images": images}}), progress=False)
        return {"images": images, "seconds": time.perf_counter() - start, "others_cpu_share": others_share(since)}

    while True:
        calls.append(cached(timings, f"{run.name} to {images}", lambda images=images: timed(images)))
        done = calls[-2]["images"] if len(calls) > 1 else 0
        pace = calls[-1]["seconds"] / (images - done)  # seconds per image of the last call, start-up included
        more = BATCH * math.floor(0.95 * (seconds - sum(c["seconds"] for c in calls)) / pace / BATCH)
        if more < LOG_EVERY:
            break
        images += more
    total = sum(c["seconds"] for c in calls)
    share = sum(c["others_cpu_share"] * c["seconds"] for c in calls) / total
    print(f"  {run.name}: {images} images in {total:.0f} s ({len(calls)} calls)", flush=True)
    return {"images": images, "seconds": total, "others_cpu_share": share, "calls": calls,
            "seconds_per_image": seconds_per_image(run)}


def network(raw: dict, shape: tuple) -> dict:
    """The diffusion network's parameters and training GFLOP per image (the encoder's not counted), as the run's
    flops.json counts them."""
    cfg = validate(raw)
    return {"parameters": sum(p.numel() for p in build_network(network_spec(cfg.model, shape, 10)).parameters()),
            "network_gflop_per_image": flops_per_image(cfg.model, shape, 10, build_objective(cfg, 10), BATCH) / 1e9}


@torch.no_grad()
def floors(evaluator: Evaluator, folder: Path) -> dict:
    """FD and KID of 500 training images, and of the autoencoder's reconstructions of them (decode of the mean)."""
    source = evaluator.source
    order = torch.randperm(len(source), generator=torch.Generator().manual_seed(1))[:NUM].sort().values
    x, y = source.get(order.tolist())
    vae = load_autoencoder(folder)
    rebuilt = vae.decode(vae.encode(x).mean).clamp(-1, 1)
    return {"training images": evaluator([(x, y)]), "autoencoder reconstructions": evaluator([(rebuilt, y)]),
            "reconstruction_l1": (rebuilt - x).abs().mean().item()}


def scored(evaluator: Evaluator, run: Path) -> dict:
    sampler = open_run(run)
    since, start = cpu_seconds(), time.perf_counter()
    found = evaluator(generated(sampler, NUM), sampler.denoiser)
    return {**found, "sampling_and_scoring_seconds": time.perf_counter() - start,
            "sampling_others_cpu_share": others_share(since)}


def run(seconds: int = SECONDS, ae_images: int = AE_IMAGES) -> dict:
    setup()
    torch.set_num_threads(THREADS)
    WORK.mkdir(parents=True, exist_ok=True)
    print(f"autoencoder: {ae_images} images", flush=True)
    folder, ae = autoencoder(ae_images)
    latents, encoding = encoded(folder, ae_images)
    print(f"  {ae['seconds_per_image'] * 1e3:.1f} ms per image, PSNR {ae['reconstruction']['psnr_db']:.1f} dB; "
          f"encoding {encoding['images']} images took {encoding['seconds']:.0f} s", flush=True)
    arms = {  # the latent runs' folders name the autoencoder they are bound to
        PIXELS: (config(WORK / f"pixels_{seconds}s", PIXEL_NET, PROBE, {"source": "fashion_mnist"}), (1, 28, 28)),
        ON_THE_FLY: (config(WORK / f"on_the_fly_{seconds}s_ae{ae_images}", LATENT_NET, PROBE,
                            {"source": "fashion_mnist", "autoencoder": str(folder)}), (4, 7, 7)),
        STORED: (config(WORK / f"stored_{seconds}s_ae{ae_images}", LATENT_NET, PROBE,
                        {"source": "shards", "path": str(latents), "autoencoder": str(folder)}), (4, 7, 7)),
    }
    training = {label: {**trained_for(raw, seconds), **network(raw, shape)} for label, (raw, shape) in arms.items()}
    pixel_cfg = validate(arms[PIXELS][0])
    evaluator = Evaluator(judged_on(build_data(pixel_cfg.data, pixel_cfg.seed)), pixel_cfg.eval, pixel_cfg.seed)
    found = {label: scored(evaluator, Path(raw["run_dir"])) for label, (raw, _) in arms.items()}
    floor = floors(evaluator, folder)
    rows = [[label, f"{training[label]['parameters'] / 1e6:.2f}M", training[label]["network_gflop_per_image"],
             training[label]["seconds_per_image"] * 1e3, training[label]["images"], training[label]["seconds"],
             training[label]["others_cpu_share"], *(scale * found[label][m] for m, scale in METRICS.items())]
            for label in arms]
    rows += [[f"floor: {label}", "", "", "", "", "", "", *(scale * floor[label][m] for m, scale in METRICS.items())]
             for label in ("training images", "autoencoder reconstructions")]
    print(table(["run", "parameters", "network GFLOP/img", "ms per image", "images", "training s",
                 "others' CPU share", "FD", "KID x1e3", "KID s.e. x1e3"], rows), flush=True)
    best_latent = min(found[ON_THE_FLY]["fd"], found[STORED]["fd"])
    won = best_latent < found[PIXELS]["fd"]
    print(f"latent diffusion {'beats' if won else 'does NOT beat'} pixel diffusion by FD at {seconds} s of training "
          f"(the autoencoder's {ae['seconds']:.0f} s not counted)", flush=True)
    result = {"settings": {"seconds": seconds, "batch": BATCH, "probe": PROBE, "samples": NUM, "threads": THREADS,
                           "pixel_net": PIXEL_NET, "latent_net": LATENT_NET, "autoencoder_images": ae_images},
              "autoencoder": ae, "encoding": encoding, "training": training, "results": found, "floors": floor,
              "table": rows, "claim": "a latent run (on the fly or precomputed) reaches a lower FD than the pixel run "
                                      "at equal training wall time, the autoencoder's training not counted",
              "met": won}
    save("latent_vs_pixel", result)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=SECONDS, help="training wall time of each arm")
    parser.add_argument("--ae-images", type=int, default=AE_IMAGES, help="training images of the autoencoder")
    args = parser.parse_args()
    run(args.seconds, args.ae_images)
