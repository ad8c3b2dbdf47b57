"""Parallel strategies: each is four parts with narrow interfaces, as torchtitan splits its trainer's parallelism,
and the formulas of what it costs.

layout      how the network is wrapped and stepped: wrap, forward/backward, clip, optimizer (layout.py)
data        which stream positions this rank reads (data_plan.py)
replicas    what happens between copies that train apart: local updates, torchft, EMA sharing (replicas.py)
checkpoint  how this rank's state sits in the sharded checkpoint (checkpoint_layout.py)
costs       the bytes it sends per step and the state it holds, for the ledger's tests and `islands plan` (costs.py)

none   one process.
ddp    data parallel (DistributedDataParallel), optional fp16/bf16 gradient compression.
zero1, zero2, fsdp  sharding (sharding.py); pipeline  stages on different ranks (pipeline.py); local_sgd, diloco
       replicas that synchronise every few steps (local_updates.py). Each is imported only by the runs that choose
       it (build.py).

The trainer calls the parts, never a strategy's name: a new strategy is a new class here, not a branch elsewhere.
"""

from torch import nn

from islands.config import Config
from islands.parallel.checkpoint_layout import CheckpointLayout
from islands.parallel.costs import WIRE_BYTES, Costs, ddp_buckets, dense_bytes
from islands.parallel.data_plan import DataPlan
from islands.parallel.launch import World
from islands.parallel.layout import DataParallel, Layout
from islands.parallel.ledger import Ledger, bytes_sent
from islands.parallel.replicas import Replicas


class Strategy:
    """Single process: the identity layout (but for checkpointing and compilation), one data share, one replica,
    the checkpoint as held."""

    name = "none"
    # What build_strategy's checks across strategies ask of each: whether it spans several ranks (a process
    # group), whether it can run inside a group of ranks (tstages), whether fp16 loss scaling works under it.
    several_ranks = False
    in_a_group = True
    fp16 = True
    layout_class = Layout  # how this strategy wraps and steps the network
    costs = Costs()

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

    def __init__(self, world: World, compression: str = "none", precision: str = "fp32", compile: bool = False,
                 activation_checkpointing: bool = False):
        self.world = world
        self.ledger = Ledger(world.size)
        self.layout = self.layout_class(world, self.ledger, compression, precision, compile, activation_checkpointing)
        self.data = DataPlan(world.rank, world.size)
        self.replicas = Replicas()
        self.checkpoint = CheckpointLayout()

    @property
    def communicates(self) -> bool:
        """Whether this rank sends anything (its traffic is then logged)."""
        return self.world.distributed or self.replicas.link is not None

    def parallelize(self, net: nn.Module) -> nn.Module:
        """Wrap `net` (torchtitan's `parallelize`) and hand it to the replicas; -> what the trainer's step calls."""
        model = self.layout.wrap(net)
        self.replicas.attach(net)
        return model


class ReplicatedCosts(Costs):
    """ddp: each rank all-reduces the gradients (in `compression`'s width), one message per DDP bucket."""

    def bytes_per_step(self, net: nn.Module, world: int, accumulate: int = 1, compression: str = "none",
                       precision: str = "fp32", sync_every: int = 1, replicas: int | None = None) -> dict[str, float]:
        wire = WIRE_BYTES[compression] / 4
        return {"all_reduce": bytes_sent("all_reduce", dense_bytes(net.parameters()) * wire, world)}

    def messages(self, net: nn.Module, accumulate: int = 1) -> dict[str, int]:
        return {"all_reduce": ddp_buckets(net)}


class DDPStrategy(Strategy):
    name = "ddp"
    several_ranks = True
    layout_class = DataParallel
    costs = ReplicatedCosts()
