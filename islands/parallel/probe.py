"""Time the all-reduce of this machine's process group, for `islands plan --network this-machine`.

    torchrun --nproc_per_node=2 --master_addr=127.0.0.1 -m islands.parallel.probe OUT.json [NETWORK.json]

Every rank all-reduces a one-float tensor and a large one, many times; rank 0 writes the median seconds of each
size. The one-float time is latency only (an all-reduce over 2 ranks is 2 ring steps); the large one adds the bytes
each rank sends (the ledger's count) at the link's bandwidth. Then what DDP adds to a bare training step (forward,
backward, SGD; no data, no trainer) of the network NETWORK.json describes (its model config, data shape, classes and
a rank's batch; without it, a linear layer of 1M parameters), against the same step without DDP: the bandwidth a
DDP step sees. On a CPU with gloo it is 2 to 3 times lower than the bare all-reduce's, and lower the more compute
the buckets overlap: loopback's bytes are copied by the cores the backward pass needs (measured here for 4.75 MB:
5 ms alone, 9 ms beside a linear layer's step, 16 ms beside the step of a 4-block MLP).
"""

import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from pydantic import TypeAdapter
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from islands.conditions import network_spec
from islands.config import ModelConfig
from islands.nets import build_network
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


def linear_layer(width: int = 1024) -> tuple[nn.Module, tuple]:
    return nn.Linear(width, width), (torch.randn(32, width),)


def described_network(path: str) -> tuple[nn.Module, tuple]:
    """The network and a batch of random inputs that NETWORK.json describes."""
    spec = json.loads(Path(path).read_text())
    model = TypeAdapter(ModelConfig).validate_python(spec["model"])
    net = build_network(network_spec(model, spec["shape"], spec["classes"]))
    batch = spec["batch"]
    labels = torch.randint(0, spec["classes"], (batch,)) if spec["classes"] else None
    return net, (torch.randn(batch, *spec["shape"]), torch.rand(batch), labels)


def added_by_ddp(build, repeats: int = 40) -> tuple[float, int]:
    """(median seconds DDP adds to a training step of the network `build()` returns, the floats it reduces).
    Steps with and without DDP alternate, so that both see the machine as it is at that moment."""
    torch.manual_seed(0)
    plain, inputs = build()
    wrapped = DistributedDataParallel(build()[0])

    def step_time(model: nn.Module, opt: torch.optim.Optimizer) -> float:
        dist.barrier()
        start = time.perf_counter()
        model(*inputs).square().mean().backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start

    opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (plain, wrapped)]
    added = [step_time(wrapped, opts[1]) - step_time(plain, opts[0]) for _ in range(repeats + 3)][3:]
    return statistics.median(added), sum(p.numel() for p in plain.parameters() if p.requires_grad)


def main(out: str, network: str | None = None) -> None:
    torch.set_num_threads(1)
    world = init_world(timeout_s=60)
    timings = {numel: median_seconds(numel) for numel in SIZES}
    added, reduced = added_by_ddp(functools.partial(described_network, network) if network else linear_layer)
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
    main(*sys.argv[1:3])
