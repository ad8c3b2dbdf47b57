"""The latent stage of a run on an autoencoder's latents (`data.autoencoder: FOLDER`): the run's `DataSpace`
(islands/data/space.py). Each batch of images is encoded before the objective (trainer/loop.py), and whatever the
run samples is decoded before it becomes pictures, samples.npz or metrics (`Sampler.generate`).

Example n's latent is drawn from its posterior with noise keyed on (seed, n, "latent"), so a resumed run encodes
every example to the same latent; then z = (latent - shift) * scale, the autoencoder's own convention, without
clamping (latents are not in [-1, 1]); only decoded images are clamped to the data range. The run records the
digest of the autoencoder's files (its config.json as well as its weights: the scale, shift and activations that give
the weights their meaning) in RUN/autoencoder.json when it starts, and every later start, sample or evaluation of the
run refuses a folder whose files no longer hash to it.

On shards of precomputed latents (`islands encode`, islands/data/encode.py) the stage is `StoredLatents`: the
examples are the stored posteriors, and example n's latent is the same draw from the same posterior (the flipped
image's where the position-keyed flip says so), so such a run trains as the on-the-fly one does.
"""

import copy
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import torch
from torch.utils.flop_counter import FlopCounterMode

from islands.data import streams
from islands.data.batch import Batch
from islands.data.shards import LatentsSection, read_manifest
from islands.data.sources import Source, View, X
from islands.data.space import PIXELS, DataSpace
from islands.errors import DataError
from islands.nets.autoencoder import Autoencoder, LatentDistribution
from islands.nets.vae_folder import load_autoencoder
from islands.rundir import WeightsRecord, latest_checkpoint, recorded_weights


class AutoencoderRecord(WeightsRecord):
    """RUN/autoencoder.json: the autoencoder folder a latent run trains through, and its files' digest."""

    FILE: ClassVar[str] = "autoencoder.json"
    folder: str


@dataclass(frozen=True)
class LatentStage(DataSpace):
    """An autoencoder's latents as the space the network works in; its weights on `device`."""

    name: str = "latents"
    autoencoder: Autoencoder = field(kw_only=True)
    seed: int = field(kw_only=True)
    device: torch.device | str = field(default="cpu", kw_only=True)

    def example_shape(self, shape: tuple) -> tuple:
        return tuple(self.autoencoder.latent_shape(tuple(shape)))

    def flops_per_image(self, shape: tuple) -> float:
        """The encoder's forward (no backward: it is not trained), counted on a copy on the meta device, or where an
        op has no meta kernel there, on one real image (as islands.train.flops falls back)."""
        try:
            return _encoder_flops(copy.deepcopy(self.autoencoder).to("meta"), shape, "meta")
        except (RuntimeError, NotImplementedError):
            return _encoder_flops(self.autoencoder, shape, self.device)

    @torch.no_grad()
    def encode(self, batch: Batch) -> Batch:
        """The batch with each example (flipped where its draw says) as its latent, drawn from its posterior with the
        noise of its stream position."""
        q = self.autoencoder.encode(batch.flipped())
        noise = streams.normal(self.seed, batch.positions.tolist(), tuple(q.mean.shape[1:]), "latent")
        return replace(batch, x=self.autoencoder.to_diffusion(q.sample(noise)).to(batch.x.dtype), flip=None)

    @torch.no_grad()
    def decode(self, samples: torch.Tensor) -> torch.Tensor:
        """Latents a diffusion model made -> images, clamped to the data range, decoded on the autoencoder's device
        and handed back on the samples'."""
        images = self.autoencoder.from_diffusion(samples.to(self.device).float())
        return images.clamp(-1, 1).to(samples.device)


def _encoder_flops(autoencoder: Autoencoder, shape: tuple, device) -> float:
    with FlopCounterMode(display=False) as counter:
        autoencoder.encode(torch.zeros(1, *shape, device=device))
    return float(counter.get_total_flops())


@dataclass(frozen=True)
class StoredLatents(LatentStage):
    """Latents precomputed into shards: each example is its posterior's mean and log-variance, and its flip's where
    the shards hold it (`pairs` 2), stacked along the channels; where the loader drew a flip (data.flip, or the
    shards' flips), this stage picks the flipped image's pair."""

    name: str = "stored latents"
    pairs: int = field(default=1, kw_only=True)
    flip: bool = field(default=False, kw_only=True)
    image_shape: tuple = field(default=(), kw_only=True)  # of the images the latents were encoded from

    def example_shape(self, shape: tuple) -> tuple:
        return (shape[0] // (2 * self.pairs), *shape[1:])

    def flips(self, flip: bool | None, source_flips: bool) -> bool:
        return self.flip  # decided when the stage was opened, from the shards' flips and data.flip

    def flops_per_image(self, shape: tuple) -> float:
        return 0.0  # encoded once, by `islands encode`

    def examples_of(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :x.shape[1] // (2 * self.pairs)]

    @torch.no_grad()
    def images_of(self, x: torch.Tensor) -> torch.Tensor:
        """The posterior means decoded (the autoencoder's reconstruction, the closest to the images that the shards
        hold), clamped to the data range, on the CPU."""
        return self.autoencoder.decode(self.examples_of(x).float().to(self.device)).clamp(-1, 1).cpu()

    def reference(self, source: Source) -> Source:
        return DecodedMeans(source, self)

    @torch.no_grad()
    def encode(self, batch: Batch) -> Batch:
        """The latent of each example, drawn with the noise of its stream position from the posterior of its image or,
        where its position-keyed flip (the loader's draw) says so, of the flipped image."""
        arrays = batch.x.float().chunk(2 * self.pairs, dim=1)
        mean, logvar = arrays[:2]
        if batch.flip is not None:
            flip = batch.flip.reshape(-1, 1, 1, 1)
            mean, logvar = torch.where(flip, arrays[2], mean), torch.where(flip, arrays[3], logvar)
        noise = streams.normal(self.seed, batch.positions.tolist(), tuple(mean.shape[1:]), "latent")
        latent = LatentDistribution(mean, logvar).sample(noise)
        return replace(batch, x=self.autoencoder.to_diffusion(latent).to(batch.x.dtype), flip=None)


class DecodedMeans(View):
    """The images of stored latents, as metrics compare samples with (`StoredLatents.images_of`)."""

    def __init__(self, source: Source, stage: StoredLatents):
        super().__init__(source)
        self.stage, self.shape = stage, stage.image_shape

    def read(self, indices, fields) -> dict:
        got = self.source.read(indices, fields)
        if X in got:
            got[X] = self.stage.images_of(got[X])
        return got


def stored_latents(cfg) -> LatentsSection | None:
    """The manifest's `latents` section where the run reads shards that `islands encode` wrote, else None. data.path
    goes to the manifest's reader as written: a URL stays one (a `Path` would fold its `s3://` into `s3:/`)."""
    if cfg.data.source != "shards":
        return None
    return read_manifest(cfg.data.path).latents


def recorded_sha256(run_dir: Path) -> str | None:
    """The digest of the autoencoder's files a run trained on (RUN/autoencoder.json), None for a run on pixels."""
    return recorded_weights(run_dir, AutoencoderRecord)


def open_data_space(cfg, run_dir: Path, device="cpu", starting: bool = False, sha256: str | None = None) -> DataSpace:
    """The space the run's network works in: PIXELS, or with data.autoencoder its latent stage, its files checked
    against the digest the run recorded (or `sha256`, what an ensemble's manifest recorded of its members). A run
    `starting` is bound by its record only once it has a checkpoint: before that nothing was trained on the folder (a
    first attempt that failed binds nothing, as its config does not)."""
    folder, stored = cfg.data.autoencoder, stored_latents(cfg)
    if stored is not None and folder is None:
        raise DataError(f"data.path: {cfg.data.path} holds latents ('islands encode'); data.autoencoder must name the "
                        "autoencoder folder they were encoded with, which decodes the samples")
    if folder is None:
        return PIXELS
    bound = not starting or latest_checkpoint(run_dir) is not None
    recorded = sha256 or (recorded_sha256(run_dir) if bound else None)
    autoencoder = load_autoencoder(folder, sha256=recorded, device=device)
    if stored is None:
        return LatentStage(autoencoder=autoencoder, seed=cfg.seed, device=device)
    if autoencoder.sha256 != stored.autoencoder_sha256:
        raise DataError(f"data.autoencoder: {folder} is not the autoencoder the latents in {cfg.data.path} were "
                        f"encoded with (sha256 {autoencoder.sha256[:12]}..., the manifest says "
                        f"{stored.autoencoder_sha256[:12]}...)")
    if cfg.data.flip and not stored.flipped:
        raise DataError(f"data.flip: the latents in {cfg.data.path} were encoded without their flips; encode them "
                        "again from data with flip: true")
    return StoredLatents(autoencoder=autoencoder, seed=cfg.seed, device=device, pairs=1 + stored.flipped,
                         image_shape=tuple(stored.image_shape),
                         flip=stored.flipped if cfg.data.flip is None else cfg.data.flip)


def record_data_space(cfg, run_dir: Path, space: DataSpace) -> None:
    """RUN/autoencoder.json for a latent stage: the folder and the digest of the files the run trains on."""
    if isinstance(space, LatentStage):
        AutoencoderRecord(folder=cfg.data.autoencoder, sha256=space.autoencoder.sha256).write(
            Path(run_dir) / AutoencoderRecord.FILE)
