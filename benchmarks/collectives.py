"""gloo's collectives at the sizes the plan's strategies issue them, each timed alone on 2 and 4 local ranks (issue 39,
section 4): what `islands plan --network this-machine` prices them at against what they take.

For the MLP of benchmarks/plan.py (1.2M parameters) and the benchmarks' U-Net, every FSDP unit's all-gather (each
rank holds 1/W of the unit) and reduce-scatter, and DDP's one bucket's all-reduce: the median of 30 calls, each after
a barrier, summed over a step's calls of each kind, beside the plan's price for them alone (the probe's cost per
call plus the ledger's bytes at its bandwidth alone, measured in the same processes on one value and on 4 MiB).
Then gloo's reduce-scatter against what torch 2.13 makes of it (ProcessGroupGloo::reduce_scatter_tensor_coalesced):
a clone of the input, an all-reduce of the whole of it and a copy of the rank's chunk, timed as such.

    python -m benchmarks collectives
"""

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import UNET, save, table
from benchmarks.plan import GMM, config
from islands.config import validate
from islands.parallel.launch import run_local_ranks
from islands.parallel.probe import booked
from islands.plan.network import Measured, load_network
from islands.plan.predict import Planner

RANKS = (2, 4)
MODELS = {"mlp": ({"arch": "mlp", "hidden": 256, "depth": 4, "num_classes": 3}, (2,)), "unet": (UNET, (1, 28, 28))}


def unit_floats(model: dict, shape: tuple) -> tuple[list[int], int]:
    """(the floats of each FSDP unit: every block, then the root with what no block holds; all of them)."""
    net = Planner(validate(config(Path("unused"), model, GMM, 64)), load_network("nvlink"), shape,
                  model["num_classes"]).net  # built on the meta device
    blocks = [sum(p.numel() for p in b.parameters()) for b in net.blocks]
    everything = sum(p.numel() for p in net.parameters())
    return [*blocks, everything - sum(blocks)], everything


def worker(out: str, sizes: str) -> None:
    """On each rank: every (kind, floats per rank) of SIZES timed alone, and the emulated reduce-scatter."""
    import torch.distributed as dist

    from islands.parallel.launch import close_world, init_world
    from islands.parallel.probe import fitted, median_seconds

    torch.set_num_threads(1)
    world = init_world(timeout_s=60)
    timed = {f"{kind} {numel}": median_seconds(kind, numel, world.size) for kind, numel in json.loads(sizes)}
    fits = {kind: fitted(kind, world.size) for kind in ("all_reduce", "all_gather", "reduce_scatter")}
    emulated = {}
    for kind, numel in json.loads(sizes):
        if kind != "reduce_scatter":
            continue
        whole, mine, times = torch.ones(numel * world.size), torch.ones(numel), []
        for _ in range(31):
            dist.barrier()
            start = time.perf_counter()
            buffer = whole.clone()
            dist.all_reduce(buffer)
            mine.copy_(buffer.chunk(world.size)[world.rank])
            times.append(time.perf_counter() - start)
        emulated[str(numel)] = statistics.median(times[1:])
    if world.is_main:
        Path(out).write_text(json.dumps({"timed": timed, "fits": fits, "emulated": emulated}))
    close_world()


def run() -> dict:
    rows, emulation, found = [], [], {}
    for ranks in RANKS:
        issued = {}  # (model, kind) -> the floats a rank holds in each call of one step (fsdp: gathers once)
        for name, (model, shape) in MODELS.items():
            units, everything = unit_floats(model, shape)
            issued[name, "all_reduce"] = [everything]
            for kind in ("all_gather", "reduce_scatter"):
                issued[name, kind] = [-(-u // ranks) for u in units]
        sizes = sorted({(kind, numel) for (_, kind), calls in issued.items() for numel in calls})
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "timed.json"
            done = run_local_ranks([sys.executable, "-m", "benchmarks.collectives", str(out), json.dumps(sizes)],
                                   ranks, timeout_s=600)
            failed = next((d.stderr for d in done if d.returncode != 0), None)
            assert failed is None, failed[-3000:]
            result = json.loads(out.read_text())
        found[ranks] = result
        for (name, kind), calls in issued.items():
            fit = result["fits"][kind]
            priced = Measured(ranks=ranks, call_us=1e6 * fit["call_s"], gbit_s=fit["gbit_s"])
            predicted = sum(priced.seconds(booked(kind, n, ranks) - booked(kind, 1, ranks)) for n in calls)
            seconds = sum(result["timed"][f"{kind} {n}"] for n in calls)
            whole = sum(4 * n * (1 if kind == "all_reduce" else ranks) for n in calls)
            rows.append([ranks, name, kind, len(calls), whole / 1e6, 1e3 * seconds, 1e3 * predicted,
                         predicted / seconds])
        for numel, seconds in result["emulated"].items():
            emulation.append([ranks, int(numel), 1e6 * result["timed"][f"reduce_scatter {numel}"], 1e6 * seconds])
    print("Each kind's calls in one step, each timed alone after a barrier (fsdp gathers the blocks once more):")
    print(table(["ranks", "model", "collective", "calls", "MB in all", "measured ms", "priced ms",
                 "priced / measured"], rows))
    print("gloo's reduce-scatter against a clone, an all-reduce of the whole buffer and a copy of the rank's chunk:")
    print(table(["ranks", "floats a rank", "reduce_scatter us", "clone + all_reduce + copy us"], emulation))
    save("collectives", {"rows": rows, "emulation": emulation, "raw": found})
    return {"met": max(abs(r[-1] - 1) for r in rows) <= 0.3}


if __name__ == "__main__":
    worker(*sys.argv[1:3])
