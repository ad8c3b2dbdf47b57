"""Training FLOPs of a run, counted by torch's flop counter on one step and multiplied out.

The step is replayed on a copy of the network on the meta device: shapes only, so it costs no compute,
draws no random numbers and leaves the real step (and its bits) alone. Activation checkpointing's
recomputation is counted, since it is compute the run pays for.
"""

import json
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from islands.nets import build_network
from islands.train.activation_checkpointing import checkpoint_blocks


def flops_per_image(cfg, shape: tuple, num_classes: int, objective, micro_batch: int) -> float:
    with torch.random.fork_rng(), torch.device("meta"):
        net = build_network(cfg.model, shape, num_classes)
    if cfg.train.activation_checkpointing:
        checkpoint_blocks(net)
    x = torch.zeros(micro_batch, *shape, device="meta")
    labels = torch.zeros(micro_batch, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter, torch.random.fork_rng():
        objective(net, x, labels, torch.arange(micro_batch)).mean().backward()
    return counter.get_total_flops() / micro_batch


def write_flops(run_dir: Path, per_image: float, images: int) -> dict:
    record = {"flops_per_image": per_image, "images": images, "training_flops": per_image * images,
              "counted_by": "torch.utils.flop_counter.FlopCounterMode on one step (forward and backward)"}
    (Path(run_dir) / "flops.json").write_text(json.dumps(record, indent=1))
    return record
