"""`islands encode`: a data set's latents precomputed into shards (fast-DiT's and MosaicML's way), so that a run on
latents does not run the encoder at every step.

Each example becomes the posterior the autoencoder gives it, its `mean.npy` and `logvar.npy`, and, where the data
is flipped in training, those of its horizontal mirror image (`mean_flip.npy`, `logvar_flip.npy`): a flipped
latent is not the latent of the flipped image, so the flip is encoded, not applied afterwards. Stored as float32,
exactly what the encoder returned: a run samples its latent from them with the noise of its stream position, as the
on-the-fly latent stage does, and float16 would move the mean by up to 2^-11 of itself and the standard deviation,
exp(logvar / 2), by as much again (logvar reaches -30..20), for half the bytes. The manifest says which autoencoder
made them (the digest of its config and weights, its scale and shift) and the latents' shape; a run refuses another
autoencoder.
"""

import io

import numpy as np
import torch

from islands.data.shards import ExampleWriter
from islands.data.sources import Source
from islands.nets.autoencoder import Autoencoder


def npy_bytes(a: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, a.float().cpu().numpy(), allow_pickle=False)
    return buffer.getvalue()


class LatentWriter(ExampleWriter):
    """The members of each example: its posterior's mean and log-variance (and its flip's), encoded `batch_size`
    images at a time on the autoencoder's device; the flips' where `flip` (data.flip; None: the source's default)."""

    def __init__(self, source: Source, autoencoder: Autoencoder, batch_size: int, device="cpu",
                 flip: bool | None = None):
        self.autoencoder, self.batch_size, self.device = autoencoder, batch_size, device
        self.flipped = bool(source.flip if flip is None else flip)  # data.flip, else the source's own default
        latent = list(autoencoder.latent_shape(tuple(source.shape)))
        self.members = ["mean.npy", "logvar.npy", *(["mean_flip.npy", "logvar_flip.npy"] if self.flipped else [])]
        # what ShardSource hands the loader: the arrays stacked along the channels, never flipped by the loader
        # (the run's latent stage picks the flipped pair by the position-keyed flip)
        self.manifest = {"shape": [len(self.members) * latent[0], *latent[1:]], "flip": False, "x": "mean.npy",
                         "latents": {"autoencoder_sha256": autoencoder.sha256,
                                     "scaling_factor": autoencoder.scaling_factor,
                                     "shift_factor": autoencoder.shift_factor, "latent_shape": latent,
                                     "image_shape": list(source.shape), "flipped": self.flipped, "dtype": "float32"}}

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, captions: list[str] | None = None) -> list[dict[str, bytes]]:
        examples = []
        for part in x.split(self.batch_size):
            images = part.to(self.device)
            posteriors = [self.autoencoder.encode(images)]
            if self.flipped:
                posteriors.append(self.autoencoder.encode(images.flip(-1)))
            arrays = [a for q in posteriors for a in (q.mean, q.logvar)]
            examples += [{member: npy_bytes(a[j]) for member, a in zip(self.members, arrays, strict=True)}
                         for j in range(len(part))]
        return examples
