"""Training that synchronises every H optimizer steps: local SGD and DiLoCo.

Every rank is a replica that steps its own copy of the network on its share of each global batch, with no
communication, and every `parallel.sync_every` = H optimizer steps (counted on the run's image clock, so a resumed
run keeps its place in the cycle) the replicas are brought back together:

local_sgd  the parameters are averaged (Lin et al. 2020, "Don't use large mini-batches, use local SGD").
diloco     the averaged change since the last synchronisation, the pseudo-gradient anchor - theta, is applied to
           the anchor by an outer SGD step with Nesterov momentum (Douillard et al. 2023, Algorithm 1: outer lr
           0.7, momentum 0.9), optionally sent in fp16 or bf16; every replica continues from the new anchor.

Between synchronisations the replicas differ, so each rank's own state (weights, inner optimizer, EMA) is saved
under its own name (`replica_<rank>`) and the outer state, the same on every rank, under `outer`; the EMA takes in
only synchronised weights, credited with the images since the last synchronisation, so it is the same on every
rank. The last step of a run synchronises too, so the exported weights are the replicas' common ones.
"""

import torch
from torch import nn

from islands.parallel.launch import World
from islands.parallel.strategies import WIRE_DTYPES, Strategy, averaged


class LocalSGDStrategy(Strategy):
    name = "local_sgd"

    def __init__(self, world: World, compression: str = "none", precision: str = "fp32", compile: bool = False,
                 activation_checkpointing: bool = False, sync_every: int = 100, batch_size: int = 1,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9):
        super().__init__(world, compression, precision, compile, activation_checkpointing)
        self.cycle = sync_every * batch_size  # the images between two synchronisations
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum  # diloco's
        self.net: nn.Module | None = None

    def wrap(self, net: nn.Module) -> nn.Module:
        self.net = super().wrap(net)
        return self.net

    def after_step(self, images: int, last: bool = False) -> int:
        """Synchronise at the end of each cycle and at the end of the run; -> the images since the last
        synchronisation if it happened now (what the EMA takes in), else 0."""
        if images % self.cycle and not last:
            return 0
        self.synchronise()
        return images - (images - 1) // self.cycle * self.cycle

    @torch.no_grad()
    def synchronise(self) -> None:
        params = list(self.net.parameters())
        for p, m in zip(params, averaged(params, self.ledger, self.world.group, self.world.size), strict=True):
            p.copy_(m)

    def checkpoint_layout(self, held: dict) -> dict:
        return {f"replica_{self.world.rank}": held}


class DiLoCoStrategy(LocalSGDStrategy):
    name = "diloco"

    def wrap(self, net: nn.Module) -> nn.Module:
        net = super().wrap(net)
        self.anchor = {name: p.detach().clone() for name, p in net.named_parameters()}
        self.outer = torch.optim.SGD(self.anchor.values(), lr=self.outer_lr, momentum=self.outer_momentum,
                                     nesterov=self.outer_momentum > 0)
        if self.outer_momentum > 0:  # created now so that a resume has tensors to load into; a zero buffer's
            for a in self.anchor.values():  # first step equals torch's first step from none
                self.outer.state[a]["momentum_buffer"] = torch.zeros_like(a)
        return net

    @torch.no_grad()
    def synchronise(self) -> None:
        params = list(self.net.parameters())
        anchors = list(self.anchor.values())
        deltas = [a - p for a, p in zip(anchors, params, strict=True)]
        for a, d in zip(anchors, averaged(deltas, self.ledger, self.world.group, self.world.size,
                                          WIRE_DTYPES[self.compression]), strict=True):
            a.grad = d
        self.outer.step()
        for a, p in zip(anchors, params, strict=True):
            a.grad = None
            p.copy_(a)

    def checkpoint_layout(self, held: dict) -> dict:
        momentum = {name: self.outer.state[a]["momentum_buffer"] for name, a in self.anchor.items()
                    if "momentum_buffer" in self.outer.state[a]}
        return {**super().checkpoint_layout(held), "outer": {"anchor": self.anchor, "momentum": momentum}}
