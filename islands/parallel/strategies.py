"""Parallel strategies, applied to a built network from outside; the trainer only calls these methods.

A strategy wraps the network (activation checkpointing, then torch.compile, then sharding: torchtitan's order),
owns the forward and backward of one optimizer step (`forward_backward`) and may act after the optimizer has
stepped (`after_step`), so that strategies which schedule micro-batches or synchronise every few steps replace a
method instead of forking the loop.

none   one process.
ddp    data parallel (DistributedDataParallel), optional fp16/bf16 gradient compression.
zero1  ddp, with the optimizer state sharded (ZeroRedundancyOptimizer; ZeRO stage 1).
zero2  FSDP2 keeping parameters gathered from forward to backward: gradients and optimizer state
       sharded, parameters sharded only between steps (FSDP's SHARD_GRAD_OP, ZeRO stage 2).
fsdp   FSDP2 `fully_shard` per block, then the root: parameters, gradients and optimizer state
       sharded, each block gathered only while it computes (ZeRO stage 3).
(zero1, zero2 and fsdp live in islands/parallel/sharding.py, imported only by the runs that choose them.)
pipeline  the network cut into stages on different ranks (islands/parallel/pipeline.py).

Every strategy counts its traffic in a `Ledger`, at the place where the collective is issued.
"""

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from islands.config import Config, TrainConfig
from islands.data.batch import Batch
from islands.data.schedule import WorkerSchedule
from islands.parallel.activation_checkpointing import checkpoint_blocks
from islands.parallel.launch import World
from islands.parallel.ledger import Ledger


def compile_blocks(net: nn.Module) -> None:
    """torch.compile each block in place, after activation checkpointing and before sharding (torchtitan's order):
    the blocks repeat, so one compiled graph serves them all, and their state-dict keys stay the same."""
    for block in net.blocks:
        block.compile(dynamic=False)


class Strategy:
    """Single process: wrapping is the identity (but for checkpointing and compilation) and there is nothing to
    synchronise."""

    name = "none"
    joined: int | None = None  # the image count a replica that rejoined its peers took from them at this step
    # What build_strategy's checks across strategies ask of each: whether it spans several ranks (a process
    # group), whether it can run inside a group of ranks (tstages), whether fp16 loss scaling works under it.
    several_ranks = False
    in_a_group = True
    fp16 = True

    @classmethod
    def options(cls, cfg: Config) -> dict:
        """The keys of the config this strategy reads, as its constructor's arguments: every strategy reads these."""
        return {"compression": cfg.parallel.compression, "precision": cfg.train.precision,
                "compile": cfg.train.compile, "activation_checkpointing": cfg.train.activation_checkpointing}

    @classmethod
    def check(cls, cfg: Config) -> None:
        """Refuse, from the config alone, what this strategy cannot run (before it makes any process group)."""

    @classmethod
    def from_config(cls, cfg: Config, world: World) -> "Strategy":
        return cls(world, **cls.options(cfg))

    def check_training(self, train: TrainConfig) -> None:
        """Refuse training settings this strategy cannot run, once every rank has built it."""

    def __init__(self, world: World, compression: str = "none", precision: str = "fp32", compile: bool = False,
                 activation_checkpointing: bool = False):
        self.world = world
        self.ledger = Ledger(world.size)
        self.compression = compression
        self.precision = precision
        self.compile = compile
        self.activation_checkpointing = activation_checkpointing

    @property
    def communicates(self) -> bool:
        """Whether this rank sends anything (its traffic is then logged)."""
        return self.world.distributed

    def wrap(self, net: nn.Module) -> nn.Module:
        """Return what the trainer calls; `net` itself stays the module whose parameters are optimized."""
        if self.activation_checkpointing:
            checkpoint_blocks(net)
        if self.compile:
            compile_blocks(net)
        return net

    def autocast(self):
        """The step's mixed precision: bf16 or fp16 autocast of the network's matmuls and convolutions."""
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.world.device.type, dtype=dtype)

    def forward_backward(self, model: nn.Module, loss, micro_batches: list[Batch], scaler) -> torch.Tensor:
        """Gradients of one optimizer step: `loss(model, micro_batch)` (per example) over the micro-batches, scaled
        by `scaler` and by 1 / their number, synchronised once, on the last one. -> the step's mean loss."""
        total = torch.zeros((), device=self.world.device)
        for i, batch in enumerate(micro_batches):
            sync = contextlib.nullcontext() if i == len(micro_batches) - 1 else self.no_sync(model)
            with sync:
                with self.autocast():
                    value = loss(model, batch).mean()
                scaler.scale(value / len(micro_batches)).backward()
            total += value.detach() / len(micro_batches)
        return total

    def data_shard(self) -> tuple[int, int]:
        """(which share of each global batch this rank reads, into how many shares it is cut)."""
        return self.world.rank, self.world.size

    def clock(self, batch: int) -> tuple[WorkerSchedule, int, int, int]:
        """What this rank reads at each tick: (the replicas' schedule, this rank's replica, its part of the
        replica's batch, the parts). Here every data share is a replica that steps at every tick."""
        share, shares = self.data_shard()
        return WorkerSchedule.even(batch, shares), share, 0, 1

    def after_step(self, images: int, last: bool = False) -> int | None:
        """Called after every optimizer step, with the images consumed so far and whether it was the run's last (an
        outer step may happen here). -> the images the EMA takes in now: None for this step's, since the weights
        are the model's after every step; 0 while they are only a replica's own."""
        return None

    def ema_weights(self) -> dict[str, torch.Tensor] | None:
        """The weights the EMA takes in, by parameter name, where they are not the network's own (None)."""
        return None

    def checkpoint_layout(self, held: dict) -> dict:
        """How this rank's state (model, optim, ema) is laid out in the sharded checkpoint, around the same dicts."""
        return held

    def resumed(self) -> None:
        """Called once a checkpoint has been read into `checkpoint_layout`'s tensors."""

    def share(self, name: str, get, load) -> None:
        """State that a replica rejoining the others later must be sent with the weights (the EMA): `get()` gives
        it, `load(state)` takes it in. Only strategies whose replicas can drop out and rejoin keep it."""

    def close(self) -> None:
        """Release what the strategy holds beyond the process group (torchft's servers)."""

    def optimizer(self, net: nn.Module, kind: str = "adamw", **hyper) -> torch.optim.Optimizer:
        return OPTIMIZERS[kind](net.parameters(), **optimizer_hyper(kind, hyper))

    def local_optimizer(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer whose state this rank holds (its own partition under ZeRO-1)."""
        return opt

    def no_sync(self, model: nn.Module):
        return contextlib.nullcontext()

    def clip_grad_norm(self, params: list, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm and return it (the same number on every rank)."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def full_state_dict(self, state: dict) -> dict:
        """Whole tensors on the CPU (a collective under sharding: every rank must call it)."""
        return {k: v.detach().cpu() for k, v in state.items()}

    def check_consistency(self, net: nn.Module) -> None:
        """Every rank holds the same weights (replicated strategies only); raises if not."""


class DDPStrategy(Strategy):
    name = "ddp"
    several_ranks = True

    def wrap(self, net: nn.Module) -> nn.Module:
        net = super().wrap(net)
        device_ids = [self.world.device.index] if self.world.device.type == "cuda" else None
        ddp = DistributedDataParallel(net, device_ids=device_ids, process_group=self.world.group)
        ddp.register_comm_hook(self, _averaging_hook(self.compression))
        return ddp

    def no_sync(self, model: nn.Module):
        return model.no_sync()

    def check_consistency(self, net: nn.Module) -> None:
        # Two different sums per tensor: a rank that drifted cannot match both by accident.
        with torch.no_grad():
            sums = torch.stack([torch.stack([p.double().sum(), (p.double() * torch.arange(
                p.numel(), dtype=torch.float64, device=p.device).reshape(p.shape).sin()).sum()])
                for p in net.parameters()])
        low, high = sums.clone(), sums.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.world.group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.world.group)
        if not torch.equal(low, high):
            names = [n for (n, _), differs in zip(net.named_parameters(), (low != high).any(1), strict=True) if differs]
            raise RuntimeError(f"ranks hold different weights after a checkpoint: {', '.join(names[:5])}")


WIRE_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}

def averaged(tensors: list[torch.Tensor], ledger: Ledger, group, size: int, wire: torch.dtype | None = None,
             collective: str = "all_reduce", weight: float | None = None) -> list[torch.Tensor]:
    """The mean over the `size` ranks of `group` of `tensors` (weighted: the sum of each rank's tensors times its
    `weight`), sent as one flat all-reduce (in `wire`, if given) and counted in `ledger` under `collective`; new
    tensors shaped like them."""
    flat = torch.cat([t.detach().flatten() for t in tensors])
    flat = flat if weight is None else flat * weight
    payload = flat if wire is None else flat.to(wire)
    ledger.record(collective, payload.numel() * payload.element_size(), size)
    dist.all_reduce(payload, group=group)
    mean = payload.to(flat.dtype) / (size if weight is None else 1)
    return [m.view_as(t) for m, t in zip(mean.split([t.numel() for t in tensors]), tensors, strict=True)]


# train.optimizer: AdamW, or plain SGD (no momentum), whose averaged steps make local SGD at H = 1 exactly DDP
OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def optimizer_hyper(kind: str, hyper: dict) -> dict:
    return hyper if kind == "adamw" else {k: v for k, v in hyper.items() if k != "betas"}


def _averaging_hook(compression: str):
    """A DDP comm hook: average the bucket over ranks, optionally sent in 16 bits, and count the bytes.

    torch's bf16_compress_hook requires CUDA, and its fp16 one does not report traffic, so both are
    written here: cast, all-reduce, divide, cast back into the bucket.
    """
    wire = WIRE_DTYPES[compression]

    def hook(strategy: Strategy, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        payload = buffer if wire is None else buffer.to(wire)
        strategy.ledger.record("all_reduce", payload.numel() * payload.element_size(), strategy.world.size)
        payload.div_(strategy.world.size)
        future = dist.all_reduce(payload, group=strategy.world.group, async_op=True).get_future()

        def unpack(fut):
            reduced = fut.value()[0]
            return reduced if wire is None else buffer.copy_(reduced)

        return future.then(unpack)

    return hook
