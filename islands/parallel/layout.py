"""The parallel layout: how a built network is wrapped and stepped across ranks (torchtitan's `parallelize`).

A layout wraps the network from outside (activation checkpointing, then torch.compile, then sharding: torchtitan's
order), owns the forward and backward of one optimizer step, clips by the global gradient norm, makes the optimizer
and gathers whole tensors. It knows nothing of which examples a rank reads (data_plan.py), of replicas that
synchronise every few steps (replicas.py) or of how a checkpoint is laid out (checkpoint_layout.py).

Layout        one process: wrapping is the identity (but for checkpointing and compilation).
DataParallel  DistributedDataParallel, optional fp16/bf16 gradient compression (ddp, and a replica's ranks).
(ZeRO-1 and FSDP live in sharding.py, the pipeline in pipeline.py.)

Every layout counts its traffic in the strategy's `Ledger`, where the collective is issued.
"""

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from islands.config import TrainConfig
from islands.data.batch import Batch
from islands.parallel.activation_checkpointing import checkpoint_blocks
from islands.parallel.launch import World
from islands.parallel.ledger import Ledger

WIRE_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}

# train.optimizer: AdamW, or plain SGD (no momentum), whose averaged steps make local SGD at H = 1 exactly DDP
OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def optimizer_hyper(kind: str, hyper: dict) -> dict:
    return hyper if kind == "adamw" else {k: v for k, v in hyper.items() if k != "betas"}


def compile_blocks(net: nn.Module) -> None:
    """torch.compile each block in place, after activation checkpointing and before sharding (torchtitan's order):
    the blocks repeat, so one compiled graph serves them all, and their state-dict keys stay the same."""
    for block in net.blocks:
        block.compile(dynamic=False)


class Layout:
    """One process: nothing to synchronise."""

    def __init__(self, world: World, ledger: Ledger, compression: str = "none", precision: str = "fp32",
                 compile: bool = False, activation_checkpointing: bool = False):
        self.world, self.ledger = world, ledger
        self.compression, self.precision = compression, precision
        self.compile, self.activation_checkpointing = compile, activation_checkpointing

    def check_training(self, train: TrainConfig) -> None:
        """Refuse training settings this layout cannot run, once every rank has built it."""

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

    def no_sync(self, model: nn.Module):
        """Hold back the gradients' synchronisation (every micro-batch but the last)."""
        return contextlib.nullcontext()

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

    def clip_grad_norm(self, params: list, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm and return it (the same number on every rank)."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def optimizer(self, net: nn.Module, kind: str = "adamw", **hyper) -> torch.optim.Optimizer:
        return OPTIMIZERS[kind](net.parameters(), **optimizer_hyper(kind, hyper))

    def full_state_dict(self, state: dict) -> dict:
        """Whole tensors on the CPU (a collective under sharding: every rank must call it)."""
        return {k: v.detach().cpu() for k, v in state.items()}

    def check_consistency(self, net: nn.Module) -> None:
        """Every rank holds the same weights (replicated layouts only); raises if not."""


class DataParallel(Layout):
    """DistributedDataParallel over the world's group, its buckets averaged by our own hook (which counts them)."""

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


def _averaging_hook(compression: str):
    """A DDP comm hook: average the bucket over ranks, optionally sent in 16 bits, and count the bytes.

    torch's bf16_compress_hook requires CUDA, and its fp16 one does not report traffic, so both are
    written here: cast, all-reduce, divide, cast back into the bucket.
    """
    wire = WIRE_DTYPES[compression]

    def hook(layout: Layout, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        payload = buffer if wire is None else buffer.to(wire)
        layout.ledger.record("all_reduce", payload.numel() * payload.element_size(), layout.world.size)
        payload.div_(layout.world.size)
        future = dist.all_reduce(payload, group=layout.world.group, async_op=True).get_future()

        def unpack(fut):
            reduced = fut.value()[0]
            return reduced if wire is None else buffer.copy_(reduced)

        return future.then(unpack)

    return hook
