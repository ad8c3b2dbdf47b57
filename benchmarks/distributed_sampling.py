"""Sampling a 4-expert ensemble with its experts spread over 2 ranks, against one process, side by side.

The ensemble is ddm_gmm's K = 4 k-means ensemble of the 32-D mixture (MLP experts, the default router). One
process samples it with 2 threads; `islands sample --distributed` on 2 ranks (1 thread each, launched as torchrun
launches them) gives each rank two experts and half the samples. Both time the sampling alone (experts loaded on
first use included, process start-up not), for the same samples, under full routing (every expert for every
sample: the most traffic) and top-1 (one expert per sample). Then two timestep-range experts of the same MLP
(ranges [0, 0.5] and [0.5, 1], 32,000 images each): one process gated by t, against 2 ranks that pipeline the
batches (rank 0 the noisy range, rank 1 the clean one). The two must agree within float tolerance.

    python -m benchmarks distributed_sampling
"""

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import save, setup, table
from benchmarks.ddm_gmm import config
from benchmarks.range_experts import gmm_raw, ranges
from islands.config import validate
from islands.ddm.pipeline import build_ensemble
from islands.ddm.sampling import open_sampler
from islands.ddm.time_gate import load_time_gate
from islands.generate import generate

NUM, RANKS = 4000, 2
ROUTINGS = ("full", "top1")


def one_process(root: Path, cfg, routing: str) -> tuple[np.ndarray, float]:
    sampler = open_sampler(root, routing=routing)
    start = time.perf_counter()
    x = sampler.generate(NUM)
    return x.numpy(), NUM / (time.perf_counter() - start)


def two_ranks(root: Path, routing: str | None, out: Path) -> tuple[np.ndarray, float, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    policy = [] if routing is None else ["--routing", routing]
    ranks = [subprocess.Popen([sys.executable, "-m", "islands", "sample", str(root), "--num", str(NUM), *policy,
                               "--distributed", "--out", str(out), "--quiet"],
                              env={**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(r), "LOCAL_RANK": str(r),
                                   "WORLD_SIZE": str(RANKS), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(RANKS)]
    outputs = [p.communicate(timeout=1200) for p in ranks]
    assert all(p.returncode == 0 for p in ranks), [err[-2000:] for _, err in outputs]
    said = outputs[0][0]
    images_per_s = float(said.split("ranks: ")[1].split(" images/s")[0])
    moved = float(said.split("images/s, ")[1].split(" MB")[0])
    return np.load(out / "samples.npz")["x"], images_per_s, moved


def run() -> dict:
    setup()
    rows, found = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = validate(config(Path(tmp) / "ensemble", "kmeans", 4))
        build_ensemble(cfg, jobs=2, progress=False)
        root = Path(cfg.run_dir)
        for routing in ROUTINGS:
            torch.set_num_threads(2)
            single, single_rate = one_process(root, cfg, routing)
            spread, spread_rate, moved = two_ranks(root, routing, Path(tmp) / routing)
            difference = float(np.abs(single - spread).max())
            found[routing] = {"one_process_images_per_s": single_rate, "two_ranks_images_per_s": spread_rate,
                              "ratio": spread_rate / single_rate, "mb_moved": moved, "max_abs_difference": difference}
            rows.append([routing, single_rate, spread_rate, spread_rate / single_rate, moved, difference])
        run_dir = ranges(gmm_raw(Path(tmp) / "ranges", 32_000), [0.0, 0.5, 1.0])
        gate, range_cfg, _ = load_time_gate(run_dir)
        torch.set_num_threads(2)
        start = time.perf_counter()
        single = generate(gate, (len(range_cfg.data.means[0]),), NUM, range_cfg.sample, range_cfg.seed, None).numpy()
        single_rate = NUM / (time.perf_counter() - start)
        spread, spread_rate, moved = two_ranks(run_dir, None, Path(tmp) / "pipelined")
        difference = float(np.abs(single - spread).max())
        found["ranges pipelined"] = {"one_process_images_per_s": single_rate, "two_ranks_images_per_s": spread_rate,
                                     "ratio": spread_rate / single_rate, "mb_moved": moved,
                                     "max_abs_difference": difference}
        rows.append(["2 range experts, pipelined", single_rate, spread_rate, spread_rate / single_rate, moved,
                     difference])
    print(table(["sampler", "1 process img/s", f"{RANKS} ranks img/s", "ratio", "MB moved", "max |diff|"], rows))
    agree = all(v["max_abs_difference"] < 1e-4 for v in found.values())
    save("distributed_sampling", {"results": found, "num": NUM, "ranks": RANKS,
                                  "claim": "distributed sampling equals one process's samples (1e-4)", "met": agree})
    return {"met": agree}


if __name__ == "__main__":
    run()
