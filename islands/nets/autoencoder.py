"""Autoencoders for latent diffusion: what a latent stage asks of one, and diffusers' `AutoencoderKL` behind it.

An `Autoencoder` encodes images into a diagonal Gaussian over latents, which the caller samples with noise it
keys itself (one example's noise from its stream position), and decodes latents back into images. Diffusion
runs on `z = (latent - shift_factor) * scaling_factor`, the convention of SD (shift 0, scale 0.18215) and SD3
(shift 0.0609, scale 1.5305), so that the latents it sees have about unit variance.

`AutoencoderKLNet` is the same `AutoencoderKL` as a network Islands trains (`model.arch: autoencoder_kl`): one
forward pass from images and latent noise to the reconstruction and the posterior, which the trainer's strategies
wrap like any network. diffusers is imported only where one is built (about 2 s).
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class LatentDistribution:
    """A diagonal Gaussian over latents (B, C, h, w)."""

    mean: Tensor
    logvar: Tensor

    def sample(self, noise: Tensor) -> Tensor:
        """mean + std * noise, with the caller's standard normal `noise` (so that a draw is keyed per example)."""
        return self.mean + torch.exp(0.5 * self.logvar) * noise.to(self.mean)

    def kl(self) -> Tensor:
        """KL(q || N(0, I)) per example, summed over the latent's elements: (B,)."""
        return 0.5 * (self.mean.square() + self.logvar.exp() - 1.0 - self.logvar).flatten(1).sum(1)


class Autoencoder(ABC):
    """What a latent stage needs of an autoencoder: encode to a distribution, decode, and the latents' scale."""

    scaling_factor: float
    shift_factor: float

    @abstractmethod
    def encode(self, x: Tensor) -> LatentDistribution:
        """Images (B, C, H, W) in [-1, 1] -> the posterior over their latents."""

    @abstractmethod
    def decode(self, latents: Tensor) -> Tensor:
        """Latents as the encoder makes them (unscaled) -> images, not clamped."""

    @abstractmethod
    def latent_shape(self, image_shape: tuple[int, int, int]) -> tuple[int, int, int]:
        """(C, H, W) of an image -> (c, h, w) of its latent."""

    def to_diffusion(self, latents: Tensor) -> Tensor:
        """The latents a diffusion model learns: (latent - shift) * scale."""
        return (latents - self.shift_factor) * self.scaling_factor

    def from_diffusion(self, z: Tensor) -> Tensor:
        """Images from what a diffusion model produced in the latent space."""
        return self.decode(z / self.scaling_factor + self.shift_factor)


class DiffusersAutoencoder(Autoencoder):
    """A diffusers `AutoencoderKL` in eval mode, without gradients. `sha256` is the digest of the files it was loaded
    from, its config and weights (islands/nets/vae_folder.py; None for one built in memory)."""

    def __init__(self, vae: nn.Module, sha256: str | None = None):
        self.vae, self.sha256 = vae.eval().requires_grad_(False), sha256
        self.scaling_factor = float(vae.config.scaling_factor)
        self.shift_factor = float(vae.config.shift_factor or 0.0)
        self.downsampling = 2 ** (len(vae.config.block_out_channels) - 1)

    @torch.no_grad()
    def encode(self, x):
        q = self.vae.encode(x).latent_dist  # its log-variance clamped to [-30, 20]
        return LatentDistribution(q.mean, q.logvar)

    @torch.no_grad()
    def decode(self, latents):
        return self.vae.decode(latents).sample

    def latent_shape(self, image_shape):
        channels, height, width = image_shape
        if channels != self.vae.config.in_channels:
            raise ValueError(f"images of {channels} channels do not fit this autoencoder's "
                             f"{self.vae.config.in_channels}")
        if height % self.downsampling or width % self.downsampling:
            raise ValueError(f"images of {height}x{width} do not divide into this autoencoder's "
                             f"{self.downsampling}x{self.downsampling} latent cells")
        return (self.vae.config.latent_channels, height // self.downsampling, width // self.downsampling)

    def to(self, device) -> "DiffusersAutoencoder":
        self.vae.to(device)
        return self


def autoencoder_kl(channels: int, block_out_channels: tuple[int, ...], latent_channels: int, layers_per_block: int,
                   norm_num_groups: int, mid_block_attention: bool, sample_size: int) -> nn.Module:
    """diffusers' `AutoencoderKL` with SD's block types at the given widths (SD's VAE: 128, 256, 512, 512; 4
    latent channels; 2 layers per block; 32 groups)."""
    from diffusers import AutoencoderKL

    for width in block_out_channels:
        if width % norm_num_groups:
            raise ValueError(f"block_out_channels: {width} is not divisible by norm_num_groups={norm_num_groups}")
    blocks = len(block_out_channels)
    return AutoencoderKL(in_channels=channels, out_channels=channels, down_block_types=("DownEncoderBlock2D",) * blocks,
                         up_block_types=("UpDecoderBlock2D",) * blocks, block_out_channels=tuple(block_out_channels),
                         latent_channels=latent_channels, layers_per_block=layers_per_block,
                         norm_num_groups=norm_num_groups, mid_block_add_attention=mid_block_attention,
                         sample_size=sample_size)


class AutoencoderKLNet(nn.Module):
    """An `AutoencoderKL` being trained: forward(images, latent noise) -> (reconstruction, mean, logvar), one call for
    the strategies to wrap. `blocks` are its encoder's and decoder's resolution blocks, for activation
    checkpointing and sharding from outside."""

    condition = None  # an autoencoder is conditioned on nothing (what an objective's `prepare` reads)

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae
        self.blocks = [*vae.encoder.down_blocks, *vae.decoder.up_blocks]  # a plain list: no second set of keys

    def forward(self, x: Tensor, noise: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(reconstruction, mean, logvar): plain tensors, which every wrapper passes through."""
        q = self.vae.encode(x).latent_dist
        return self.vae.decode(q.mean + q.std * noise.to(q.mean)).sample, q.mean, q.logvar
