"""What a strategy costs, predicted from the parameter shapes alone: the bytes each rank sends per optimizer step,
by ledger collective, and the state each accelerator holds per parameter.

Each strategy owns its formulas (a `Costs` beside its class, `Strategy.costs`); these are the pieces they share.
They are the formulas the ledger's counts are tested against (tests/test_parallel.py, test_local_updates.py,
test_pipeline.py) and the ones `islands plan` prices, so a plan's bytes are the bytes a run books. Each collective's
per-rank traffic is the ring algorithm's (islands/parallel/ledger.py).
"""

import copy
import math

import torch
from torch import nn

from islands.config import LOCAL_UPDATES

WIRE_BYTES = {"none": 4, "fp16": 2, "bf16": 2}  # bytes of one fp32 value sent as parallel.compression says
LOCAL = LOCAL_UPDATES  # the strategies whose replicas synchronise every few steps
BUCKET = 25 * 2**20  # DDP's default bucket


class Costs:
    """A single process: it sends nothing, and holds fp32 weights, gradients and AdamW's two moments."""

    plan_compression = "none"  # the parallel.compression `islands plan` prices it with
    # whether its layout does host work each step that no collective accounts for (hooks, DTensor bookkeeping),
    # which `islands plan --network this-machine` measures on one rank and adds to the step (plan/this_machine.py)
    host_overhead = False

    def bytes_per_step(self, net: nn.Module, world: int, accumulate: int = 1, compression: str = "none",
                       precision: str = "fp32", sync_every: int = 1, replicas: int | None = None) -> dict[str, float]:
        """Bytes one rank sends per optimizer step, by ledger collective, over `world` ranks."""
        return {}

    def state_bytes(self, world: int) -> float:
        """Bytes each accelerator holds per parameter: weights, gradients, AdamW's moments (and what else it keeps)."""
        return 16.0

    def copied_bytes(self, net: nn.Module, world: int, accumulate: int = 1, precision: str = "fp32") -> float:
        """Bytes one rank copies in memory per step around its collectives, beyond what the collectives do."""
        return 0.0

    def messages(self, net: nn.Module, accumulate: int = 1) -> dict[str, int]:
        """How many messages each collective of a step is issued as (each pays the link's latency); a kind with no
        bytes in `bytes_per_step` is a call of a few values (latency only)."""
        return {}


def dense_bytes(params) -> int:
    """fp32 bytes of the parameters."""
    return 4 * sum(p.numel() for p in params)


def sharded_bytes(params, world: int) -> int:
    """fp32 bytes of the parameters as FSDP2 shards them: along dim 0, padded to a multiple of the world size."""
    return 4 * sum(-(-p.shape[0] // world) * world * (p.numel() // max(p.shape[0], 1)) for p in params)


def ddp_buckets(net: nn.Module) -> int:
    """The all-reduces DDP issues per step: one per bucket."""
    return max(1, math.ceil(dense_bytes(net.parameters()) / BUCKET))


def carry_bytes(net: nn.Module, batch: int, stop: int) -> int:
    """Bytes of what a pipeline stage ending before block `stop` sends forward for `batch` examples (fp32): the
    carried tuple out of blocks [0, stop). Its gradient travels back at the same size. Counted on the meta device."""
    if next(net.parameters()).device.type != "meta":
        net = copy.deepcopy(net).to("meta")  # Module.to works in place
    x = torch.zeros(batch, *net.input_shape, device="meta")
    with torch.no_grad():  # no condition: its embedding's "none" is the same size as any other
        carry = net.stem(x, torch.zeros(batch, device="meta"))
        for i in range(stop):
            carry = net.block_forward(i, carry)
    return sum(c.numel() * c.element_size() for c in carry)
