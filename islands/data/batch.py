"""A rank's share of a global batch, as the loader hands it to the training loop: the examples, their condition, their
positions in the global stream, the randomness those positions key (DESIGN.md section 3) and, for a router or a
student of an ensemble, each example's cluster.

The condition is whatever the network is conditioned on: today a class index (int64 (B,), -1 where the data has
none); a network's condition module (islands/nets/condition.py) embeds it and drops it, so nothing between the
loader and the network needs to know its kind.

The loader draws each example's horizontal flip, its noise (at the shape the network sees: the data space's) and the
uniforms behind its time and condition dropout where it reads the example, in its worker processes when
`data.workers` > 0, so that the training step does not wait on one CPU generator per example; the data space applies
the flip as it maps the examples into its space, and the objective maps the uniforms to its time and dropped
condition. A batch built without them (a probe, a FLOP count, a test) is drawn from its positions on first use, to the
same values.
"""

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from islands.data import streams


@dataclass(frozen=True)
class Batch:
    x: Tensor  # (B, *shape) the examples, in [-1, 1]
    condition: Tensor  # (B, ...) what the network is conditioned on: an int64 class, -1 where the data has none
    positions: Tensor  # (B,) int64 stream positions; they stay on the host, where the generators they key are
    noise: Tensor | None = None  # (B, *shape) standard normal, keyed (seed, n, "noise")
    u_time: Tensor | None = None  # (B,) uniform in [0, 1), keyed "time": the objective's time sampler maps it to t
    u_drop: Tensor | None = None  # (B,) uniform in [0, 1), keyed "label_drop": dropped where u_drop < label_dropout
    cluster: Tensor | None = None  # (B,) int64: the example's cluster of the partition (a router's target)
    flip: Tensor | None = None  # (B,) bool, keyed "flip": flipped where true, by the data space (then None)

    def drawn(self, seed: int, conditioned: bool = True, shape: tuple | None = None) -> "Batch":
        """This batch with its examples' noise (of `shape`, by default its examples') and uniforms (the condition-drop
        ones only if `conditioned`), those it does not hold yet drawn from their positions, on the CPU as the loader
        draws them."""
        noise, drop = self.noise is None, conditioned and self.u_drop is None
        if not (noise or drop):
            return self
        pos, draws = self.positions.tolist(), {}
        if noise:
            draws["noise"] = streams.normal(seed, pos, tuple(shape or self.x.shape[1:]))
            draws["u_time"] = streams.uniform(seed, pos, "time")
        if drop:
            draws["u_drop"] = streams.uniform(seed, pos, "label_drop")
        return replace(self, **draws)

    def tensors(self) -> dict[str, Tensor]:
        """The fields that hold a tensor, by name."""
        return {field.name: value for field in fields(self) if (value := getattr(self, field.name)) is not None}

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """On `device`, but for the positions."""
        return replace(self, **{name: t.to(device, non_blocking=non_blocking)
                                for name, t in self.tensors().items() if name != "positions"})

    def pin_memory(self) -> "Batch":
        """In page-locked memory, for an asynchronous copy to a GPU (a DataLoader with pin_memory=True calls it)."""
        return replace(self, **{name: t.pin_memory() for name, t in self.tensors().items() if name != "positions"})

    def rows(self, index: Tensor | slice) -> "Batch":
        """The examples `index` selects (a slice, a boolean mask or indices), each with its position and draws."""
        on_host = index.cpu() if isinstance(index, Tensor) else index
        return replace(self, **{name: t[on_host if name == "positions" else index]
                                for name, t in self.tensors().items()})

    def chunk(self, parts: int) -> list["Batch"]:
        """`parts` micro-batches (torch.chunk's sizes), each example keeping its position and draws."""
        pieces = {name: t.chunk(parts) for name, t in self.tensors().items()}
        return [replace(self, **{name: p[i] for name, p in pieces.items()}) for i in range(len(pieces["x"]))]

    def flipped(self) -> Tensor:
        """The examples, each mirrored (last axis) where its flip says so."""
        if self.flip is None:
            return self.x
        return torch.where(self.flip.reshape(-1, *([1] * (self.x.dim() - 1))), self.x.flip(-1), self.x)

    @staticmethod
    def cat(batches: list["Batch"]) -> "Batch":
        """Micro-batches joined again, in order."""
        return replace(batches[0], **{name: torch.cat([b.tensors()[name] for b in batches])
                                      for name in batches[0].tensors()})
