"""The latent stage of a run on an autoencoder's latents (`data.autoencoder: FOLDER`): the run's `DataSpace`
(islands/data/space.py). Each batch of images is encoded before the objective (trainer/loop.py), and whatever the
run samples is decoded before it becomes pictures, samples.npz or metrics (`Sampler.generate`).

Example n's latent is drawn from its posterior with noise keyed on (seed, n, "latent"), so a resumed run encodes
every example to the same latent; then z = (latent - shift) * scale, the autoencoder's own convention, without
clamping (latents are not in [-1, 1]); only decoded images are clamped to the data range. The run records the
weights' sha256 in RUN/autoencoder.json when it starts, and every later start, sample or evaluation of the run
refuses a folder whose weights no longer hash to it.
"""

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from islands.data import streams
from islands.data.batch import Batch
from islands.data.space import PIXELS, DataSpace
from islands.nets.autoencoder import Autoencoder
from islands.nets.vae_folder import load_autoencoder
from islands.rundir import atomic_write_text, latest_checkpoint

RECORD = "autoencoder.json"


@dataclass(frozen=True)
class LatentStage(DataSpace):
    """An autoencoder's latents as the space the network works in; its weights on `device`."""

    name: str = "latents"
    autoencoder: Autoencoder = field(kw_only=True)
    seed: int = field(kw_only=True)
    device: torch.device | str = field(default="cpu", kw_only=True)

    def example_shape(self, shape: tuple) -> tuple:
        return tuple(self.autoencoder.latent_shape(tuple(shape)))

    @torch.no_grad()
    def encode(self, batch: Batch) -> Batch:
        """The batch with each example as its latent, drawn with the noise of its stream position. The loader's noise
        has the images' shape: dropped, the objective draws it again at the latents' shape from the same positions
        (its time and condition-drop uniforms stay)."""
        q = self.autoencoder.encode(batch.x)
        noise = streams.normal(self.seed, batch.positions.tolist(), tuple(q.mean.shape[1:]), "latent")
        return replace(batch, x=self.autoencoder.to_diffusion(q.sample(noise)).to(batch.x.dtype), noise=None)

    @torch.no_grad()
    def decode(self, samples: torch.Tensor) -> torch.Tensor:
        """Latents a diffusion model made -> images, clamped to the data range, decoded on the autoencoder's device
        and handed back on the samples'."""
        images = self.autoencoder.from_diffusion(samples.to(self.device).float())
        return images.clamp(-1, 1).to(samples.device)


def open_data_space(cfg, run_dir: Path, device="cpu", starting: bool = False) -> DataSpace:
    """The space the run's network works in: PIXELS, or with data.autoencoder its latent stage, the weights checked
    against the sha256 the run recorded. A run `starting` is bound by its record only once it has a checkpoint: before
    that nothing was trained on the folder (a first attempt that failed binds nothing, as its config does not)."""
    folder = cfg.data.autoencoder
    if folder is None:
        return PIXELS
    path = Path(run_dir) / RECORD
    bound = path.exists() and (not starting or latest_checkpoint(run_dir) is not None)
    recorded = json.loads(path.read_text())["sha256"] if bound else None
    return LatentStage(autoencoder=load_autoencoder(folder, sha256=recorded, device=device), seed=cfg.seed,
                       device=device)


def record_data_space(cfg, run_dir: Path, space: DataSpace) -> None:
    """RUN/autoencoder.json for a latent stage: the folder and the sha256 of the weights the run trains on."""
    if isinstance(space, LatentStage):
        atomic_write_text(Path(run_dir) / RECORD,
                          json.dumps({"folder": cfg.data.autoencoder, "sha256": space.autoencoder.sha256}, indent=1))
