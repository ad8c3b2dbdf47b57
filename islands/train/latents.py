"""The latent stage of a run on an autoencoder's latents (`data.autoencoder: FOLDER`): each batch of images is
encoded before the objective, and whatever the run samples is decoded before it becomes pictures, samples.npz or
metrics.

Example n's latent is drawn from its posterior with noise keyed on (seed, n, "latent"), so a resumed run encodes
every example to the same latent; then z = (latent - shift) * scale, the autoencoder's own convention, without
clamping (latents are not in [-1, 1]); only decoded images are clamped to the data range. The run records the
weights' sha256 in RUN/autoencoder.json when it starts, and every later start, sample or evaluation of the run
refuses a folder whose weights no longer hash to it.
"""

import json
from dataclasses import replace
from pathlib import Path

import torch

from islands.data import streams
from islands.data.batch import Batch
from islands.nets.autoencoder import Autoencoder
from islands.nets.vae_folder import load_autoencoder
from islands.rundir import atomic_write_text, latest_checkpoint

RECORD = "autoencoder.json"


class LatentStage:
    def __init__(self, autoencoder: Autoencoder, seed: int):
        self.autoencoder, self.seed = autoencoder, seed

    def latent_shape(self, image_shape: tuple) -> tuple:
        return tuple(self.autoencoder.latent_shape(tuple(image_shape)))

    @torch.no_grad()
    def latents(self, x: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """Images at these stream positions -> the latents a diffusion model learns, each drawn with its own noise."""
        q = self.autoencoder.encode(x)
        noise = streams.normal(self.seed, positions, tuple(q.mean.shape[1:]), "latent")
        return self.autoencoder.to_diffusion(q.sample(noise)).to(x.dtype)

    def encode(self, batch: Batch) -> Batch:
        """The batch with its examples as latents. The loader's noise has the images' shape: dropped, the objective
        draws it again at the latents' shape from the same positions (its time and label uniforms stay)."""
        return replace(batch, x=self.latents(batch.x, batch.positions.tolist()), noise=None)

    @torch.no_grad()
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Latents a diffusion model made -> images, clamped to the data range."""
        return self.autoencoder.from_diffusion(z.float()).clamp(-1, 1)


def open_latent_stage(cfg, run_dir: Path, device="cpu", starting: bool = False) -> LatentStage | None:
    """The run's latent stage (None without data.autoencoder), its weights checked against the sha256 the run
    recorded. A run `starting` is bound by its record only once it has a checkpoint: before that nothing was trained
    on the folder (a first attempt that failed binds nothing, as its config does not)."""
    folder = cfg.data.autoencoder
    if folder is None:
        return None
    path = Path(run_dir) / RECORD
    bound = path.exists() and (not starting or latest_checkpoint(run_dir) is not None)
    recorded = json.loads(path.read_text())["sha256"] if bound else None
    return LatentStage(load_autoencoder(folder, sha256=recorded, device=device), cfg.seed)


def record_latent_stage(cfg, run_dir: Path, stage: LatentStage) -> None:
    """RUN/autoencoder.json: the folder and the sha256 of the weights the run trains on."""
    atomic_write_text(Path(run_dir) / RECORD,
                      json.dumps({"folder": cfg.data.autoencoder, "sha256": stage.autoencoder.sha256}, indent=1))
