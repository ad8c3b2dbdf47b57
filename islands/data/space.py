"""The space the network works in, seen from the data: the one seam between the examples a source reads and what the
objective trains on, and between the samples a sampler draws and the pictures, metrics and samples.npz people see.

Pixels: both ways the identity. An autoencoder's latents (latent diffusion, `data.autoencoder`) are another
`DataSpace`, islands/train/latents.py's `LatentStage`: `encode` maps a batch of examples to latents before the
objective (or a source reads latents precomputed, and `encode` stays the identity), `decode` maps samples back to
images before anything looks at them.
"""

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from islands.data.batch import Batch
from islands.data.sources import Source


@dataclass(frozen=True)
class DataSpace:
    """The identity: the network works on the examples themselves."""

    name: str = "pixels"

    def example_shape(self, shape: tuple) -> tuple:
        """The shape of one example as the network sees it, from the data's."""
        return tuple(shape)

    def encode(self, batch: Batch) -> Batch:
        """The batch as the objective trains on it. (An encoder that changes the examples' shape drops the noise the
        loader drew for the old shape, `noise=None`: the objective then draws it from the positions, `Batch.drawn`.)"""
        return batch

    def loader_flip(self, flip: bool | None) -> bool | None:
        """The horizontal flip the loader applies (data.flip; None: the source's own); a space whose examples hold
        their flips (stored latents) picks them itself, and the loader flips nothing."""
        return flip

    # A space in which the loader's noise has the wrong shape does not have the loader draw it (the objective draws
    # it from the positions at the shape it trains on, `Batch.drawn`).
    loader_draws: ClassVar[bool] = True

    def flops_per_image(self, shape: tuple) -> float:
        """FLOPs spent on each training example of `shape` before the objective (an encoder's forward): none."""
        return 0.0

    def examples_of(self, x: Tensor) -> Tensor:
        """A batch as the source holds it -> the examples without noise (what a partition clusters by their
        'pixels'): themselves; for stored latents, their posterior means."""
        return x

    def images_of(self, x: Tensor) -> Tensor:
        """A batch as the source holds it -> images: themselves; for stored latents, their posterior means decoded."""
        return x

    def reference(self, source: Source) -> Source:
        """The images the run's samples are judged against (metrics): the data's examples; for stored latents, the
        images their posterior means decode to."""
        return source

    def decode(self, samples: Tensor) -> Tensor:
        """Samples in the data's own space, for pictures, metrics and samples.npz."""
        return samples


PIXELS = DataSpace()
