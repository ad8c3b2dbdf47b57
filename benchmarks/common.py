"""What the benchmarks share: the machine settings, the networks, a bare PyTorch training step, tables, JSON."""

import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from islands.conditions import network_spec
from islands.config import validate
from islands.data.sources import Mnist5k
from islands.ddm.pipeline import build_ensemble, monolith_images
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


BUSY = 0.10  # share of the CPUs other processes may take while we measure; above it, we measure again
WAIT_MAX = 600  # seconds to wait for a busy machine to go quiet before measuring anyway


def setup() -> None:
    torch.set_num_threads(THREADS)
    # Islands' train() turns flush-to-zero on for the process and leaves it on; the bare loop gets it too,
    # so that its speed does not depend on whether an Islands run came first.
    torch.set_flush_denormal(True)


def cpu_seconds() -> tuple[float, float, float]:
    """(CPU seconds used by every process, by this one and its children, wall-clock seconds)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    t = os.times()
    return busy, t.user + t.system + t.children_user + t.children_system, time.perf_counter()


def others_share(since: tuple[float, float, float]) -> float:
    """Share of the machine's CPU time that other processes used since `since` (a cpu_seconds())."""
    (b0, s0, w0), (b1, s1, w1) = since, cpu_seconds()
    return max(0.0, (b1 - b0 - (s1 - s0)) / ((w1 - w0) * os.cpu_count()))


def wait_until_quiet() -> None:
    start, said = time.perf_counter(), False
    while time.perf_counter() - start < WAIT_MAX:
        since = cpu_seconds()
        time.sleep(1.0)
        if others_share(since) <= BUSY:
            return
        if not said:
            print(f"  waiting for other processes to go quiet (at most {WAIT_MAX} s)", flush=True)
            said = True
    print("  the machine stayed busy; measuring anyway", flush=True)


def measure(label: str, fn, tries: int = 3):
    """fn() on a quiet machine -> (its result, the share of the CPUs others took while it ran).

    With 2 threads on 2 cores, one busy core elsewhere slows a step down tenfold or more, so a run that
    others disturbed is thrown away and done again (the last try is kept, with its share, if all were).
    """
    for _ in range(tries):
        wait_until_quiet()
        since = cpu_seconds()
        out = fn()
        others = others_share(since)
        if others <= BUSY:
            break
        print(f"  {label}: other processes took {others:.0%} of the CPUs meanwhile; measuring again", flush=True)
    return out, others


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
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(memory, 1), "threads": torch.get_num_threads(),
            "bf16_flags": [f for f in ("avx512_bf16", "amx_bf16") if f in flags.split()],
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "python": platform.python_version()}


def islands_config(run_dir, model: dict, precision: str, images: int, log_every: int):
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
                  "keep_checkpoints": 1, "threads": THREADS},
        "sample": {"num": 4, "steps": 1, "solver": "euler"},
    })


def window_rates(records: list[dict], skip: int = 1) -> list[float]:
    """Images/s of each log window of an Islands run, but the first `skip` (warm-up)."""
    assert len(records) > skip, "run too short: no log window after the warm-up"
    return [r["images_per_s"] for r in records[skip:]]


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
    return build_network(network_spec(validate({"run_dir": ".", "model": model}).model, (1, 28, 28), 10))


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

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"

    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] +
                     [line(r) for r in cells[1:]])


def cached(path: Path, key: str, evaluate):
    """evaluate(), kept in the JSON file `path` under `key` so that a rerun does not repeat it."""
    done = json.loads(path.read_text()) if path.exists() else {}
    if key not in done:
        done[key] = evaluate()
        path.write_text(json.dumps(done, indent=1))
    return done[key]


def save(name: str, result: dict, path: Path | None = None) -> Path:
    """Write benchmarks/results/<name>.json, or `path`, with the machine it ran on."""
    path = path or RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": name, "machine": machine(), **result}
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def ensembles_at_equal_flops(work: Path, ensembles: dict, monolith: dict) -> tuple[dict, Path]:
    """Build every ensemble (raw configs by name) with Islands' own pipeline, 2 experts at a time, then train the
    monolith (a raw config) on the training FLOPs of the costliest one, router included.
    -> ({name: Config}, the monolith's run directory)."""
    def written(raw: dict) -> Path:
        path = work / f"{Path(raw['run_dir']).name}.yaml"
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        return path

    built = {}
    for name, raw in ensembles.items():
        print(f"  {name}: partition, {raw['ddm']['k']} experts, router", flush=True)
        built[name] = validate(raw)
        build_ensemble(built[name], jobs=2, progress=False)
    images = max(monolith_images(cfg) for cfg in built.values())
    print(f"  monolith: {images} training images, the FLOPs of the costliest ensemble", flush=True)
    result = subprocess.run([sys.executable, "-m", "islands", "train", str(written(monolith)),
                             f"train.images={images}", "--quiet"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return built, Path(monolith["run_dir"])

