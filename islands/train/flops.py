"""Training FLOPs of a run, counted by torch's flop counter on one step and multiplied out.

The step is replayed on a copy of the network on the meta device: shapes only, so it costs no compute,
draws no random numbers and leaves the real step (and its bits) alone. An objective that cannot run on
shapes alone (distillation asks its teacher which experts to run) is replayed once on real zeros instead,
still on a copy and with the random state restored. Activation checkpointing's recomputation is counted,
since it is compute the run pays for.
"""

import copy
from pathlib import Path
from typing import ClassVar

import torch
from torch.utils.flop_counter import FlopCounterMode

from islands.conditions import network_spec
from islands.data.batch import Batch
from islands.nets import build_network
from islands.nets.condition import PackedCaption
from islands.parallel.activation_checkpointing import checkpoint_blocks
from islands.rundir import Record


def flops_per_image(model, shape: tuple, num_classes: int, objective, micro_batch: int, device="cpu",
                    checkpointing: bool = False) -> float:
    """FLOPs of one training step of the network `model` (a model config) per image, at micro-batch `micro_batch`,
    with activation checkpointing's recomputation if `checkpointing`."""
    replay = (model, shape, num_classes, objective, micro_batch, checkpointing)
    try:
        return _replay(*replay, torch.device("meta"))
    except (RuntimeError, NotImplementedError):  # an op without a meta kernel: count on real tensors instead
        return _replay(*replay, torch.device(device))


def _replay(model, shape, num_classes, objective, micro_batch, checkpointing, device) -> float:
    with torch.random.fork_rng():
        with device:
            net = build_network(network_spec(model, shape, num_classes))
        if checkpointing:
            checkpoint_blocks(net)
        objective = copy.copy(objective)  # prepared for this copy of the network, the caller's left as it was
        objective.prepare(net)
        x = torch.zeros(micro_batch, *shape, device=device)
        zeros = torch.zeros(micro_batch, dtype=torch.long, device=device)  # class 0, cluster 0
        # a caption of the most tokens, which cross-attention is priced at
        cond = net.condition.placeholder(micro_batch, device) if isinstance(net.condition, PackedCaption) else zeros
        with FlopCounterMode(display=False) as counter:
            objective(net, Batch(x, cond, torch.arange(micro_batch), cluster=zeros)).mean().backward()
    return counter.get_total_flops() / micro_batch


class FlopsRecord(Record):
    """RUN/flops.json: the network's training FLOPs per image and, in a latent run that encodes its images as it goes,
    the encoder's forward per image (`DataSpace.flops_per_image`), which the run pays for too (counted in both)."""

    FILE: ClassVar[str] = "flops.json"
    flops_per_image: float
    images: int
    training_flops: float
    counted_by: str = "torch.utils.flop_counter.FlopCounterMode on one step (forward and backward)"
    encoder_flops_per_image: float = 0.0

    @classmethod
    def of(cls, run_dir: Path) -> "FlopsRecord | None":
        """The run's record; None where it has none yet."""
        path = Path(run_dir) / cls.FILE
        return cls.read(path) if path.exists() else None


def write_flops(run_dir: Path, per_image: float, images: int, encoder: float = 0.0) -> FlopsRecord:
    """RUN/flops.json (FlopsRecord)."""
    per_image += encoder
    record = FlopsRecord(flops_per_image=per_image, images=images, training_flops=per_image * images,
                         encoder_flops_per_image=encoder)
    record.write(Path(run_dir) / FlopsRecord.FILE)
    return record
