"""Time this machine's collectives, for `islands plan --network this-machine`.

    torchrun --nproc_per_node=2 --master_addr=127.0.0.1 -m islands.parallel.probe OUT.json [NETWORK.json]
    python -m islands.parallel.probe --host OUT.json NETWORK.json STRATEGY...    (one process, no peer)

Every rank calls each collective the ledger books (all-reduce, all-gather, reduce-scatter) on one value per rank and
on 4 MiB, many times, each call after a barrier; rank 0 writes the median seconds of each. The one-value call is the
collective's cost per call whatever it carries (latency, and on loopback the wake-up of every rank's gloo thread);
the large one adds the bytes each rank sends (the ledger's count) at the collective's bandwidth. Timed alone, they
are what the backend does: gloo's reduce-scatter (torch 2.13, ProcessGroupGloo::reduce_scatter_tensor_coalesced)
clones its input, all-reduces the whole of it and copies out the rank's chunk, so it costs an all-reduce, twice the
bytes of a ring reduce-scatter, where NCCL's is a ring.

Then what DDP adds to a bare training step (forward, backward, SGD; no data, no trainer) of the network NETWORK.json
describes (its model config, data shape, classes and a rank's batch; without it, a linear layer of 1M parameters),
against the same step without DDP: the bandwidth a collective sees beside the compute. On a CPU with gloo it is 2 to
3 times lower than alone, and lower the more compute the buckets overlap: loopback's bytes are copied by the cores
the backward pass needs (measured here for 4.75 MB: 5 ms alone, 9 ms beside a linear layer's step, 16 ms beside the
step of a 4-block MLP).

`--host`: the seconds each named strategy's layout adds to a training step (forward, backward, gradient norm,
AdamW, an EMA of the weights) on a process group of one rank, where no collective waits on a peer: the layout's
own work on the host (FSDP2's hooks, the copies in and out of its flat buffers, DTensor dispatch in the optimizer).
"""

import functools
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Annotated

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from islands.conditions import network_spec
from islands.config import ModelConfig
from islands.nets import build_network
from islands.parallel.build import strategy_class
from islands.parallel.launch import World, close_world, init_world
from islands.parallel.layout import Layout
from islands.parallel.ledger import Ledger, bytes_sent
from islands.rundir import Record

SIZES = (1, 2**20)  # floats each rank holds: one call's cost, then 4 MiB
REPEATS = 30
KINDS = ("all_reduce", "all_gather", "reduce_scatter")  # the ledger's names for what FSDP and DDP call


def call(kind: str, numel: int, world: int):
    """A function issuing one `kind` collective over `numel` floats held by each rank (an all-gather's output and a
    reduce-scatter's input are `world` times that), as DDP and FSDP2 issue them."""
    mine, whole = torch.ones(numel), torch.ones(numel * world)
    return {"all_reduce": lambda: dist.all_reduce(mine),
            "all_gather": lambda: dist.all_gather_single(whole, mine),
            "reduce_scatter": lambda: dist.reduce_scatter_single(mine, whole)}[kind]


def median_seconds(kind: str, numel: int, world: int, repeats: int = REPEATS) -> float:
    issue = call(kind, numel, world)
    issue()  # connections made, buffers allocated
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        issue()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def booked(kind: str, numel: int, world: int) -> int:
    """Bytes a rank sends as the ledger counts them, for a collective over `numel` floats per rank."""
    return bytes_sent(kind, 4 * numel * (1 if kind == "all_reduce" else world), world)


class NetworkDescription(Record):
    """NETWORK.json: the network whose step a probe times (plan/this_machine.py writes it): its model config, an
    example's shape, its classes and a rank's batch."""

    model: ModelConfig
    shape: list[Annotated[int, Field(ge=1)]] = Field(min_length=1, max_length=4)
    classes: int = Field(ge=0)
    batch: int = Field(ge=1)


class Collective(BaseModel):
    """One collective timed alone: a one-value call's seconds, a 4 MiB call's, and the bandwidth of the bytes beyond."""

    model_config = ConfigDict(extra="forbid")
    call_s: float
    large_s: float
    gbit_s: float


class LinkProbe(Record):
    """OUT.json of the probe under torchrun (rank 0's): each collective alone, and what DDP's all-reduce is beside a
    step's compute (see above)."""

    ranks: int = Field(ge=1)
    collectives: dict[str, Collective]
    seconds_added_by_ddp: float
    wait_s_a_step: float
    call_s_beside_compute: float
    copy_gbit_s: float
    latency_us: float
    gbit_s: float
    gbit_s_under_ddp: float


class HostProbe(Record):
    """OUT.json of `--host`: the seconds each strategy's layout adds to a step on the host."""

    host_s: dict[str, float]


def fitted(kind: str, world: int) -> Collective:
    """One call's seconds (the one-float call) and the bandwidth of the ledger's bytes beyond it, alone."""
    (small, t_small), (large, t_large) = ((n, median_seconds(kind, n, world)) for n in SIZES)
    sent = booked(kind, large, world) - booked(kind, small, world)
    return Collective(call_s=t_small, large_s=t_large, gbit_s=8 * sent / max(t_large - t_small, 1e-9) / 1e9)


def linear_layer(width: int = 1024) -> tuple[nn.Module, tuple]:
    return nn.Linear(width, width), (torch.randn(32, width),)


def described_network(path: str) -> tuple[nn.Module, tuple]:
    """The network and a batch of random inputs that NETWORK.json describes."""
    spec = NetworkDescription.read(Path(path))
    net = build_network(network_spec(spec.model, spec.shape, spec.classes))
    labels = torch.randint(0, spec.classes, (spec.batch,)) if spec.classes else None
    return net, (torch.randn(spec.batch, *spec.shape), torch.rand(spec.batch), labels)


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


def copy_gbit_s(numel: int = 2**20, repeats: int = REPEATS) -> float:
    """The rate this rank copies a 4 MiB tensor into another, every rank copying at once (as FSDP2 copies its
    units in and out of flat buffers on every rank), in Gbit/s of the bytes copied."""
    source, target = torch.ones(numel), torch.empty(numel)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - start)
    return 8 * 4 * numel / statistics.median(times) / 1e9


def added_by_syncs(build, repeats: int = 40) -> tuple[float, float]:
    """What synchronising adds to a training step of the network `build()` returns, beside its compute: (seconds
    one all-reduce of one value after the backward pass adds, as the trainer's agreement on a finite step;
    seconds each further one adds, issued before every FSDP unit's forward (each block, then the whole network) as
    FSDP2 gathers them). The first waits for the slowest rank to finish the step, whatever it carries; each
    further one waits for its gloo thread to get a core beside the compute. Steps without, with one and with all
    of them alternate."""
    torch.manual_seed(0)
    net, inputs = build()
    units = [*getattr(net, "blocks", []), net]
    one = torch.ones(1)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)

    def step_time(syncs: int) -> float:
        hooks = [u.register_forward_pre_hook(lambda *_: dist.all_reduce(one)) for u in units] if syncs > 1 else []
        dist.barrier()
        start = time.perf_counter()
        net(*inputs).square().mean().backward()
        if syncs:
            dist.all_reduce(one)
        opt.step()
        opt.zero_grad()
        seconds = time.perf_counter() - start
        for hook in hooks:
            hook.remove()
        return seconds

    times = [[step_time(syncs) for syncs in (0, 1, 1 + len(units))] for _ in range(repeats + 3)][3:]
    first = statistics.median(one - none for none, one, _ in times)
    further = statistics.median(every - one for _, one, every in times) / len(units)
    return first, further


def main(out: str, network: str | None = None) -> None:
    torch.set_num_threads(1)
    world = init_world(timeout_s=60)
    alone = {kind: fitted(kind, world.size) for kind in KINDS}
    build = functools.partial(described_network, network) if network else linear_layer
    added, reduced = added_by_ddp(build)
    first, further = added_by_syncs(build)
    copied = copy_gbit_s()
    if world.is_main:
        t_small = alone["all_reduce"].call_s
        waits = max(0.0, first - t_small)  # for the slowest rank, once a step: DDP's bucket waits so too
        LinkProbe(ranks=world.size, collectives=alone, seconds_added_by_ddp=added, wait_s_a_step=waits,
                  call_s_beside_compute=further, copy_gbit_s=copied, latency_us=1e6 * t_small / (2 * (world.size - 1)),
                  gbit_s=alone["all_reduce"].gbit_s,
                  gbit_s_under_ddp=8 * bytes_sent("all_reduce", 4 * reduced, world.size) / max(
                      added - t_small - waits, 1e-9) / 1e9).write(Path(out))
    close_world()


def trained_step(model: nn.Module, net: nn.Module, layout, opt: torch.optim.Optimizer, average: list,
                 inputs: tuple, ema_weight: float) -> float:
    """Seconds of one training step as the trainer takes it, without data: forward, backward, the gradient norm,
    AdamW, and an EMA of the weights. The EMA's weight changes every step, as it does while its half-life ramps up
    (islands/train/ema.py): a new Python number each step misses DTensor's cache of sharding decisions, and that
    slow path was a fifth of a sharded MLP step in the trainer."""
    start = time.perf_counter()
    model(*inputs).square().mean().backward()
    params = [p for p in net.parameters() if p.requires_grad]
    layout.clip_grad_norm(params, math.inf)
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        for kept, p in zip(average, params, strict=True):
            kept.lerp_(p.detach(), ema_weight)
    return time.perf_counter() - start


def host(out: str, network: str, *strategies: str, repeats: int = 30) -> None:
    """Seconds each strategy's layout adds to a training step of NETWORK.json's network on one rank (see above)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = World(rank=0, size=1, group=dist.group.WORLD)
    steps = []
    for layout in (Layout(world, Ledger(1)), *(strategy_class(name).layout_class(world, Ledger(1))
                                                for name in strategies)):
        torch.manual_seed(0)
        net, inputs = described_network(network)
        model = layout.wrap(net)
        opt = layout.optimizer(net, lr=1e-4)
        average = [p.detach().clone() for p in net.parameters() if p.requires_grad]
        steps.append(functools.partial(trained_step, model, net, layout, opt, average, inputs))
    # a plain step and one of each layout in turn, so that all see the machine alike; each step's EMA weight is
    # one no step used before, as in a run (a layout given the one the layout before it used would find it cached)
    times = [[step(1 / (len(steps) * i + j + 2)) for j, step in enumerate(steps)] for i in range(repeats + 5)][5:]
    added = {name: statistics.median(t[j + 1] - t[0] for t in times) for j, name in enumerate(strategies)}
    HostProbe(host_s=added).write(Path(out))
    close_world()


if __name__ == "__main__":
    if sys.argv[1] == "--host":
        host(*sys.argv[2:])
    else:
        main(*sys.argv[1:3])
