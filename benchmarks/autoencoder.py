"""Autoencoders on this CPU: training our own AutoencoderKL on Fashion-MNIST, and encode/decode throughput.

Training: configs/fashion_autoencoder.yaml (block_out_channels 32, 64, 64, one layer a block, 4x7x7 latents; L1 +
0.5 Sobel-gradient L1 + 1e-6 KL; AdamW 5e-4, batch 64, EMA) for IMAGES images through `islands train`; the time per
image is the median of metrics.jsonl's windows after the first (which holds the start-up), the reconstruction error
that of the exported averaged weights on the run's fixed probe of 256 training images (eval.jsonl: L1 and MSE on
[-1, 1], PSNR over the range 2), before training (the seed's initial weights) and after.

Throughput: images per second through `encode` (the posterior's mean and log-variance) and `decode`, in batches of
BATCH under no_grad, fp32, for the tiny AutoencoderKL above at 1x28x28 and an SD-VAE-shaped one (128, 256, 512, 512,
two layers a block, 32 groups, 4 latent channels: 83.7M parameters, SD's) at 3x32x32, random weights (speed does
not depend on them); the median of REPEATS batches after one warm-up batch.

    python -m benchmarks autoencoder
    python -m benchmarks.autoencoder --images 2048    # a shorter training run
"""

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from benchmarks.common import THREADS, cpu_seconds, median, others_share, save, setup, table
from islands.conditions import network_spec
from islands.config import load_config
from islands.data import build_data, streams
from islands.nets import build_network
from islands.nets.autoencoder import autoencoder_kl
from islands.train.logbook import read_metrics
from islands.trainer import train

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "runs" / "benchmarks" / "autoencoder"
IMAGES, BATCH, REPEATS = 8192, 32, 5
SHAPES = {  # name -> (block_out_channels, layers_per_block, image shape)
    "tiny (configs/fashion_autoencoder.yaml)": ((32, 64, 64), 1, (1, 28, 28)),
    "SD-VAE-shaped": ((128, 256, 512, 512), 2, (3, 32, 32)),
}


@torch.no_grad()
def throughput(widths: tuple, layers: int, shape: tuple) -> dict:
    torch.manual_seed(0)
    vae = autoencoder_kl(shape[0], widths, 4, layers, 32, True, shape[1]).eval()
    x = torch.rand(BATCH, *shape) * 2 - 1
    z = vae.encode(x).latent_dist.mean  # the warm-up batch of each
    vae.decode(z)
    times = {"encode": [], "decode": []}
    since = cpu_seconds()
    for _ in range(REPEATS):
        start = time.perf_counter()
        vae.encode(x)
        times["encode"].append(time.perf_counter() - start)
        start = time.perf_counter()
        vae.decode(z)
        times["decode"].append(time.perf_counter() - start)
    rates = {f"{k}_images_per_s": BATCH / median(v) for k, v in times.items()}
    return {"parameters": sum(p.numel() for p in vae.parameters()), "latent_shape": list(z.shape[1:]), **rates,
            "others_cpu_share": others_share(since)}


def training(images: int) -> dict:
    shutil.rmtree(RUN, ignore_errors=True)
    cfg = load_config(ROOT / "configs" / "fashion_autoencoder.yaml",
                      [f"run_dir={RUN}", f"train.images={images}", f"train.checkpoint_every={images}",
                       f"train.log_every={max(images // 8, 64)}", f"train.threads={THREADS}"])
    since = cpu_seconds()
    start = time.perf_counter()
    train(cfg, progress=False)
    seconds = time.perf_counter() - start
    windows = read_metrics(RUN)
    rates = [w["images_per_s"] for w in windows[1:]] or [windows[-1]["images_per_s"]]
    after = json.loads((RUN / "autoencoder" / "reconstruction.json").read_text())
    return {"images": images, "seconds": seconds, "ms_per_image": 1000 / median(rates),
            "loss_first_window": windows[0]["loss"], "loss_last_window": windows[-1]["loss"],
            "before": untrained_error(cfg), "after": after, "others_cpu_share": others_share(since)}


@torch.no_grad()
def untrained_error(cfg) -> dict:
    """The reconstruction error of the run's initial weights (seeded as the trainer seeds them) on its probe."""
    torch.manual_seed(cfg.seed)
    source = build_data(cfg.data, cfg.seed)
    net = build_network(network_spec(cfg.model, tuple(source.shape), 0)).eval()
    order = torch.randperm(len(source), generator=streams.generator(cfg.seed, 0, "validation"))  # fixed_probe's
    x = source.get(order[:256].tolist())[0]
    error = net.vae.decode(net.vae.encode(x).latent_dist.mean).sample.clamp(-1, 1) - x
    mse = error.square().mean().item()
    return {"reconstruction_l1": error.abs().mean().item(), "reconstruction_mse": mse,
            "psnr_db": 10 * torch.log10(torch.tensor(4.0 / mse)).item()}


def run(images: int = IMAGES) -> dict:
    setup()
    speeds = {name: throughput(*spec) for name, spec in SHAPES.items()}
    rows = [[name, f"{s['parameters'] / 1e6:.2f}M", "x".join(map(str, spec[2])), "x".join(map(str, s["latent_shape"])),
             s["encode_images_per_s"], s["decode_images_per_s"]] for (name, spec), s in zip(SHAPES.items(),
                                                                                          speeds.values(), strict=True)]
    print(table(["autoencoder", "parameters", "image", "latent", "encode img/s", "decode img/s"], rows))
    trained = training(images)
    errors = (("initial weights", 0, trained["before"]), ("trained", images, trained["after"]))
    print(table(["", "reconstruction L1", "MSE", "PSNR (dB)"],
                [[f"{label} ({n} images)", r["reconstruction_l1"], r["reconstruction_mse"], r["psnr_db"]]
                 for label, n, r in errors]))
    print(f"training: {trained['ms_per_image']:.2f} ms per image (batch 64, {THREADS} threads), "
          f"loss {trained['loss_first_window']:.4f} -> {trained['loss_last_window']:.4f}, {trained['seconds']:.0f} s")
    result = {"settings": {"batch": BATCH, "repeats": REPEATS, "threads": THREADS, "shapes": SHAPES,
                           "config": "configs/fashion_autoencoder.yaml"},
              "throughput": speeds, "training": trained, "table": rows,
              "met": trained["after"]["reconstruction_l1"] < trained["before"]["reconstruction_l1"]}
    save("autoencoder", result)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=IMAGES)
    run(parser.parse_args().images)
