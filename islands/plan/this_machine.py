"""The network description of this machine, measured: `islands plan CONFIG --network this-machine`.

Processes on one machine are the accelerators of one node, joined by loopback gloo. Four things are measured and
nothing is fitted to the run being predicted:
- the FLOP/s one process sustains (short one-process runs of the config at the batch one rank would get, one per
  rank at once, each on one thread as torchrun gives each rank; so the MFU is 1);
- gloo's collectives between `ranks` processes (islands/parallel/probe.py): each kind's cost per call and its
  bandwidth alone; beside a bare step of the config's network at a rank's batch (no data, no trainer), the
  bandwidth DDP's all-reduce sees (gloo on a CPU was measured 2 to 3 times slower than alone, taking the cores the
  compute needs), what a further one-value call costs, and what the step's first synchronisation waits for the
  slowest rank. Every collective is priced at its own cost alone, made longer per call and slower per byte as
  those were beside the compute; the link is the all-reduce's, and nothing overlaps (overlap 0);
- the rate a process copies memory, every rank at once (FSDP2's copies in and out of its flat buffers);
- the host work of the layouts that ask for it (`Costs.host_overhead`: FSDP2's hooks and DTensor steps), one
  process per rank at once, each on a process group of its own.
"""

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from islands.config import to_dict, validate
from islands.parallel.build import strategy_class
from islands.parallel.launch import run_local_ranks
from islands.parallel.probe import HostProbe, LinkProbe, NetworkDescription
from islands.plan.network import Link, Measured, Network
from islands.plan.predict import DENSE
from islands.rundir import read_log
from islands.train.flops import FlopsRecord

CALIBRATION_STEPS, WINDOW = 120, 10  # optimizer steps of each one-process run; steps per logged window
# windows left out: the first ones, while the other processes may still be starting (a process alone runs faster),
# and the last one, when they may have finished
SKIP_FIRST, SKIP_LAST = 4, 1


def measured_host(network: NetworkDescription, ranks: int, strategies: list[str],
                  timeout_s: float = 300.0) -> dict[str, float]:
    """Seconds each strategy's layout adds to a step on the host (probe.py --host), `ranks` such processes at once
    as the ranks of a run share the machine: the median of theirs."""
    if not strategies:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        described = network.write(Path(tmp) / "network.json")
        outs = [Path(tmp) / f"host{r}.json" for r in range(ranks)]
        procs = [subprocess.Popen([sys.executable, "-m", "islands.parallel.probe", "--host", str(out), str(described),
                                   *strategies], env={**os.environ, "OMP_NUM_THREADS": "1"},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for out in outs]
        try:
            for proc in procs:
                _, err = proc.communicate(timeout=timeout_s)
                if proc.returncode != 0:
                    raise RuntimeError(f"the host probe failed: {err.strip().splitlines()[-1:]}")
        finally:
            for proc in procs:
                proc.kill()
        added = [HostProbe.read(out).host_s for out in outs]
    return {name: statistics.median(a[name] for a in added) for name in strategies}


def measured_collectives(link: LinkProbe) -> dict[str, Measured]:
    """Each collective as the probe measured it alone, beside the compute: a call waits as much longer as a
    further one-value all-reduce did between the units' forwards (for a core for its gloo thread), and its
    bandwidth is slowed as DDP's all-reduce was (the same share of the cores goes to the compute whichever
    collective runs beside it)."""
    alone = link.collectives
    waits = max(0.0, link.call_s_beside_compute - alone["all_reduce"].call_s)
    slowed = link.gbit_s_under_ddp / alone["all_reduce"].gbit_s
    return {kind: Measured(ranks=link.ranks, call_us=1e6 * (a.call_s + waits), gbit_s=a.gbit_s * slowed)
            for kind, a in alone.items()}


def measured_link(ranks: int, network: NetworkDescription | None = None, timeout_s: float = 120.0) -> LinkProbe:
    """Latency (us) and bandwidth (Gbit/s) of gloo's all-reduce between `ranks` local processes, alone and inside
    a DDP step of the `network` described (probe.py's NETWORK.json). The ranks are started as torchrun starts them
    (RANK, WORLD_SIZE, MASTER_ADDR/PORT) but without its agent, whose own start took a third of a plan's time."""
    with tempfile.TemporaryDirectory() as tmp:
        out, described = Path(tmp) / "probe.json", Path(tmp) / "network.json"
        if network is not None:
            network.write(described)
        done = run_local_ranks([sys.executable, "-m", "islands.parallel.probe", str(out),
                                *([str(described)] if network else [])], ranks, timeout_s)
        failed = next((rank.stderr for rank in done if rank.returncode != 0), None)
        if failed is not None:
            raise RuntimeError(f"the all-reduce probe failed: {failed.strip().splitlines()[-1:]}")
        return LinkProbe.read(out)


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
        windows = [line.images_per_s for run in runs for line in read_log(run)[SKIP_FIRST:-SKIP_LAST]]
        per_image = FlopsRecord.read(runs[0] / FlopsRecord.FILE).flops_per_image
    return per_image * statistics.median(windows)


def this_machine(cfg, shape: tuple, classes: int, ranks: int = 2) -> Network:
    network = NetworkDescription(model=cfg.model, shape=list(shape), classes=classes,
                                 batch=max(1, cfg.train.batch_size // ranks))
    link = measured_link(ranks, network)
    host = measured_host(network, ranks, [name for name in DENSE if strategy_class(name).costs.host_overhead])
    return Network(name="this-machine", gpus_per_node=ranks, gpu_tflops=measured_rate(cfg, ranks) / 1e12, mfu=1.0,
                   overlap=0.0, node=Link(gbit_s=link.gbit_s_under_ddp, latency_us=link.latency_us),
                   collectives=measured_collectives(link), host_s=host, wait_s=link.wait_s_a_step,
                   copy_gbit_s=link.copy_gbit_s)
