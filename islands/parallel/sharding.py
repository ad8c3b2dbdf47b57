"""The sharding strategies: ZeRO-1 (optimizer state), ZeRO-2 and FSDP2 (gradients and parameters too). Apart
from islands/parallel/strategies.py because their torch modules take a second to import, which every other run
(and every process of a test suite) would otherwise pay."""

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from islands.parallel.ledger import Ledger
from islands.parallel.strategies import OPTIMIZERS, WIRE_DTYPES, DDPStrategy, Strategy, optimizer_hyper


class Zero1Strategy(DDPStrategy):
    """Gradients all-reduced as in DDP; each rank keeps Adam's moments of its own parameters only,
    steps them, and broadcasts them to the others."""

    name = "zero1"
    in_a_group = False  # its partitions span the whole job

    def optimizer(self, net: nn.Module, kind: str = "adamw", **hyper) -> torch.optim.Optimizer:
        ledger = self.ledger

        class CountingZero(ZeroRedundancyOptimizer):
            def step(self, *args, **kwargs):
                with _counting_broadcasts(ledger):
                    return super().step(*args, **kwargs)

        return CountingZero(net.parameters(), optimizer_class=OPTIMIZERS[kind], **optimizer_hyper(kind, hyper))

    def local_optimizer(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return opt.optim


@contextlib.contextmanager
def _counting_broadcasts(ledger: Ledger):
    """Count every `dist.broadcast` issued inside the block, at its real payload.

    ZeroRedundancyOptimizer.step (torch 2.x, without overlap_with_ddp) steps the local partition, then
    calls `dist.broadcast(param, src=owner)` once per parameter of every rank's partition (or once per
    rank's bucket with parameters_as_bucket_view): every rank takes part in each call, as sender or
    receiver. The ledger books a broadcast of n bytes as (W - 1) / W * n sent per rank, the traffic of a
    pipelined broadcast averaged over ranks. It has no hook of its own, so the module attribute it looks up
    is wrapped for the duration of the step only.
    """
    issue = dist.broadcast

    def counted(tensor, *args, **kwargs):
        ledger.record("broadcast", tensor.numel() * tensor.element_size())
        return issue(tensor, *args, **kwargs)

    dist.broadcast = counted
    try:
        yield
    finally:
        dist.broadcast = issue


class FSDPStrategy(Strategy):
    name = "fsdp"
    reshard_after_forward = True
    several_ranks = True
    in_a_group = False  # its mesh spans the whole job
    fp16 = False  # GradScaler would find infinities in each rank's shard separately and let the scales drift apart

    def wrap(self, net: nn.Module) -> nn.Module:
        net = super().wrap(net)
        # bf16 parameters for compute, fp32 reduction and fp32 master weights (torchtitan's default);
        # parallel.compression, if set, lowers the reduce-scatter's precision instead.
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if self.precision == "bf16" else None,
                                      reduce_dtype=WIRE_DTYPES[self.compression] or torch.float32)
        units = [*net.blocks, net]  # the root last, so it owns only what no block holds
        for unit in units:
            # None: blocks reshard after forward, the root (needed first in backward) stays gathered
            fully_shard(unit, mp_policy=policy, reshard_after_forward=None if self.reshard_after_forward else False)
        for unit in units:
            unit.set_custom_all_gather(_CountingAllGather(self.ledger))
            unit.set_custom_reduce_scatter(_CountingReduceScatter(self.ledger))
        return net

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def clip_grad_norm(self, params: list, max_norm: float) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def full_state_dict(self, state: dict) -> dict:
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in state.items()}


class Zero2Strategy(FSDPStrategy):
    name = "zero2"
    reshard_after_forward = False


class _CountingAllGather(DefaultAllGather):
    def __init__(self, ledger: Ledger):
        self.ledger = ledger

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.ledger.record("all_gather", output_tensor.numel() * output_tensor.element_size())
        return super().__call__(output_tensor, input_tensor, group, async_op)


class _CountingReduceScatter(DefaultReduceScatter):
    def __init__(self, ledger: Ledger):
        self.ledger = ledger

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.ledger.record("reduce_scatter", input_tensor.numel() * input_tensor.element_size())
        return super().__call__(output_tensor, input_tensor, group, op, async_op)
