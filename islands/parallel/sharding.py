"""The sharding strategies: ZeRO-1 (optimizer state), ZeRO-2 and FSDP2 (gradients and parameters too), their layouts
and their formulas. Apart from islands/parallel/strategies.py because their torch modules take a second to import,
which every other run (and every process of a test suite) would otherwise pay."""

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from islands.parallel.checkpoint_layout import CheckpointLayout
from islands.parallel.costs import WIRE_BYTES, Costs, dense_bytes, sharded_bytes
from islands.parallel.launch import World
from islands.parallel.layout import OPTIMIZERS, WIRE_DTYPES, DataParallel, Layout, optimizer_hyper
from islands.parallel.ledger import Ledger, bytes_sent
from islands.parallel.strategies import DDPStrategy, ReplicatedCosts, Strategy


class Zero1Layout(DataParallel):
    """Gradients all-reduced as in DDP; each rank keeps Adam's moments of its own parameters only,
    steps them, and broadcasts them to the others."""

    def optimizer(self, net: nn.Module, kind: str = "adamw", **hyper) -> torch.optim.Optimizer:
        ledger = self.ledger

        class CountingZero(ZeroRedundancyOptimizer):
            def step(self, *args, **kwargs):
                with _counting_broadcasts(ledger):
                    return super().step(*args, **kwargs)

        return CountingZero(net.parameters(), optimizer_class=OPTIMIZERS[kind], **optimizer_hyper(kind, hyper))


class ZeroPartition(CheckpointLayout):
    """A rank holds, and writes, the optimizer state of its own partition."""

    def local_optimizer(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return opt.optim


class Zero1Costs(ReplicatedCosts):
    """ddp's all-reduce, then each rank broadcasts its updated partition, one message per parameter: together one
    all-gather of the fp32 parameters. Each accelerator keeps the weights and gradients whole, the moments sharded."""

    def bytes_per_step(self, net: nn.Module, world: int, accumulate: int = 1, compression: str = "none",
                       precision: str = "fp32", sync_every: int = 1, replicas: int | None = None) -> dict[str, float]:
        sent = super().bytes_per_step(net, world, accumulate, compression)
        sent["broadcast"] = bytes_sent("broadcast", dense_bytes(net.parameters()), world)
        return sent

    def state_bytes(self, world: int) -> float:
        return 8 + 8 / world

    def messages(self, net: nn.Module, accumulate: int = 1) -> dict[str, int]:
        return {**super().messages(net), "broadcast": len(list(net.parameters()))}


class Zero1Strategy(DDPStrategy):
    name = "zero1"
    in_a_group = False  # its partitions span the whole job
    layout_class = Zero1Layout
    costs = Zero1Costs()

    def __init__(self, world: World, **options):
        super().__init__(world, **options)
        self.checkpoint = ZeroPartition()


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


class FSDPLayout(Layout):
    """`fully_shard` per block, then the root."""

    reshard_after_forward = True

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


class Zero2Layout(FSDPLayout):
    reshard_after_forward = False


class ShardedCosts(Costs):
    """FSDP gathers every block in forward (and, with `regather`, again in backward), once per micro-batch, and the
    root once, in bf16 when training in bf16, and reduce-scatters each unit's gradients once per step.

    Each gather and each reduce-scatter is one call per unit (FSDP2 packs a unit's parameters in one flat buffer),
    so a step pays a unit's latency several times where DDP pays one bucket's; the gradient norm of sharded
    gradients is one more all-reduce (of one value) a step. Around every call FSDP2 copies the unit in and out of
    its flat buffers (`copied_bytes`) and runs its hooks, and the optimizer, the norm and the EMA step DTensors:
    host work that `islands plan --network this-machine` measures on one rank (`host_overhead`; on one rank FSDP2
    gathers and scatters nothing, so its copies are priced apart, at the rate the machine copies)."""

    host_overhead = True

    def __init__(self, regather: bool):
        self.regather = regather

    def bytes_per_step(self, net: nn.Module, world: int, accumulate: int = 1, compression: str = "none",
                       precision: str = "fp32", sync_every: int = 1, replicas: int | None = None) -> dict[str, float]:
        wire = WIRE_BYTES[compression] / 4
        blocks = sharded_bytes([p for b in net.blocks for p in b.parameters()], world)
        everything = sharded_bytes([p for n, p in net.named_parameters() if not n.startswith("blocks.")],
                                   world) + blocks
        gathered = (everything + (blocks if self.regather else 0)) * (0.5 if precision == "bf16" else 1)
        return {"all_gather": bytes_sent("all_gather", accumulate * gathered, world),
                "reduce_scatter": bytes_sent("reduce_scatter", everything * wire, world)}

    def copied_bytes(self, net: nn.Module, world: int, accumulate: int = 1, precision: str = "fp32") -> float:
        # FSDP2 copies each unit's shards into the gather's flat buffer and the gathered buffer out into the
        # parameters (1/W + 1 of what is gathered), and the gradients into the reduce-scatter's buffer, then the
        # rank's averaged shard out (1 + 1/W of the gradients)
        blocks = sharded_bytes([p for b in net.blocks for p in b.parameters()], world)
        everything = sharded_bytes(net.parameters(), world)
        gathered = (everything + (blocks if self.regather else 0)) * (0.5 if precision == "bf16" else 1)
        return (1 + 1 / world) * (accumulate * gathered + everything)

    def state_bytes(self, world: int) -> float:
        # fsdp shards all of it; zero2 keeps the weights whole between forward and backward
        return 16 / world if self.regather else 4 + 12 / world

    def messages(self, net: nn.Module, accumulate: int = 1) -> dict[str, int]:
        blocks = len(net.blocks) if hasattr(net, "blocks") else 0
        # the root (needed first in backward) is not resharded after forward: only the blocks are gathered again
        gathers = blocks + 1 + (blocks if self.regather else 0)
        return {"all_gather": gathers * accumulate, "reduce_scatter": blocks + 1, "all_reduce": 1}


class FSDPStrategy(Strategy):
    name = "fsdp"
    several_ranks = True
    in_a_group = False  # its mesh spans the whole job
    fp16 = False  # GradScaler would find infinities in each rank's shard separately and let the scales drift apart
    layout_class = FSDPLayout
    costs = ShardedCosts(regather=True)


class Zero2Strategy(FSDPStrategy):
    name = "zero2"
    layout_class = Zero2Layout
    costs = ShardedCosts(regather=False)


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
