"""The shard loader against the training step it feeds: examples/s at 0, 1 and 2 loader workers.

Fashion-MNIST's 60,000 training images are written as tar shards (`islands shard`'s code, 4096 per shard) and read
through `data.source: shards` by Islands' own `stream_loader` as a run reads them: by seek, in the stream's order,
each example's flip test, noise and uniforms drawn in the loader. The consumer is the U-Net of
configs/fashion_mnist.yaml at its batch of 128 in bf16 (fp32 where the CPU emulates bf16): a bare training step
(forward, backward, clip, AdamW), the fastest a step can be. The in-memory Fashion-MNIST source through the same
loader, and shards of float32 4x32x32 examples (the shape of SD-VAE latents of 256-pixel images, read as a
`latent.npy` member would be), sit beside it.

This machine's speed jumps between two levels every few seconds and other processes share its 2 cores: every
round times the step and then each loader, one after the other, and each ratio is taken within its round; the
tables give medians over rounds, and the share of the CPUs other processes took is saved with the figures.

    python -m benchmarks loader
"""

import tempfile
import time
from pathlib import Path

import torch
import yaml

from benchmarks.common import BareLoop, build_net, cpu_seconds, median, others_share, save, setup, table
from islands.data.loader import stream_loader
from islands.data.shards import ShardSource, write_manifest, write_part
from islands.data.sources import FASHION_MNIST_DIR, FashionMnist, _ArraySource
from islands.parallel.launch import bf16_is_native

CONFIG = Path(__file__).parent.parent / "configs" / "fashion_mnist.yaml"
BATCH = 128  # configs/fashion_mnist.yaml's
SHARD_SIZE = 4096
WORKERS = (0, 1, 2)
ROUNDS = 3
STEPS = 3  # timed steps per round, after one untimed
# Timed loader batches per round, after the workers' start and a full prefetch queue (prefetch_factor 4 per worker)
# are drawn: the queue refills while these are timed, so the rate is the loader's own, not the queue's.
BATCHES = 48
LATENTS = 4096
TARGET = 3.0  # the shard loader at 2 workers against the step's images/s
PRECISION = "bf16" if bf16_is_native("cpu") else "fp32"


def shards_of(source, folder: Path) -> ShardSource:
    folder.mkdir()
    write_manifest(folder, write_part(source, folder, SHARD_SIZE), source, SHARD_SIZE, {"benchmark": "loader"})
    return ShardSource(folder)


def step_rate(loop: BareLoop) -> float:
    loop.step()
    start = time.perf_counter()
    for _ in range(STEPS):
        loop.step()
    return STEPS * BATCH / (time.perf_counter() - start)


def loader_rate(source, workers: int, round_: int) -> float:
    loader = iter(stream_loader(source, BATCH, seed=round_, start=round_ * 100 * BATCH, workers=workers))
    for _ in range(2 + 4 * workers):
        next(loader)
    start = time.perf_counter()
    for _ in range(BATCHES):
        next(loader)
    rate = BATCHES * BATCH / (time.perf_counter() - start)
    del loader  # its workers end here, not during the next measurement
    return rate


def run() -> dict:
    setup()
    if not Path(FASHION_MNIST_DIR).is_dir():
        print(f"Fashion-MNIST absent from {FASHION_MNIST_DIR}: nothing to measure")
        return {"skipped": True}
    model = yaml.safe_load(CONFIG.read_text())["model"]
    loop = BareLoop(build_net(model), PRECISION, batch=BATCH)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        memory = FashionMnist()
        start = time.perf_counter()
        pixels = shards_of(memory, tmp / "fashion")
        written = time.perf_counter() - start
        # latents lie outside [-1, 1], which the npz source refuses for images: an in-memory source of them
        latents = shards_of(_ArraySource(torch.randn(LATENTS, 4, 32, 32, generator=torch.Generator().manual_seed(0)),
                                         None, 0), tmp / "latents")
        print(f"  wrote {len(pixels)} Fashion-MNIST examples in {len(pixels.tars)} shards in {written:.1f} s "
              f"({sum(t.stat().st_size for t in pixels.tars) / 2**20:.0f} MiB)", flush=True)
        sources = {"fashion shards (png)": pixels, "fashion in memory": memory, "latent shards (4x32x32 f32)": latents}
        rounds, since = [], cpu_seconds()
        for r in range(ROUNDS):
            measured = {"step": step_rate(loop)}
            for name, source in sources.items():
                for workers in WORKERS:
                    measured[f"{name}, {workers} workers"] = loader_rate(source, workers, r)
            rounds.append(measured)
            print(f"  round {r + 1}/{ROUNDS}: step {measured['step']:.0f} img/s, shards at 2 workers "
                  f"{measured['fashion shards (png), 2 workers']:.0f} ex/s", flush=True)
        others = others_share(since)
    step = median([m["step"] for m in rounds])
    rows = [[f"training step ({PRECISION}, batch {BATCH})", step, 1.0]]
    for name in sources:
        for workers in WORKERS:
            key = f"{name}, {workers} workers"
            rows.append([key, median([m[key] for m in rounds]), median([m[key] / m["step"] for m in rounds])])
    print(table(["consumer or loader", "examples/s (median)", "over the step (median of rounds)"], rows))
    ratio = median([m["fashion shards (png), 2 workers"] / m["step"] for m in rounds])
    met = ratio >= TARGET
    print(f"target the shard loader at 2 workers >= {TARGET}x the step: {'met' if met else 'NOT met'} ({ratio:.1f}x); "
          f"other processes took {others:.0%} of the CPUs")
    result = {"settings": {"model": model, "batch": BATCH, "precision": PRECISION, "shard_size": SHARD_SIZE,
                           "rounds": ROUNDS, "steps_per_round": STEPS, "batches_per_round": BATCHES,
                           "threads": torch.get_num_threads(), "latents": LATENTS},
              "write_seconds": written, "rounds": rounds, "table": rows, "ratio": ratio, "target": TARGET,
              "met": met, "others_cpu_share": others}
    save("loader", result)
    return result


if __name__ == "__main__":
    run()
