"""Replicas: what happens between the copies of a network that train apart and meet every few steps (torchtitan's
FT manager). Plain data parallelism has one copy of the weights after every step, so nothing happens here; local SGD
and DiLoCo (local_updates.py), through torchft between separate jobs (fault_tolerance.py), synchronise here.
"""

import torch
from torch import nn


class Replicas:
    """One set of weights, the same after every optimizer step: nothing to synchronise and nothing to share."""

    joined: int | None = None  # the image count a replica that rejoined its peers took from them at this step
    link = None  # torchft's exchange with replicas that are other jobs (fault_tolerance.ReplicaLink), if any

    def attach(self, net: nn.Module) -> None:
        """Called once the layout has wrapped `net` (whose weights are then the same on every rank of a replica)."""

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The inner optimizer, whose state a synchronisation may reset."""

    def before_step(self, params: list[torch.Tensor], images: int) -> None:
        """Called between the backward pass and the optimizer step, with the images consumed before this step (the
        gradients may be averaged over the replicas here)."""

    def after_step(self, images: int, last: bool = False) -> int | None:
        """Called after every optimizer step, with the images consumed so far and whether it was the run's last (an
        outer step may happen here). -> the images the EMA takes in now: None for this step's, since the weights
        are the model's after every step; 0 while they are only a replica's own."""
        return None

    def ema_weights(self) -> dict[str, torch.Tensor] | None:
        """The weights the EMA takes in, by parameter name, where they are not the network's own (None)."""
        return None

    def share(self, name: str, get, load) -> None:
        """State that a replica rejoining the others later must be sent with the weights (the EMA): `get()` gives
        it, `load(state)` takes it in. Only replicas that can drop out and rejoin keep it."""

    def close(self) -> None:
        """Release what the replicas hold beyond the process group (torchft's servers)."""
