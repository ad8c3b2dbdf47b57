"""The GPU check: one command that says, on the first GPU it meets, whether Islands trains there and how fast.

In under 8 minutes on one GPU:
- the device's bf16 peak, measured: the best rate of square bf16 matmuls of 4096 to 16384, ten at a time between
  two device synchronisations;
- DiT-XL/2, Islands' own (`model: {arch: dit, preset: XL, patch_size: 2}`), trained on random 4x32x32 latents in
  bf16 autocast through Islands' real step (`build_parts`, then `optimizer_step`: the strategy's forward and
  backward of the diffusion objective, clipping, the finite check, AdamW), eager and with `train.compile`: images/s
  from synchronised timing after warm-up, and MFU = training FLOPs per image (islands.train.flops) x images/s over
  the peak;
- diffusers' `DiTTransformer2DModel` of the same size, trained side by side on the same inputs (Islands' own draw
  of x_t, t and labels), eager and with each block compiled as Islands compiles its own;
- with two GPUs or more: two ranks in one process group with a backend per device ("cpu:gloo,cuda:nccl"), an
  all-reduce of a CUDA tensor (NCCL) and of a CPU tensor (gloo), each checked against its known sum and timed, and
  Islands' `World` collectives on that group; then the Fashion U-Net trained by `islands train` on 2 ranks (DDP);
- 300 steps of the Fashion U-Net (configs/fashion_mnist.yaml) through `islands train`, end to end.

A batch that does not fit in the device's memory is halved until it does. A part that would run past the budget is
skipped and named in the results, and a part that fails is recorded with its error while the others go on.

`--dry` runs every part at tiny sizes (the 2-rank parts on the CPU with gloo where fewer than 2 GPUs are present,
compilation with the aot_eager backend: dynamo and AOTAutograd, without inductor's minute of code generation), in
under a minute on a CPU; the suite runs it (tests/test_gpu_check.py) so that the check cannot rot.

    python -m benchmarks gpu                       # on a GPU: benchmarks/results/gpu.json
    python -m benchmarks.gpu --dry [--out PATH]    # tiny sizes; PATH defaults to a file in the temporary folder
"""

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import RESULTS, median, save, table
from islands.config import validate
from islands.data.batch import Batch
from islands.parallel.launch import World, free_port
from islands.rundir import latest_checkpoint
from islands.train.flops import flops_per_image
from islands.train.logbook import read_metrics
from islands.trainer.loop import optimizer_step
from islands.trainer.parts import build_parts

FASHION = Path(__file__).resolve().parent.parent / "configs" / "fashion_mnist.yaml"
CLASSES = 1000  # ImageNet's, as DiT-XL/2 is trained


@dataclass(frozen=True)
class Sizes:
    dry: bool
    latent: int  # side of the 4-channel latents
    dit: dict  # Islands' model config
    batch: int  # tried first, halved while it does not fit
    warmup: int  # steps before timing (compilation happens in them)
    timed_s: float  # timing stops after this many seconds ...
    min_steps: int  # ... once this many steps are timed
    max_steps: int
    matmul_sizes: tuple
    matmul_reps: int
    nccl_bytes: int
    gloo_bytes: int
    collective_reps: int
    e2e: tuple  # overrides of configs/fashion_mnist.yaml for the end-to-end runs
    budget_s: float
    needs_s: dict  # seconds each part is expected to take: one that no longer fits the budget is skipped


FULL = Sizes(dry=False, latent=32, dit={"arch": "dit", "preset": "XL", "patch_size": 2}, batch=128, warmup=3,
             timed_s=20.0, min_steps=5, max_steps=60, matmul_sizes=(4096, 8192, 16384), matmul_reps=10,
             nccl_bytes=256 * 2**20, gloo_bytes=64 * 2**20, collective_reps=10,
             e2e=("train.images=38400", "train.log_every=3840", "train.checkpoint_every=38400", "train.precision=bf16"),
             budget_s=470.0, needs_s={"islands eager": 45, "diffusers eager": 45, "islands compiled": 90,
                                      "diffusers compiled": 90, "end to end, 1 rank": 60, "collectives": 30,
                                      "end to end, 2 ranks": 60})
DRY = Sizes(dry=True, latent=8, dit={"arch": "dit", "patch_size": 2, "hidden_size": 64, "depth": 2, "num_heads": 4},
            batch=4, warmup=1, timed_s=0.0, min_steps=2, max_steps=2, matmul_sizes=(256,), matmul_reps=2,
            nccl_bytes=2**20, gloo_bytes=2**20, collective_reps=2,
            e2e=("train.images=64", "train.batch_size=16", "train.log_every=16", "train.checkpoint_every=64",
                 "train.warmup_images=0", "train.ema_halflife_images=0", "train.precision=bf16", "train.threads=1",
                 "model.channels=8", "model.channel_mult=[1,2]", "model.num_res_blocks=1",
                 "model.attention_resolutions=[14]", "sample.num=4", "sample.steps=2", "eval.val_size=16"),
            budget_s=600.0, needs_s={})


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release() -> None:
    """Free what a finished part held on the device, compiled graphs included."""
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compile_backend(dry: bool):
    """In dry mode, torch.compile (as `Module.compile` calls it, for Islands' blocks and the peer's) with aot_eager."""
    if not dry:
        return contextlib.nullcontext()
    return mock.patch.object(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))


def matmul_peak(device: torch.device, sizes: Sizes) -> dict:
    """The best bf16 matmul rate of the device, over square sizes, each timed over `matmul_reps` products."""
    best = (0.0, 0)
    for n in sizes.matmul_sizes:
        a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
        for _ in range(3):  # warm-up: the kernel's choice, clocks up
            a @ b
        for _ in range(3):
            synchronize(device)
            start = time.perf_counter()
            for _ in range(sizes.matmul_reps):
                a @ b
            synchronize(device)
            best = max(best, (2 * n**3 * sizes.matmul_reps / (time.perf_counter() - start), n))
        del a, b
    return {"bf16_matmul_flop_per_s": best[0], "size": best[1]}


def throughput(step, batch: int, device: torch.device, sizes: Sizes) -> dict:
    """Images/s of `step()` (one optimizer step of `batch` images) after the warm-up steps, synchronised."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(sizes.warmup):
        step()
    synchronize(device)
    warm = time.perf_counter() - start
    steps, start = 0, time.perf_counter()
    while steps < sizes.max_steps and (steps < sizes.min_steps or time.perf_counter() - start < sizes.timed_s):
        step()
        steps += 1
    synchronize(device)
    seconds = time.perf_counter() - start
    figures = {"batch": batch, "warmup_seconds": warm, "steps": steps, "seconds": seconds,
               "images_per_s": steps * batch / seconds}
    if device.type == "cuda":
        figures["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return figures


def fitting(measure, batch: int):
    """measure(batch), the batch halved while it does not fit in the device's memory."""
    while True:
        try:
            return measure(batch)
        except torch.OutOfMemoryError:
            if batch == 1:
                raise
        print(f"    out of memory at batch {batch}; trying {batch // 2}", flush=True)
        batch //= 2
        release()


@dataclass
class Feed:
    """What both DiTs train on: Islands' inputs for a batch (x_t, t, labels after dropout) and its velocity target."""

    x: torch.Tensor
    t: torch.Tensor
    cond: torch.Tensor
    target: torch.Tensor

    def first(self, n: int) -> "Feed":
        return Feed(self.x[:n], self.t[:n], self.cond[:n], self.target[:n])


def latents(path: Path, sizes: Sizes) -> Path:
    """Random latents in [-1, 1] (what the npz source takes) with labels over all CLASSES."""
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, size=(sizes.batch, 4, sizes.latent, sizes.latent)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=sizes.batch)
    y[-1] = CLASSES - 1  # the source counts classes as the largest label + 1
    np.savez(path, x=x, y=y)
    return path


def islands_dit(sizes: Sizes, data: Path, run_dir: Path, batch: int, compiled: bool, device: torch.device):
    """Islands' DiT trained by its own step on `batch` latents. -> (figures, the inputs and size for the peer)."""
    cfg = validate({
        "run_dir": str(run_dir / f"{'compiled' if compiled else 'eager'}_{batch}"), "seed": 0,
        "data": {"source": "npz", "path": str(data), "flip": False},
        "model": {**sizes.dit, "num_classes": CLASSES},
        "flow": {"path": "rectified_flow", "prediction": "velocity", "time_sampler": "logit_normal"},
        "train": {"images": 10**9, "batch_size": batch, "lr": 1e-4, "precision": "bf16", "ema_halflife_images": 0,
                  "compile": compiled},
    })
    with compile_backend(sizes.dry):
        parts = build_parts(cfg, World(device=device))
    x0, labels = parts.source.get(list(range(batch)))
    micro_batches = [Batch(x0, labels, torch.arange(batch)).drawn(cfg.seed).to(device)]
    figures = throughput(lambda: optimizer_step(parts, micro_batches, cfg.train.lr), batch, device, sizes)
    regression = parts.objective.regression(micro_batches[0])
    (x, t, cond), target = regression.inputs, regression.target
    net = parts.net
    peer = dict(num_layers=len(net.blocks), num_attention_heads=net.blocks[0].attn.num_heads,
                attention_head_dim=net.pos_embed.shape[-1] // net.blocks[0].attn.num_heads, in_channels=net.in_channels,
                out_channels=2 * net.in_channels, sample_size=net.input_shape[1], patch_size=net.patch_size,
                num_embeds_ada_norm=CLASSES)
    figures["params"] = sum(p.numel() for p in net.parameters())
    figures["flops_per_image"] = flops_per_image(cfg.model, parts.shape, parts.num_classes, parts.objective, batch)
    return figures, (Feed(x, t, cond, target), peer)


class PeerStep:
    """A training step of diffusers' DiT as facebookresearch/DiT's train.py takes it: bf16 autocast, the velocity
    loss on the first 4 output channels (the others are its learned variance), backward, clip at 1 (Islands clips
    too), AdamW, the loss read back. It drops 10% of the labels itself in train mode, with torch's global RNG, on top
    of Islands' dropout in the feed: a few more embedding lookups of the "no label" row, the same work."""

    def __init__(self, net: torch.nn.Module, feed: Feed):
        self.net, self.feed = net.train(), feed
        self.params = list(net.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, weight_decay=0.0)

    def loss(self) -> torch.Tensor:
        f = self.feed
        with torch.autocast(f.x.device.type, dtype=torch.bfloat16):
            out = self.net(f.x, timestep=1000 * f.t, class_labels=f.cond).sample[:, :f.x.shape[1]]
        return (out.float() - f.target).square().mean()

    def __call__(self) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        return loss.item()

    def flops_per_image(self) -> float:
        """Forward and backward of one step, counted by torch's flop counter, as Islands' are."""
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            self.loss().backward()
        self.opt.zero_grad(set_to_none=True)
        return counter.get_total_flops() / len(self.feed.x)


def diffusers_dit(sizes: Sizes, peer: dict, feed: Feed, batch: int, compiled: bool, device: torch.device) -> dict:
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(0)
    net = DiTTransformer2DModel(**peer).to(device)
    if compiled:  # each block compiled, as Islands' train.compile does (diffusers' "regional compilation")
        with compile_backend(sizes.dry):
            for block in net.transformer_blocks:
                block.compile(dynamic=False)
    step = PeerStep(net, feed.first(batch))
    figures = throughput(step, batch, device, sizes)
    figures["params"] = sum(p.numel() for p in net.parameters())
    if not compiled:
        figures["flops_per_image"] = step.flops_per_image()
    return figures


def collective_rank(rank: int, port: int, out: str, cuda: bool, sizes: Sizes) -> None:
    """One of two ranks: a group with a backend per device, all-reduces checked against their sum, then timed."""
    torch.set_num_threads(1)
    if cuda:
        torch.cuda.set_device(rank)
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    try:
        kinds = {"gloo": (torch.device("cpu"), sizes.gloo_bytes)}
        if cuda:
            kinds["nccl"] = (torch.device("cuda", rank), sizes.nccl_bytes)
        figures = {}
        for name, (device, nbytes) in kinds.items():
            x = torch.full((nbytes // 4,), rank + 1.0, device=device)
            dist.all_reduce(x)  # also the warm-up
            correct = bool((x == 3.0).all())  # 1 + 2 on every element
            synchronize(device)
            start = time.perf_counter()
            for _ in range(sizes.collective_reps):
                dist.all_reduce(x)
            synchronize(device)
            seconds = (time.perf_counter() - start) / sizes.collective_reps
            # at 2 ranks an all-reduce's bus bandwidth (nccl-tests' busbw) equals its algorithm bandwidth
            figures[name] = {"device": str(device), "bytes": x.numel() * 4, "seconds": seconds,
                             "bus_gb_per_s": x.numel() * 4 / seconds / 1e9, "correct": correct}
        world = World(rank=rank, size=2, device=kinds["nccl" if cuda else "gloo"][0])
        figures["islands_world"] = {"all_finite": [world.all_finite(True), world.all_finite(rank == 0)],
                                    "mean": world.mean([float(rank)])}
        Path(out, f"rank{rank}.json").write_text(json.dumps(figures))
    finally:
        dist.destroy_process_group()


def collectives(sizes: Sizes, cuda: bool, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as out:
        ranks = mp.start_processes(collective_rank, args=(free_port(), out, cuda, sizes), nprocs=2, join=False,
                                   start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ranks.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ranks.processes:
                    p.kill()
                raise TimeoutError(f"the 2 ranks did not finish in {timeout:.0f} s")
        figures = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    kinds = [k for k in ("nccl", "gloo") if k in figures[0]]
    world = [f["islands_world"] for f in figures]
    return {"backend": "cpu:gloo,cuda:nccl" if cuda else "gloo",
            **{k: {**figures[0][k], "correct": all(f[k]["correct"] for f in figures)} for k in kinds},
            "islands_world_correct": world == [{"all_finite": [True, False], "mean": [0.5]}] * 2}


def end_to_end(sizes: Sizes, ranks: int, run_dir: Path, timeout: float) -> dict:
    """The Fashion U-Net trained by `islands train` in `ranks` processes (DDP for 2), as a user starts it."""
    argv = [sys.executable, "-m", "islands", "train", str(FASHION), f"run_dir={run_dir}", *sizes.e2e]
    env = dict(os.environ)
    if ranks > 1:
        argv.append("parallel.strategy=ddp")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(ranks))
        if torch.cuda.device_count() < ranks:  # two ranks on the CPU, with gloo
            env["CUDA_VISIBLE_DEVICES"] = ""
    if sizes.dry:
        env["OMP_NUM_THREADS"] = "1"
    start = time.perf_counter()
    procs = [subprocess.Popen([*argv, "--quiet"], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(ranks)]
    try:
        errors = [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    wall = time.perf_counter() - start
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    checkpoint = latest_checkpoint(run_dir)
    rates = [r["images_per_s"] for r in records[1:]]  # the first window holds the start-up
    return {"ranks": ranks, "exit": [p.returncode for p in procs], "wall_seconds": wall,
            "images": records[-1]["images"] if records else 0, "steps": records[-1]["step"] if records else 0,
            "images_per_s": median(rates) if rates else math.nan, "windows": len(records),
            "checkpoint": checkpoint.name if checkpoint else None,
            "stderr_tail": [e.strip().splitlines()[-3:] for e in errors if e.strip()]}


class Budget:
    """Runs each part of the check if the budget allows it; a part that fails is recorded and the others go on."""

    def __init__(self, budget_s: float, needs_s: dict):
        self.start, self.budget_s, self.needs_s = time.perf_counter(), budget_s, needs_s
        self.errors, self.skipped = {}, {}

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def __call__(self, name: str, fn):
        need = self.needs_s.get(name, 0)
        if self.left() < need:
            self.skipped[name] = f"{self.left():.0f} s left of the {self.budget_s:.0f} s budget, {need} s needed"
            print(f"  {name}: skipped ({self.skipped[name]})", flush=True)
            return None
        print(f"  {name} ...", flush=True)
        start = time.perf_counter()
        try:
            return fn()
        except Exception as err:  # the check goes on, and says which part failed and why
            self.errors[name] = f"{type(err).__name__}: {err}"[:2000]
            traceback.print_exc()
            print(f"  {name}: FAILED ({self.errors[name].splitlines()[0]})", flush=True)
            return None
        finally:
            release()
            print(f"    ({time.perf_counter() - start:.0f} s)", flush=True)


def devices() -> dict:
    if not torch.cuda.is_available():
        return {"gpus": []}
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return {"gpus": [{"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                      "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count} for p in props],
            "cuda": torch.version.cuda, "nccl": str(torch.cuda.nccl.version())}


def train_dits(sizes: Sizes, part: Budget, work: Path, device: torch.device) -> dict:
    """Islands' DiT and diffusers' side by side, eager then compiled, at the largest batch that fits both."""
    data = latents(work / "latents.npz", sizes)
    dit, feed, peer, batch = {}, None, None, sizes.batch
    for compiled in (False, True):
        mode = "compiled" if compiled else "eager"
        got = part(f"islands {mode}", lambda: fitting(
            lambda b: islands_dit(sizes, data, work / "dit", b, compiled, device), batch))
        if got is not None:
            dit[f"islands {mode}"], (feed, peer) = got
            batch = got[0]["batch"]
        if feed is not None:  # the peer trains on the inputs Islands drew
            dit[f"diffusers {mode}"] = part(f"diffusers {mode}", lambda: fitting(
                lambda b: diffusers_dit(sizes, peer, feed, b, compiled, device), batch))
    dit = {k: v for k, v in dit.items() if v is not None}
    for name in ("islands", "diffusers"):  # FLOPs are counted once, eager; compilation does not change them
        if f"{name} compiled" in dit and f"{name} eager" in dit:
            dit[f"{name} compiled"].setdefault("flops_per_image", dit[f"{name} eager"]["flops_per_image"])
    return dit


def check(sizes: Sizes, out: Path) -> dict:
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    gpus = torch.cuda.device_count()
    two_ranks = gpus >= 2 or sizes.dry  # dry: two CPU ranks where there are not two GPUs
    part = Budget(sizes.budget_s, sizes.needs_s)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        peak = part("bf16 matmul peak", lambda: matmul_peak(device, sizes))
        dit = train_dits(sizes, part, work, device)
        ends = {"1 rank": part("end to end, 1 rank", lambda: end_to_end(sizes, 1, work / "fashion1", part.left()))}
        comm = {"not run": f"{gpus} GPU(s)"}
        if two_ranks:
            comm = part("collectives", lambda: collectives(sizes, gpus >= 2, max(30.0, part.left())))
            ends["2 ranks"] = part("end to end, 2 ranks", lambda: end_to_end(sizes, 2, work / "fashion2", part.left()))
    seconds = time.perf_counter() - part.start

    if peak is not None:
        for f in (f for f in dit.values() if "flops_per_image" in f):
            f["mfu"] = f["flops_per_image"] * f["images_per_s"] / peak["bf16_matmul_flop_per_s"]
    ratios = {mode: dit[f"islands {mode}"]["images_per_s"] / dit[f"diffusers {mode}"]["images_per_s"]
              for mode in ("eager", "compiled") if f"islands {mode}" in dit and f"diffusers {mode}" in dit}
    sums = [v["correct"] for k, v in (comm or {}).items() if k in ("nccl", "gloo")]
    verdicts = {"every part ran": not part.errors and not part.skipped,
                "end-to-end runs exited 0 with a checkpoint": all(
                    e is not None and not any(e["exit"]) and e["checkpoint"] for e in ends.values()),
                "collectives correct": comm is not None and all(sums) and comm.get("islands_world_correct", True)}
    targets = {} if sizes.dry else {  # time and speed mean nothing at tiny sizes on a CPU
        "under 8 minutes": seconds < 480,
        "islands at least as fast as diffusers, compiled": ratios.get("compiled", 0.0) >= 1.0}
    result = {"dry": sizes.dry, "device": str(device), **devices(), "settings": asdict(sizes), "peak": peak,
              "dit": dit, "islands_over_diffusers": ratios, "collectives": comm,
              "end_to_end": {k: v for k, v in ends.items() if v is not None}, "errors": part.errors,
              "skipped": part.skipped, "total_seconds": seconds, "verdicts": verdicts, "targets": targets,
              "works": all(verdicts.values()), "met": all(verdicts.values()) and all(targets.values())}
    report(result)
    save("gpu", result, out)
    print(f"results: {out}")
    return result


def report(r: dict) -> None:
    if r["peak"]:
        print(f"bf16 matmul peak: {r['peak']['bf16_matmul_flop_per_s'] / 1e12:.1f} TFLOP/s (size {r['peak']['size']})")
    rows = [[name, f["batch"], f["params"] / 1e6, f.get("flops_per_image", math.nan) / 1e9, f["images_per_s"],
             f.get("mfu", math.nan), f["warmup_seconds"], f.get("peak_memory_gib", math.nan)]
            for name, f in r["dit"].items()]
    print(table(["DiT", "batch", "params M", "GFLOP/image", "images/s", "MFU", "warm-up s", "peak GiB"], rows))
    for mode, ratio in r["islands_over_diffusers"].items():
        print(f"Islands / diffusers images/s, {mode}: {ratio:.3f}")
    for kind in ("nccl", "gloo"):
        if kind in (r["collectives"] or {}):
            c = r["collectives"][kind]
            print(f"all-reduce {kind} ({c['bytes'] / 2**20:.0f} MiB): {c['bus_gb_per_s']:.2f} GB/s, "
                  f"{'correct' if c['correct'] else 'WRONG SUM'}")
    for name, e in r["end_to_end"].items():
        print(f"Fashion U-Net end to end, {name}: exit {e['exit']}, {e['steps']} steps, {e['images_per_s']:.0f} "
              f"images/s, {e['wall_seconds']:.0f} s, checkpoint {e['checkpoint']}")
    for name, verdict in {**r["verdicts"], **r["targets"]}.items():
        print(f"  {name}: {'yes' if verdict else 'NO'}")
    print(f"Islands {'works' if r['works'] else 'does NOT work'} here; targets {'met' if r['met'] else 'NOT met'}; "
          f"{r['total_seconds']:.0f} s")


def run() -> dict:
    """`python -m benchmarks gpu`: the full check where a GPU is; elsewhere one line, and nothing written."""
    if not torch.cuda.is_available():
        print(f"gpu: no CUDA device here (torch {torch.__version__}); nothing measured. "
              "`python -m benchmarks.gpu --dry` runs the check at tiny sizes on the CPU.")
        return {"met": False, "skipped": "no CUDA device"}
    return check(FULL, RESULTS / "gpu.json")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="tiny sizes, on the CPU if there is no GPU")
    parser.add_argument("--out", type=Path, default=None,
                        help="results file (default: benchmarks/results/gpu.json; with --dry, one in the temporary "
                             "folder, so that a dry run never replaces a GPU's figures)")
    args = parser.parse_args()
    if args.dry:
        result = check(DRY, args.out or Path(tempfile.gettempdir()) / "islands_gpu_dry.json")
    elif args.out:
        if not torch.cuda.is_available():
            parser.error("no CUDA device here; use --dry")
        result = check(FULL, args.out)
    else:
        result = run()
    sys.exit(0 if result.get("works") or result.get("skipped") else 1)  # a target missed is a figure, not a fault


if __name__ == "__main__":
    main()
