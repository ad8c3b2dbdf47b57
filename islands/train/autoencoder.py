"""Training an autoencoder (`train.objective: autoencoder`, `model.arch: autoencoder_kl`) and exporting it in the
layout of the public SD VAEs, so that the loader of a user's VAE (islands/nets/vae_folder.py) reads ours too.

The loss per example is a pixel term (L1 by default, the SD VAE's own pixel term), plus `sobel_weight` times the
L1 distance of the images' Sobel gradients, plus `kl_weight` times the KL of the posterior to N(0, I). SD's VAE
adds a perceptual (LPIPS) loss and later a patch discriminator; LPIPS needs pretrained VGG weights that cannot be
had offline. A pixel loss alone blurs edges (their position is uncertain, and L1/L2 pay for an edge placed a pixel
off more than for a smeared one); comparing gradients as well charges the smearing directly, at the cost of one
depthwise 3x3 convolution. All terms are means over pixels (the KL's sum over the latent divided by the pixel count),
so `kl_weight` keeps SD's meaning (1e-6 of the KL sum against the per-pixel sums of its reconstruction loss).

Each example's latent is sampled with noise keyed on its stream position ("latent"), so a resumed run draws the
same latents.
"""

import json
from typing import ClassVar

import torch
import torch.nn.functional as F

from islands.data import streams
from islands.data.batch import Batch
from islands.nets.autoencoder import LatentDistribution
from islands.rundir import atomic_write_text, built_beside
from islands.train.objectives import Objective

EXPORT = "autoencoder"  # RUN/autoencoder: config.json and diffusion_pytorch_model.safetensors


def sobel(x: torch.Tensor) -> torch.Tensor:
    """Horizontal and vertical Sobel responses per channel, scaled to a difference per pixel: (B, 2C, H, W)."""
    kx = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]], dtype=x.dtype, device=x.device) / 8
    kernels = torch.stack([kx, kx.T]).unsqueeze(1).repeat(x.shape[1], 1, 1, 1)  # (2C, 1, 3, 3)
    return F.conv2d(F.pad(x, (1, 1, 1, 1), mode="replicate"), kernels, groups=x.shape[1])


def autoencoder_loss(x: torch.Tensor, reconstruction: torch.Tensor, mean: torch.Tensor, logvar: torch.Tensor,
                     pixel_loss: str = "l1", sobel_weight: float = 0.0, kl_weight: float = 0.0) -> torch.Tensor:
    """The per-example loss (B,), in float32 whatever the autocast."""
    x, reconstruction = x.float(), reconstruction.float()
    error = reconstruction - x
    loss = (error.abs() if pixel_loss == "l1" else error.square()).flatten(1).mean(1)
    if sobel_weight:
        loss = loss + sobel_weight * (sobel(reconstruction) - sobel(x)).abs().flatten(1).mean(1)
    if kl_weight:
        loss = loss + kl_weight * LatentDistribution(mean.float(), logvar.float()).kl() / x[0].numel()
    return loss


class AutoencoderObjective(Objective):
    produces: ClassVar[str] = "autoencoder"

    def __init__(self, seed: int, latent_channels: int, downsampling: int, pixel_loss: str, sobel_weight: float,
                 kl_weight: float):
        self.seed, self.latent_channels, self.downsampling = seed, latent_channels, downsampling
        self.pixel_loss, self.sobel_weight, self.kl_weight = pixel_loss, sobel_weight, kl_weight

    @classmethod
    def from_config(cls, cfg) -> "AutoencoderObjective":
        m = cfg.model
        return cls(cfg.seed, m.latent_channels, 2 ** (len(m.block_out_channels) - 1), m.pixel_loss, m.sobel_weight,
                   m.kl_weight)

    def latent_noise(self, batch: Batch) -> torch.Tensor:
        """Each example's standard normal draw of its latent, keyed on its stream position."""
        _, height, width = batch.x.shape[1:]
        shape = (self.latent_channels, height // self.downsampling, width // self.downsampling)
        return streams.normal(self.seed, batch.positions.tolist(), shape, "latent").to(batch.x)

    def __call__(self, net, batch):
        reconstruction, mean, logvar = net(batch.x, self.latent_noise(batch))
        return autoencoder_loss(batch.x, reconstruction, mean, logvar, self.pixel_loss, self.sobel_weight,
                                self.kl_weight)


@torch.no_grad()
def export_autoencoder(vae, x: torch.Tensor, run_dir, seed: int) -> tuple[dict, torch.Tensor]:
    """Write `vae` (a diffusers AutoencoderKL) to RUN/autoencoder with save_pretrained, its shift and scale measured on
    the fixed examples `x` (SD3's convention: latents of mean 0 and variance 1 after (z - shift) * scale); the folder
    is replaced whole, never left half written. -> (the reconstruction error of `x` through the posterior mean, the
    reconstructions)."""
    q = vae.encode(x).latent_dist
    noise = streams.normal(seed, list(range(len(x))), tuple(q.mean.shape[1:]), "latent").to(q.mean)
    z = q.mean + q.std * noise
    shift, scale = z.mean().item(), 1.0 / max(z.std().item(), 1e-12)
    vae.register_to_config(scaling_factor=scale, shift_factor=shift)
    reconstruction = vae.decode(q.mean).sample.clamp(-1, 1)
    error = reconstruction - x
    mse = error.square().mean().item()
    record = {"reconstruction_l1": error.abs().mean().item(), "reconstruction_mse": mse,
              "psnr_db": 10 * torch.log10(torch.tensor(4.0 / max(mse, 1e-12))).item(),  # images span 2 (-1 to 1)
              "kl_per_latent": LatentDistribution(q.mean, q.logvar).kl().mean().item() / q.mean[0].numel(),
              "scaling_factor": scale, "shift_factor": shift}
    with built_beside(run_dir / EXPORT, replace=True) as fresh:
        vae.to("cpu").save_pretrained(fresh, safe_serialization=True)  # written from host memory whatever the device
        atomic_write_text(fresh / "reconstruction.json", json.dumps(record, indent=1))
    return record, reconstruction

