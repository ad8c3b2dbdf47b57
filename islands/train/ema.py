"""Exponential moving average of the weights with its half-life counted in images (Karras et al. 2022).

beta = 0.5 ** (batch / half_life), and during ramp-up half_life <= rampup * images_seen, so early
averages do not drag in the random initialisation. Counting in images keeps the average the same
whatever the number of ranks or the accumulation count.
"""

import copy

import torch
from torch import nn


class EMA:
    def __init__(self, net: nn.Module, halflife_images: float, rampup: float | None = 0.05):
        self.halflife, self.rampup = halflife_images, rampup
        self.net = copy.deepcopy(net).eval().requires_grad_(False)

    def beta(self, images_seen: int, batch: int) -> float:
        halflife = self.halflife
        if self.rampup is not None:
            halflife = min(halflife, images_seen * self.rampup)
        return 0.5 ** (batch / max(halflife, 1e-8))

    @torch.no_grad()
    def update(self, net: nn.Module, images_seen: int, batch: int) -> None:
        """Blend in the weights after an optimizer step; images_seen counts that step's images."""
        beta = self.beta(images_seen, batch)
        ema_params = list(self.net.parameters())
        params = [p.detach() for p in net.parameters()]
        torch._foreach_lerp_(ema_params, params, 1.0 - beta)
        for b_ema, b in zip(self.net.buffers(), net.buffers()):
            b_ema.copy_(b)
