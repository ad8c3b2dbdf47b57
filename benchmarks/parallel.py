"""Parallel strategies at 2 ranks on a DiT-S: per-rank memory, and step time against 1 process.

1. Memory. Under torchrun (2 ranks, gloo), each strategy wraps a DiT-S/2 for 32x32x4 latents with 1000
   classes (33M parameters, fp32) exactly as the trainer does, takes two AdamW steps, and each rank
   counts the bytes it holds: its parameters (the local shard of a DTensor), its gradients and its
   optimizer state (its own ZeRO partition). Target: fsdp at most 0.55 of ddp. The peak resident set of
   each rank is reported beside it; it also holds torch itself, DDP's gradient buckets and activations.
2. Step time. `islands train` itself on 2 ranks (one thread each) with each strategy, against one
   process with 2 threads, on the same 2 cores: a DiT-S/4 (64 tokens, to keep steps to seconds) on
   random latents, global batch 16, fp32. Images/s is the fastest log window after the first (this VM's
   speed jumps only ever slow a window down); bytes per step come from the run's communication ledger.

    python -m benchmarks parallel
"""

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from benchmarks.common import measure, save, table
from islands.conditions import network_spec
from islands.parallel.launch import free_port

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
MEMORY_MODEL = {"arch": "dit", "preset": "S", "patch_size": 2, "num_classes": 1000}
SPEED_MODEL = {"arch": "dit", "preset": "S", "patch_size": 4, "num_classes": 10}
SHAPE = (4, 32, 32)
BATCH = 16
TARGET = 0.55  # fsdp's state bytes per rank at most this share of ddp's
MIB = 2**20
TIMEOUT_S = 600


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", *args]


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors if t is not None]
    return sum(t.numel() * t.element_size() for t in local)


def memory_worker(strategy_name: str, out: str) -> None:
    """One rank: the trainer's own wrapping and optimizer, two steps, then count what this rank holds."""
    from islands.config import validate
    from islands.flow.objectives import training_loss
    from islands.flow.paths import build_path
    from islands.nets import build_network
    from islands.parallel.build import build_strategy
    from islands.parallel.launch import close_world, init_world

    world = init_world(TIMEOUT_S)
    strategy = build_strategy(validate({"run_dir": ".", "parallel": {"strategy": strategy_name}}), world)
    torch.manual_seed(0)
    net = build_network(network_spec(validate({"run_dir": ".", "model": MEMORY_MODEL}).model, SHAPE, 1000))
    model = strategy.wrap(net)
    opt = strategy.optimizer(net, lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0)
    path = build_path("rectified_flow")
    per_rank = 4
    for step in range(2):
        g = torch.Generator().manual_seed(world.rank * 100 + step)
        x0 = torch.randn(per_rank, *SHAPE, generator=g)
        noise, t = torch.randn(x0.shape, generator=g), torch.rand(per_rank, generator=g)
        labels = torch.randint(0, 1000, (per_rank,), generator=g)
        opt.zero_grad(set_to_none=True)
        training_loss(model, path, "velocity", x0, noise, t, labels).mean().backward()
        strategy.clip_grad_norm(list(net.parameters()), 1.0)
        opt.step()
    local = strategy.local_optimizer(opt)
    held = {"params": _local_bytes(net.parameters()),
            "grads": _local_bytes(p.grad for p in net.parameters()),
            "optimizer": _local_bytes(v for s in local.state.values() for v in s.values()),
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "num_params": sum(p.numel() for p in net.parameters())}
    Path(f"{out}.{world.rank}.json").write_text(json.dumps(held))
    close_world()


def measure_memory(work: Path) -> dict:
    found = {}
    for name in STRATEGIES:
        out = work / f"memory-{name}"
        cmd = _torchrun("-m", "benchmarks.parallel", "memory-worker", name, str(out))
        result = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                                timeout=TIMEOUT_S)
        assert result.returncode == 0, result.stderr[-3000:]
        ranks = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]
        found[name] = {k: max(r[k] for r in ranks) for k in ranks[0]}  # the fuller rank
        print(f"  {name}: {sum(found[name][k] for k in ('params', 'grads', 'optimizer')) / MIB:.0f} MiB of state "
              "per rank", flush=True)
    return found


def _speed_config(work: Path, name: str, strategy: str, threads: int) -> Path:
    data = work / "latents.npz"
    if not data.exists():
        rng = np.random.default_rng(0)
        np.savez(data, x=rng.uniform(-1, 1, (512, *SHAPE)).astype(np.float32), y=rng.integers(0, 10, 512))
    cfg = {"run_dir": str(work / name), "seed": 0,
           "data": {"source": "npz", "path": str(data), "flip": False},
           "model": SPEED_MODEL,
           "train": {"images": 14 * BATCH, "batch_size": BATCH, "lr": 1e-4, "precision": "fp32",
                     "ema_halflife_images": 0, "log_every": 2 * BATCH, "checkpoint_every": 10**9,
                     "keep_checkpoints": 1, "threads": threads},
           "sample": {"num": 4, "steps": 1, "solver": "euler"},
           "parallel": {"strategy": strategy}}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def measure_speed(work: Path) -> dict:
    found = {}
    for name in ("single", *STRATEGIES):
        if name == "single":
            config = _speed_config(work, name, "none", threads=2)
            cmd = [sys.executable, "-m", "islands", "train", str(config), "--quiet"]
        else:
            config = _speed_config(work, name, name, threads=1)
            cmd = _torchrun("-m", "islands", "train", str(config), "--quiet")
        def train_once(cmd=cmd, name=name):
            shutil.rmtree(work / name, ignore_errors=True)  # a run measured again starts afresh
            result = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                                    timeout=TIMEOUT_S)
            assert result.returncode == 0, result.stderr[-3000:]

        start = time.perf_counter()
        _, others = measure(name, train_once)
        records = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
        rate = max(r["images_per_s"] for r in records[1:])
        comm = work / name / "communication.json"
        by_collective = json.loads(comm.read_text())["bytes_per_step"] if comm.exists() else {}
        found[name] = {"images_per_s": rate, "step_s": BATCH / rate, "bytes_per_step": by_collective,
                       "wall_s": time.perf_counter() - start, "others_cpu_share": others}
        print(f"  {name}: {rate:.2f} img/s", flush=True)
    return found


def run() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print("per-rank memory, DiT-S/2, 2 ranks:", flush=True)
        memory = measure_memory(work)
        print("step time, DiT-S/4, global batch 16:", flush=True)
        speed = measure_speed(work)

    state = {k: sum(v[p] for p in ("params", "grads", "optimizer")) for k, v in memory.items()}
    rows = [[k, v["num_params"] / 1e6, v["params"] / MIB, v["grads"] / MIB, v["optimizer"] / MIB, state[k] / MIB,
             state[k] / state["ddp"], v["peak_rss"] / MIB] for k, v in memory.items()]
    print(table(["strategy", "params (M)", "weights MiB", "grads MiB", "optimizer MiB", "state MiB",
                 "vs ddp", "peak RSS MiB"], rows))
    single = speed["single"]["step_s"]
    rows = [[k, v["step_s"], v["step_s"] / single, sum(v["bytes_per_step"].values()) / MIB,
             ", ".join(f"{c} {b / MIB:.1f}" for c, b in sorted(v["bytes_per_step"].items())) or "-"]
            for k, v in speed.items()]
    print(table(["run", "s / step", "vs 1 process", "MiB sent / step / rank", "by collective (MiB)"], rows))
    ratio = state["fsdp"] / state["ddp"]
    met = ratio <= TARGET
    print(f"fsdp holds {ratio:.3f} of ddp's state per rank (target <= {TARGET}): {'met' if met else 'NOT met'}")
    save("parallel", {"memory": memory, "speed": speed, "fsdp_over_ddp": ratio, "target": TARGET, "met": met,
                      "memory_model": MEMORY_MODEL, "speed_model": SPEED_MODEL, "batch": BATCH})
    return {"met": met}


if __name__ == "__main__":
    if sys.argv[1:2] == ["memory-worker"]:
        memory_worker(sys.argv[2], sys.argv[3])
    else:
        run()
