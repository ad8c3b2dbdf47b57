"""Time the all-reduce of this machine's process group, for `islands plan --network this-machine`.

    torchrun --nproc_per_node=2 --master_addr=127.0.0.1 -m islands.parallel.probe OUT.json

Every rank all-reduces a one-float tensor and a large one, many times; rank 0 writes the median seconds of each
size. The one-float time is latency only (an all-reduce over 2 ranks is 2 ring steps); the large one adds the bytes
each rank sends (the ledger's count) at the link's bandwidth. Then what DDP adds to the training step of a linear
layer of 1M parameters (about 4 MB of gradients), against the same step without it: the bandwidth a DDP step sees.
On a CPU with gloo it is 2 to 3 times lower than the bare all-reduce's (measured here: 4.75 MB cost 5 ms alone and
12 to 15 ms inside a DDP step, the reducer's bucket copies and gloo's threads taking the cores the compute needs).
"""

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from islands.parallel.launch import close_world, init_world
from islands.parallel.ledger import bytes_sent

SIZES = (1, 2**20)  # floats: latency alone, then 4 MiB
REPEATS = 30


def median_seconds(numel: int, repeats: int = REPEATS) -> float:
    tensor = torch.ones(numel)
    dist.all_reduce(tensor)  # connections made, buffers allocated
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def added_by_ddp(width: int = 1024, repeats: int = 30) -> tuple[float, int]:
    """(median seconds DDP adds to a training step of one width x width linear layer, the floats it reduces)."""
    def step_time(wrap: bool) -> float:
        layer = torch.nn.Linear(width, width)
        model = DistributedDataParallel(layer) if wrap else layer
        opt = torch.optim.SGD(layer.parameters(), lr=1e-3)
        x, times = torch.randn(32, width), []
        for _ in range(repeats + 3):
            dist.barrier()
            start = time.perf_counter()
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - start)
        return statistics.median(times[3:])

    return step_time(True) - step_time(False), width * width + width


def main(out: str) -> None:
    torch.set_num_threads(1)
    world = init_world(timeout_s=60)
    timings = {numel: median_seconds(numel) for numel in SIZES}
    added, reduced = added_by_ddp()
    if world.is_main:
        (small, t_small), (large, t_large) = sorted(timings.items())
        steps = 2 * (world.size - 1)
        sent = bytes_sent("all_reduce", 4 * large, world.size) - bytes_sent("all_reduce", 4 * small, world.size)
        record = {"ranks": world.size, "seconds": {str(k): v for k, v in timings.items()},
                  "seconds_added_by_ddp": added, "latency_us": 1e6 * t_small / steps,
                  "gbit_s": 8 * sent / max(t_large - t_small, 1e-9) / 1e9,
                  "gbit_s_under_ddp": 8 * bytes_sent("all_reduce", 4 * reduced, world.size) / max(added - t_small,
                                                                                                  1e-9) / 1e9}
        with open(out, "w") as f:
            json.dump(record, f, indent=1)
    close_world()


if __name__ == "__main__":
    main(sys.argv[1])
