"""Bytes each rank sends per optimizer step, by collective, predicted from the parameter shapes alone.

These are the formulas the ledger's counts are tested against (tests/test_parallel.py, test_local_updates.py,
test_pipeline.py) and the ones `islands plan` prices, so a plan's bytes are the bytes a run books. Each collective's
per-rank traffic is the ring algorithm's (islands/parallel/ledger.py).
"""

import copy

import torch
from torch import nn

from islands.config import LOCAL_UPDATES
from islands.parallel.ledger import bytes_sent

WIRE_BYTES = {"none": 4, "fp16": 2, "bf16": 2}  # bytes of one fp32 value sent as parallel.compression says
LOCAL = LOCAL_UPDATES  # the strategies whose replicas synchronise every few steps


def dense_bytes(params) -> int:
    """fp32 bytes of the parameters."""
    return 4 * sum(p.numel() for p in params)


def sharded_bytes(params, world: int) -> int:
    """fp32 bytes of the parameters as FSDP2 shards them: along dim 0, padded to a multiple of the world size."""
    return 4 * sum(-(-p.shape[0] // world) * world * (p.numel() // max(p.shape[0], 1)) for p in params)


def bytes_per_step(strategy: str, net: nn.Module, world: int, accumulate: int = 1, compression: str = "none",
                   precision: str = "fp32", sync_every: int = 1, replicas: int | None = None) -> dict[str, float]:
    """Bytes one rank sends per optimizer step, by ledger collective, for `strategy` over `world` ranks.

    ddp and zero1 all-reduce the gradients (in `compression`'s width); zero1 then broadcasts each rank's updated
    partition, which adds up to one all-gather of the fp32 parameters. FSDP (zero2) gathers every block in forward
    and again in backward (once per micro-batch) and the root once, in bf16 when training in bf16, and
    reduce-scatters each unit's gradients once per step. The local strategies send one all-reduce of the parameters
    (local_sgd, fp32) or of their change (diloco, in `compression`'s width) over the R replicas every `sync_every`
    steps, averaged here per step. When each replica is a group of G ranks, every rank all-reduces a G-th of the
    flat parameters (padded to a multiple of G) with its counterparts and the group all-gathers the pieces in fp32,
    and the inner DDP all-reduces the gradients every step."""
    params = list(net.parameters())
    wire = WIRE_BYTES[compression] / 4
    if strategy in ("ddp", "zero1"):
        sent = {"all_reduce": bytes_sent("all_reduce", dense_bytes(params) * wire, world)}
        if strategy == "zero1":
            sent["broadcast"] = bytes_sent("broadcast", dense_bytes(params), world)
        return sent
    if strategy in ("zero2", "fsdp"):
        blocks = sharded_bytes([p for b in net.blocks for p in b.parameters()], world)
        everything = sharded_bytes([p for n, p in net.named_parameters() if not n.startswith("blocks.")],
                                   world) + blocks
        gathered = (everything + (blocks if strategy == "fsdp" else 0)) * (0.5 if precision == "bf16" else 1)
        return {"all_gather": bytes_sent("all_gather", accumulate * gathered, world),
                "reduce_scatter": bytes_sent("reduce_scatter", everything * wire, world)}
    if strategy in LOCAL:
        replicas = replicas or world
        per = world // replicas  # ranks per replica; each exchanges 1/per of the (padded) flat parameters
        numel = sum(p.numel() for p in params)
        piece = -(-numel // per)
        outer = 4 * piece * (wire if strategy == "diloco" else 1)
        sent = {"outer_all_reduce": bytes_sent("outer_all_reduce", outer, replicas) / sync_every}
        if per > 1:
            sent["all_reduce"] = bytes_sent("all_reduce", dense_bytes(params), per)
            sent["all_gather"] = bytes_sent("all_gather", 4 * piece * per, per) / sync_every
        return sent
    raise ValueError(f"parallel.strategy: no byte formula for {strategy!r}")


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
