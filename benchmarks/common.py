"""What the benchmarks share: the machine settings, the networks, a bare PyTorch training step, tables, JSON."""

import contextlib
import json
import platform
import time
from pathlib import Path

import torch

from islands.config import ModelConfig, validate
from islands.data.sources import Mnist5k
from islands.nets import build_network

THREADS = 2  # the machine the figures in docs/BENCHMARKS.md come from has 2 cores
RESULTS = Path(__file__).parent / "results"
FIGURES = Path(__file__).parent.parent / "docs" / "figures"
BATCH = 64
LR = 1e-3  # the demo's (configs/mnist5k.yaml), without its warm-up: these runs are shorter than it
SEED = 0

# A small class-conditional ADM U-Net for 1x28x28 digits: 28 -> 14 -> 7, attention at 7x7.
UNET = dict(arch="unet", num_classes=10, channels=32, channel_mult=[1, 2, 2], num_res_blocks=1,
            attention_resolutions=[7])
# A small DiT: patch 2 on 28x28 gives 196 tokens; DiT-S width halved, half its depth.
DIT = dict(arch="dit", num_classes=10, patch_size=2, hidden_size=192, depth=6, num_heads=3)


_BUSY = None


def other_load(seconds: float = 1.0) -> float:
    """Share of all CPU time used during `seconds` while this process sleeps: what others take from us."""
    def ticks():
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait
    try:
        total0, idle0 = ticks()
        time.sleep(seconds)
        total1, idle1 = ticks()
    except OSError:
        return float("nan")
    return 1 - (idle1 - idle0) / max(total1 - total0, 1)


def setup() -> None:
    """Pin the threads, and warn when something else is running: 2 busy threads on 2 shared cores crawl."""
    global _BUSY
    torch.set_num_threads(THREADS)
    # Islands' train() turns flush-to-zero on for the process and leaves it on; the bare loop gets it too,
    # so that its speed does not depend on whether an Islands run came first.
    torch.set_flush_denormal(True)
    _BUSY = other_load()
    if _BUSY > 0.1:
        print(f"WARNING: other processes use {_BUSY:.0%} of the CPUs; these figures will be unreliable")


def machine() -> dict:
    cpu = "unknown"
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown":
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line
    except OSError:
        pass
    return {"cpu": cpu, "threads": torch.get_num_threads(), "avx512_bf16": "avx512_bf16" in flags,
            "torch": torch.__version__, "python": platform.python_version(), "other_load_at_start": _BUSY}


def islands_config(run_dir, model: dict, precision: str, images: int, log_every: int, **train):
    """An Islands run matching the bare loop: uniform t, rectified flow, velocity, AdamW, clip 1, no EMA.

    Checkpoints and the sample grid come only at the very end, after the last log window closes, and
    the grid is one cheap Euler step: they cost suite time, not measured throughput.
    """
    return validate({
        "run_dir": str(run_dir), "seed": SEED,
        "data": {"source": "mnist5k"},
        "model": model,
        "flow": {"path": "rectified_flow", "prediction": "velocity", "time_sampler": "uniform"},
        "train": {"images": images, "batch_size": BATCH, "lr": LR, "grad_clip": 1.0, "precision": precision,
                  "ema_halflife_images": 0, "log_every": log_every, "checkpoint_every": 10 * images,
                  "keep_checkpoints": 1, "threads": THREADS, **train},
        "sample": {"num": 4, "steps": 1, "solver": "euler"},
    })


def windows_throughput(records: list[dict], skip: int = 1) -> float:
    """Images/s over the log windows after the first `skip` (warm-up): their images over their seconds."""
    starts = [0] + [r["images"] for r in records[:-1]]
    later = list(zip(starts, records))[skip:]
    assert later, "run too short: no log window after the warm-up"
    images = sum(r["images"] - s for s, r in later)
    seconds = sum((r["images"] - s) / r["images_per_s"] for s, r in later)
    return images / seconds


_MNIST = None


def mnist() -> tuple[torch.Tensor, torch.Tensor]:
    """The 5000 MNIST digits as float32 in [-1, 1] and their labels, loaded once."""
    global _MNIST
    if _MNIST is None:
        source = Mnist5k()
        _MNIST = source.get(list(range(len(source))))
    return _MNIST


def build_net(model: dict) -> torch.nn.Module:
    torch.manual_seed(SEED)  # the same initial weights as an Islands run with this seed
    return build_network(ModelConfig(**model), (1, 28, 28), 10)


def autocast(precision: str):
    assert precision in ("bf16", "fp32")
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


class BareLoop:
    """The minimal honest PyTorch equivalent of one Islands step.

    Random batch from an in-memory tensor, the same 10% label dropout for guidance, torch.randn noise,
    uniform t, rectified-flow velocity loss, backward, clip at 1, AdamW step; nothing else.
    """

    def __init__(self, net: torch.nn.Module, precision: str = "bf16", batch: int = BATCH):
        self.x, self.y = mnist()
        self.net, self.batch = net.train(), batch
        self.params = [p for p in net.parameters() if p.requires_grad]
        # Islands' defaults: betas (0.9, 0.999) and no weight decay (torch's AdamW would use 0.01)
        self.opt = torch.optim.AdamW(self.params, lr=LR, betas=(0.9, 0.999), weight_decay=0.0)
        self.precision = precision

    def loss(self) -> torch.Tensor:
        B = self.batch
        idx = torch.randint(len(self.x), (B,))
        x0, y = self.x[idx], self.y[idx]
        y = torch.where(torch.rand(B) < 0.1, 10, y)  # index 10 is "no label"
        noise = torch.randn_like(x0)
        t = torch.rand(B)
        tt = t.view(-1, 1, 1, 1)
        xt = (1 - tt) * x0 + tt * noise
        with autocast(self.precision):
            out = self.net(xt, t, y)
        return (out.float() - (noise - x0)).square().mean()

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.loss().backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()

    def images_per_s(self, warmup: int, steps: int) -> float:
        for _ in range(warmup):
            self.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        return steps * self.batch / (time.perf_counter() - t0)


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table that also reads well in a terminal."""
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
        return str(v)
    cells = [headers] + [[fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] +
                     [line(r) for r in cells[1:]])


def save(name: str, result: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    result = {"benchmark": name, "machine": machine(), **result}
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
