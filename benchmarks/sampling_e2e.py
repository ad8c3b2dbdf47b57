"""`islands sample` end to end against the diffusers loop a user would write, whole processes, alternated.

Islands: a run of configs/fashion_mnist.yaml (the U-Net 48-96-96, two blocks a level, attention at 7x7), trained
briefly in bf16 (speed does not depend on what it learned) into runs/sampling_e2e/run and reused when there, sampled
the way a user does it:

    python -m islands sample RUN --num 1000 --steps 16 --solver unipc --out OUT

diffusers: `UNet2DModel` of the same width (block_out_channels (48, 96, 96), layers_per_block 2, attention at the 7x7
level, ADM's scale-shift conditioning, 11 class embeddings: 10 classes and the "no label" one that guidance needs),
random weights saved with `save_pretrained` and loaded with `from_pretrained`, and the loop of its documentation:
`DPMSolverMultistepScheduler` with 16 steps, batches of 256, classifier-free guidance as diffusers' pipelines do it
(the conditional and unconditional halves in one call of twice the batch), samples clamped and written to an .npz.
Both sides: the same number of samples, network evaluations per sample and batch size, the precision Islands'
default picks for the run (bf16 autocast where the CPU computes bf16 natively), the same thread count. Once with
the run's guidance (1.5, 32 evaluations per sample) and once without (16).

First one instrumented run of each says where its time goes: start-up (interpreter and imports), loading, the
network, the solver's (scheduler's) own work, the noise draw, writing (Islands: samples.npz and grid.png); it also
warms the page and bytecode caches. Then the two plain commands alternate, ROUNDS pairs, Islands first in each; a
pair's ratio is Islands' wall-clock seconds over diffusers', and we report the median ratio and the median seconds,
and beside them the median ratio of the processes' CPU seconds, which other processes on a shared machine disturb
less. Target (issue 27): `islands sample` within 1.1x of the diffusers loop. About 40 minutes on 2 quiet cores.

    python -m benchmarks sampling_e2e
    python -m benchmarks.sampling_e2e --rounds 3 --num 256    # fewer pairs, one batch per process
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import THREADS, cpu_seconds, median, others_share, save, table
from islands.config import load_config
from islands.generate import resolve_precision
from islands.rundir import latest_checkpoint, load_weights, weights_file

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "runs" / "sampling_e2e"
RUN = WORK / "run"
TRAIN_IMAGES = 512  # four steps: enough for a checkpoint, speed does not depend on the weights
NUM, STEPS, BATCH, SOLVER = 1000, 16, 256, "unipc"
ROUNDS, TARGET = 5, 1.1
CLASSES = 10

DIFFUSERS_LOOP = '''\
"""The diffusers loop: UNet2DModel + DPMSolverMultistepScheduler, batches of BATCH, guidance in one call of 2B."""
import json
import sys
import time

start = time.perf_counter()
from pathlib import Path

import numpy as np
import torch
from diffusers import DPMSolverMultistepScheduler, UNet2DModel

model_dir, out, num, steps, batch, guidance, precision, seed = sys.argv[1:9]
num, steps, batch, guidance, seed = int(num), int(steps), int(batch), float(guidance), int(seed)
clock = {"imports": time.perf_counter() - start, "network": 0.0, "noise": 0.0}
t0 = time.perf_counter()
model = UNet2DModel.from_pretrained(model_dir).eval()
scheduler = DPMSolverMultistepScheduler()
clock["load"] = time.perf_counter() - t0
autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
generator = torch.Generator().manual_seed(seed)
null = model.config.num_class_embeds - 1
samples, labels = [], torch.arange(num) % (model.config.num_class_embeds - 1)
t0 = time.perf_counter()
with torch.no_grad():
    for lo in range(0, num, batch):
        y = labels[lo:lo + batch]
        t1 = time.perf_counter()
        x = torch.randn((len(y), 1, 28, 28), generator=generator)
        clock["noise"] += time.perf_counter() - t1
        scheduler.set_timesteps(steps)
        classes = torch.cat([y, torch.full_like(y, null)]) if guidance != 1 else y
        for t in scheduler.timesteps:
            t1 = time.perf_counter()
            with autocast:
                eps = model(torch.cat([x, x]) if guidance != 1 else x, t, class_labels=classes).sample.float()
            clock["network"] += time.perf_counter() - t1
            if guidance != 1:
                cond, uncond = eps.chunk(2)
                eps = uncond + guidance * (cond - uncond)
            x = scheduler.step(eps, t, x).prev_sample
        samples.append(x.clamp(-1, 1))
clock["sampling"] = time.perf_counter() - t0
t0 = time.perf_counter()
Path(out).mkdir(parents=True, exist_ok=True)
np.savez(Path(out) / "samples.npz", x=torch.cat(samples).numpy(), y=labels.numpy())
clock["write"] = time.perf_counter() - t0
clock["total"] = time.perf_counter() - start
print("CLOCK " + json.dumps(clock))
'''

# `islands sample` with timers around its parts (the timed rounds run the plain command, not this).
ISLANDS_INSTRUMENTED = '''\
import json
import sys
import time

start = time.perf_counter()
import islands.cli
import islands.generate as generate
from islands.data import streams
from islands.flow.denoiser import NetworkDenoiser

clock = {"imports": time.perf_counter() - start, "network": 0.0, "noise": 0.0}


def timed(owner, name, key):
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        clock[key] = clock.get(key, 0.0) + time.perf_counter() - t0
        return out

    setattr(owner, name, wrapper)


timed(generate, "load_denoiser", "load")
timed(generate, "generate", "sampling")
timed(generate, "write_samples", "write")
timed(streams, "normal", "noise")
timed(NetworkDenoiser, "_net", "network")
code = islands.cli.main(sys.argv[1:])
clock["total"] = time.perf_counter() - start
print("CLOCK " + json.dumps(clock))
sys.exit(code)
'''


def prepare() -> tuple[Path, str, dict]:
    """The Islands run (trained once), the diffusers network beside it, the loop's script, and the precision
    Islands' default picks for the run. -> (the diffusers model folder, the precision, parameter counts)."""
    if latest_checkpoint(RUN) is None:
        print(f"  training {RUN} ({TRAIN_IMAGES} images of configs/fashion_mnist.yaml)", flush=True)
        subprocess.run([sys.executable, "-m", "islands", "train", str(ROOT / "configs" / "fashion_mnist.yaml"),
                        f"run_dir={RUN}", f"train.images={TRAIN_IMAGES}", "--quiet"], check=True, env=_env())
    cfg = load_config(RUN / "config.yaml")
    precision = resolve_precision(cfg.sample.precision, cfg.train.precision, "cpu")
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    m = cfg.model
    peer = UNet2DModel(sample_size=28, in_channels=1, out_channels=1, layers_per_block=m.num_res_blocks,
                       block_out_channels=tuple(m.channels * c for c in m.channel_mult),
                       down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D", "UpBlock2D"), num_class_embeds=CLASSES + 1,
                       norm_num_groups=24, attention_head_dim=m.channels * m.channel_mult[-1] // (m.num_heads or 4),
                       resnet_time_scale_shift="scale_shift")
    peer_dir = WORK / "diffusers_unet"
    peer.save_pretrained(peer_dir)
    (WORK / "diffusers_loop.py").write_text(DIFFUSERS_LOOP)
    (WORK / "islands_instrumented.py").write_text(ISLANDS_INSTRUMENTED)
    ours = sum(w.numel() for w in load_weights(weights_file(latest_checkpoint(RUN), True)).values())
    return peer_dir, precision, {"islands": ours, "diffusers": sum(p.numel() for p in peer.parameters())}


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(THREADS), "PYTHONPATH": str(ROOT)}


def commands(peer_dir: Path, precision: str, guidance: float, num: int, instrumented: bool = False) -> dict:
    out = WORK / "out"
    islands = ["-m", "islands"] if not instrumented else [str(WORK / "islands_instrumented.py")]
    return {
        "islands": [sys.executable, *islands, "sample", str(RUN), "--num", str(num), "--steps", str(STEPS),
                    "--solver", SOLVER, "--guidance", str(guidance), "--batch-size", str(BATCH),
                    "--out", str(out / "islands"), "--quiet"],
        "diffusers": [sys.executable, str(WORK / "diffusers_loop.py"), str(peer_dir), str(out / "diffusers"),
                      str(num), str(STEPS), str(BATCH), str(guidance), precision, "0"],
    }


def timed_process(command: list[str]) -> dict:
    """One whole process: its wall-clock and CPU seconds, the share of the CPUs others took meanwhile, its CLOCK."""
    since, cpu, start = cpu_seconds(), resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=_env())
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    assert result.returncode == 0, result.stderr[-3000:]
    clock = next((json.loads(line[6:]) for line in result.stdout.splitlines() if line.startswith("CLOCK ")), {})
    return {"wall": wall, "cpu": after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime,
            "others": others_share(since), "clock": clock}


PARTS = ("start-up", "loading", "network", "noise", "solver", "writing", "other")


def breakdown(wall: float, clock: dict) -> dict:
    """Where one process's wall-clock seconds went: start-up is the interpreter and the imports, solver the
    sampling loop's own work (the scheduler's, for diffusers), other the rest (argument parsing, labels, exit)."""
    parts = {"start-up": wall - clock["total"] + clock["imports"], "loading": clock["load"],
             "network": clock["network"], "noise": clock["noise"],
             "solver": clock["sampling"] - clock["network"] - clock["noise"], "writing": clock["write"]}
    parts["other"] = wall - sum(parts.values())
    return {k: round(parts[k], 3) for k in PARTS}


def compare(peer_dir: Path, precision: str, guidance: float, rounds: int, num: int) -> dict:
    """One instrumented run of each side (which also warms the page and bytecode caches), then `rounds` pairs."""
    parts = {}
    for name, cmd in commands(peer_dir, precision, guidance, num, instrumented=True).items():
        run = timed_process(cmd)
        parts[name] = {"wall": round(run["wall"], 2), **breakdown(run["wall"], run["clock"])}
        print(f"  guidance {guidance}, {name}, instrumented: {parts[name]}", flush=True)
    runs = {"islands": [], "diffusers": []}
    for r in range(rounds):
        for name, cmd in commands(peer_dir, precision, guidance, num).items():
            runs[name].append(timed_process(cmd))
        print(f"  guidance {guidance}, pair {r + 1}: islands {runs['islands'][-1]['wall']:.1f} s, "
              f"diffusers {runs['diffusers'][-1]['wall']:.1f} s", flush=True)
    seconds = {name: [x["wall"] for x in xs] for name, xs in runs.items()}
    cpu = {name: [x["cpu"] for x in xs] for name, xs in runs.items()}
    ratios = [a / b for a, b in zip(seconds["islands"], seconds["diffusers"], strict=True)]
    cpu_ratios = [a / b for a, b in zip(cpu["islands"], cpu["diffusers"], strict=True)]
    return {"guidance": guidance, "evaluations_per_sample": STEPS * (1 if guidance == 1 else 2),
            "seconds": seconds, "median_seconds": {k: median(v) for k, v in seconds.items()}, "ratios": ratios,
            "median_ratio": median(ratios), "cpu_seconds": cpu, "median_cpu_ratio": median(cpu_ratios),
            "breakdown": parts, "others_cpu_share": [x["others"] for xs in runs.values() for x in xs]}


def run(rounds: int = ROUNDS, num: int = NUM) -> dict:
    WORK.mkdir(parents=True, exist_ok=True)
    peer_dir, precision, params = prepare()
    print(f"  parameters: Islands {params['islands'] / 1e6:.2f} M, diffusers {params['diffusers'] / 1e6:.2f} M; "
          f"precision {precision}; {THREADS} threads", flush=True)
    guidance = load_config(RUN / "config.yaml").sample.guidance
    results = [compare(peer_dir, precision, g, rounds, num) for g in (guidance, 1.0)]
    rows = [[r["guidance"], r["evaluations_per_sample"], r["median_seconds"]["islands"],
             r["median_seconds"]["diffusers"], r["median_ratio"], r["median_cpu_ratio"],
             max(r["others_cpu_share"])] for r in results]
    print(table(["guidance", "evaluations/sample", "islands s", "diffusers s", "islands / diffusers",
                 "same in CPU seconds", "others' CPU share, most"], rows))
    parts = [[r["guidance"], name, *r["breakdown"][name].values()] for r in results for name in r["breakdown"]]
    print(table(["guidance", "process", "wall s", *(f"{p} s" for p in PARTS)], parts))
    met = all(r["median_ratio"] <= TARGET for r in results)
    print(f"target islands sample within {TARGET}x of the diffusers loop: {'met' if met else 'NOT met'}")
    result = {"settings": {"num": num, "steps": STEPS, "solver": SOLVER, "batch": BATCH, "precision": precision,
                           "threads": THREADS, "rounds": rounds, "train_images": TRAIN_IMAGES,
                           "commands": {k: " ".join(v) for k, v in commands(peer_dir, precision, guidance,
                                                                             num).items()}},
              "parameters": params, "comparisons": results, "target": f"islands / diffusers <= {TARGET}", "met": met}
    save("sampling_e2e", result)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sampling_e2e", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="alternated pairs per setting")
    parser.add_argument("--num", type=int, default=NUM, help="samples per process")
    args = parser.parse_args()
    run(args.rounds, args.num)
