"""Parallel strategies, applied to a built network from outside; the loop only calls these methods.

none: one process.  ddp: data parallel (DistributedDataParallel) with optional fp16/bf16 gradient
compression. Every strategy counts its traffic in a `Ledger`.
"""

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from islands.config import ConfigError
from islands.parallel.launch import World
from islands.parallel.ledger import Ledger


class Strategy:
    """Single process: wrapping is the identity and there is nothing to synchronise."""

    name = "none"

    def __init__(self, world: World, compression: str = "none"):
        self.world = world
        self.ledger = Ledger(world.size)
        self.compression = compression

    def wrap(self, net: nn.Module) -> nn.Module:
        return net

    def no_sync(self, net: nn.Module):
        return contextlib.nullcontext()

    def all_finite(self, flag: bool) -> bool:
        """Whether every rank saw a finite step: all ranks must skip a step together."""
        return flag

    def mean(self, values: list[float]) -> list[float]:
        """Average logged scalars over ranks."""
        return values

    def barrier(self) -> None:
        pass

    def check_consistency(self, net: nn.Module) -> None:
        """Every rank holds the same weights (data parallel only); raises if not."""


class DDPStrategy(Strategy):
    name = "ddp"

    def wrap(self, net: nn.Module) -> nn.Module:
        device_ids = [self.world.device.index] if self.world.device.type == "cuda" else None
        ddp = DistributedDataParallel(net, device_ids=device_ids)
        ddp.register_comm_hook(self, _averaging_hook(self.compression))
        return ddp

    def no_sync(self, net: nn.Module):
        return net.no_sync()

    def all_finite(self, flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def mean(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return (t / self.world.size).tolist()

    def barrier(self) -> None:
        dist.barrier()

    def check_consistency(self, net: nn.Module) -> None:
        # Two different sums per tensor: a rank that drifted cannot match both by accident.
        with torch.no_grad():
            sums = torch.stack([torch.stack([p.double().sum(), (p.double() * torch.arange(p.numel(),
                                dtype=torch.float64).reshape(p.shape).sin()).sum()]) for p in net.parameters()])
        low, high = sums.clone(), sums.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        if not torch.equal(low, high):
            names = [n for (n, _), differs in zip(net.named_parameters(), (low != high).any(1)) if differs]
            raise RuntimeError(f"ranks hold different weights after a checkpoint: {', '.join(names[:5])}")


_WIRE_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def _averaging_hook(compression: str):
    """A DDP comm hook: average the bucket over ranks, optionally sent in 16 bits, and count the bytes.

    torch's bf16_compress_hook requires CUDA, and its fp16 one does not report traffic, so both are
    written here: cast, all-reduce, divide, cast back into the bucket.
    """
    wire = _WIRE_DTYPES[compression]

    def hook(strategy: Strategy, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        payload = buffer if wire is None else buffer.to(wire)
        strategy.ledger.record("all_reduce", payload.numel() * payload.element_size())
        payload.div_(strategy.world.size)
        future = dist.all_reduce(payload, async_op=True).get_future()

        def unpack(fut):
            reduced = fut.value()[0]
            return reduced if wire is None else buffer.copy_(reduced)

        return future.then(unpack)

    return hook


STRATEGIES = {"none": Strategy, "ddp": DDPStrategy}


def build_strategy(name: str, world: World, compression: str = "none") -> Strategy:
    if name == "none" and world.distributed:
        raise ConfigError("parallel.strategy: 'none' cannot run with several ranks; choose ddp")
    if name != "none" and not dist.is_initialized():
        raise ConfigError(f"parallel.strategy: {name!r} needs a process group; launch with torchrun")
    return STRATEGIES[name](world, compression)
