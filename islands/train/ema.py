"""Exponential moving average of the weights with its half-life counted in images (Karras et al. 2022).

beta = 0.5 ** (batch / half_life), and during ramp-up half_life <= rampup * images_seen, so early
averages do not drag in the random initialisation. Counting in images keeps the average the same
whatever the number of ranks or the accumulation count; the count itself is the run's image clock,
which every checkpoint keeps.

The average is a list of tensors shaped like the network's parameters, made after the network was
sharded: under FSDP each rank averages only its own shards, and the full copy exists only when
gathered for a checkpoint or for sampling.
"""

import torch
from torch import nn


class EMA:
    def __init__(self, net: nn.Module, halflife_images: float, rampup: float | None = 0.05):
        self.halflife, self.rampup = halflife_images, rampup
        self.params = {name: p.detach().clone() for name, p in net.named_parameters()}
        saved = net.state_dict().keys()  # persistent buffers only, as the network's own state dict
        self.buffers = {name: b.detach().clone() for name, b in net.named_buffers() if name in saved}

    def beta(self, images_seen: int, batch: int) -> float:
        halflife = self.halflife
        if self.rampup is not None:
            halflife = min(halflife, images_seen * self.rampup)
        return 0.5 ** (batch / max(halflife, 1e-8))

    @torch.no_grad()
    def update(self, net: nn.Module, images_seen: int, batch: int,
               weights: dict[str, torch.Tensor] | None = None) -> None:
        """Blend in the weights after an optimizer step (`weights` by name in place of the net's parameters: the
        synchronised copy a strategy keeps); images_seen counts that step's images."""
        weight = 1.0 - self.beta(images_seen, batch)
        for name, p in (weights or dict(net.named_parameters())).items():
            self.params[name].lerp_(p.detach(), weight)
        for name, b in net.named_buffers():
            if name in self.buffers:
                self.buffers[name].copy_(b)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Keyed like the network's own state dict, so it loads into a plain copy of the network."""
        return {**self.params, **self.buffers}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        held = self.state_dict()
        for name, value in state.items():
            held[name].copy_(value)
