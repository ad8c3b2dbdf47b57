"""The network description of this machine, measured: `islands plan CONFIG --network this-machine`.

Processes on one machine are the accelerators of one node, joined by loopback gloo. Two things are measured and
nothing is fitted to the run being predicted: the FLOP/s one process sustains (short one-process runs of the
config at the batch one rank would get, one per rank at once, each on one thread as torchrun gives each rank; so
the MFU is 1), and the latency and bandwidth of gloo's all-reduce between `ranks` processes
(islands/parallel/probe.py): alone, and inside a bare DDP step of the config's network at a rank's batch (no data,
no trainer), where gloo on a CPU was measured 2 to 3 times slower than alone, taking the cores the compute needs.
The link is described by the bandwidth a DDP step sees, and nothing overlaps (overlap 0).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from islands.config import to_dict, validate
from islands.parallel.launch import run_local_ranks
from islands.plan.network import Link, Network
from islands.train.logbook import read_metrics

CALIBRATION_STEPS, WINDOW = 120, 10  # optimizer steps of each one-process run; steps per logged window
# windows left out: the first ones, while the other processes may still be starting (a process alone runs faster),
# and the last one, when they may have finished
SKIP_FIRST, SKIP_LAST = 4, 1


def measured_link(ranks: int, network: dict | None = None, timeout_s: float = 120.0) -> dict:
    """Latency (us) and bandwidth (Gbit/s) of gloo's all-reduce between `ranks` local processes, alone and inside
    a DDP step of the `network` described (probe.py's NETWORK.json). The ranks are started as torchrun starts them
    (RANK, WORLD_SIZE, MASTER_ADDR/PORT) but without its agent, whose own start took a third of a plan's time."""
    with tempfile.TemporaryDirectory() as tmp:
        out, described = Path(tmp) / "probe.json", Path(tmp) / "network.json"
        described.write_text(json.dumps(network))
        done = run_local_ranks([sys.executable, "-m", "islands.parallel.probe", str(out),
                                *([str(described)] if network else [])], ranks, timeout_s)
        failed = next((rank.stderr for rank in done if rank.returncode != 0), None)
        if failed is not None:
            raise RuntimeError(f"the all-reduce probe failed: {failed.strip().splitlines()[-1:]}")
        return json.loads(out.read_text())


def measured_rate(cfg, ranks: int, timeout_s: float = 900.0) -> float:
    """FLOP/s of one training process on one thread at the batch one of `ranks` ranks gets, with `ranks` such
    processes running at once (independent runs, no communication): they share the machine's caches and memory
    bandwidth as the ranks of a real run do."""
    per_rank = max(1, cfg.train.batch_size // ranks)
    images = CALIBRATION_STEPS * per_rank
    raw = cfg.model_dump()
    raw["data"]["shards"] = None
    raw["train"].update(batch_size=per_rank, images=images, log_every=WINDOW * per_rank, checkpoint_every=images,
                        sample_every=0)
    raw["sample"]["num"] = 1  # the grid at the end is not timed
    raw["eval"]["every"] = 0
    with tempfile.TemporaryDirectory() as tmp:
        runs = [Path(tmp) / f"run{r}" for r in range(ranks)]
        procs = []
        for run in runs:
            path = run.with_suffix(".yaml")
            path.write_text(yaml.safe_dump(to_dict(validate({**raw, "run_dir": str(run), "parallel": {}}))))
            procs.append(subprocess.Popen([sys.executable, "-m", "islands", "train", str(path), "--quiet"],
                                          env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, text=True))
        for proc in procs:
            _, err = proc.communicate(timeout=timeout_s)
            if proc.returncode != 0:
                raise RuntimeError(f"the calibration run failed: {err.strip().splitlines()[-1:]}")
        windows = [r["images_per_s"] for run in runs for r in read_metrics(run)[SKIP_FIRST:-SKIP_LAST]]
        per_image = json.loads((runs[0] / "flops.json").read_text())["flops_per_image"]
    return per_image * statistics.median(windows)


def this_machine(cfg, shape: tuple, classes: int, ranks: int = 2) -> Network:
    network = {"model": cfg.model.model_dump(), "shape": list(shape), "classes": classes,
               "batch": max(1, cfg.train.batch_size // ranks)}
    link = measured_link(ranks, network)
    return Network(name="this-machine", gpus_per_node=ranks, gpu_tflops=measured_rate(cfg, ranks) / 1e12, mfu=1.0,
                   overlap=0.0, node=Link(gbit_s=link["gbit_s_under_ddp"], latency_us=link["latency_us"]))
