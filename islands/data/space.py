"""The space the network works in, seen from the data: the one seam between the examples a source reads and what the
objective trains on, and between the samples a sampler draws and the pictures, metrics and samples.npz people see.

Pixels: both ways the identity (but for the flips the loader drew, which `encode` applies). An autoencoder's latents
(latent diffusion, `data.autoencoder`) are another `DataSpace`, islands/data/latents.py's `LatentStage`: `encode`
maps a batch of (flipped) images to latents before the objective, or picks and draws the stored latent of each image
or of its flip (`StoredLatents`), and `decode` maps samples back to images before anything looks at them.
"""

from dataclasses import dataclass, replace

import torch
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
        """The batch as the objective trains on it: here its examples, each flipped where the loader's draw says, and
        a condition laid out as the example (a low-resolution image of it) flipped with it."""
        condition = batch.condition
        if batch.flip is not None and condition.dim() == batch.x.dim():
            condition = torch.where(batch.flip.reshape(-1, *([1] * (condition.dim() - 1))), condition.flip(-1),
                                    condition)
        return replace(batch, x=batch.flipped(), condition=condition, flip=None)

    def flips(self, flip: bool | None, source_flips: bool) -> bool:
        """Whether examples are flipped (data.flip; None: the source's own default): what the loader draws a flip
        for, and `encode` applies."""
        return source_flips if flip is None else flip

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
