"""Networks: ignorant of objectives and parallelism; each exposes `blocks` for outside wrapping. Sizes that do not fit
raise ValueError naming the model key; the builders that read the config turn it into a ConfigError."""

from dataclasses import dataclass
from typing import Any

from torch import nn

from islands.nets.autoencoder import AutoencoderKLNet, autoencoder_kl
from islands.nets.condition import TextWidths
from islands.nets.dit import DIT_PRESETS, DiT
from islands.nets.mlp import MLP
from islands.nets.router import MLPRouter, TransformerRouter
from islands.nets.unet import UNet


@dataclass(frozen=True)
class NetworkSpec:
    """What a network is built for: its model config, the shape of one example, and its condition as the networks
    take it (a class count; a caption's widths; the channels of a condition laid out as the example), which
    islands/conditions/ derives from the condition's kind (`network_spec`)."""

    model: Any
    shape: tuple
    num_classes: int = 0
    text: TextWidths | None = None
    condition_channels: int = 0

    def condition_arguments(self) -> dict:
        """The condition's constructor arguments, as every network of Islands' own takes them; a condition that
        adds no channels leaves them out, so that exported models keep the arguments they always had."""
        args = dict(num_classes=self.num_classes, text=self.text)
        return {**args, "condition_channels": self.condition_channels} if self.condition_channels else args


def unet_arguments(spec: NetworkSpec) -> dict:
    """The U-Net's constructor arguments for a spec, JSON-able but for `text` (the exported class,
    islands/nets/diffusers_wrapper.py, takes these same arguments)."""
    cfg, shape = spec.model, spec.shape
    return dict(in_channels=shape[0], resolution=shape[1], channels=cfg.channels,
                channel_mult=list(cfg.channel_mult), num_res_blocks=cfg.num_res_blocks,
                attention_resolutions=list(cfg.attention_resolutions), num_heads=cfg.num_heads or 4,
                dropout=cfg.dropout, **spec.condition_arguments())


def dit_arguments(spec: NetworkSpec) -> dict:
    """The DiT's constructor arguments for a spec, as `unet_arguments`."""
    cfg, shape = spec.model, spec.shape
    preset = DIT_PRESETS[cfg.preset]
    return dict(input_size=shape[1], in_channels=shape[0], patch_size=cfg.patch_size,
                hidden_size=cfg.hidden_size or preset["hidden_size"], depth=cfg.depth or preset["depth"],
                num_heads=cfg.num_heads or preset["num_heads"], mlp_ratio=cfg.mlp_ratio, **spec.condition_arguments())


def _unet(spec: NetworkSpec) -> nn.Module:
    return UNet(**unet_arguments(spec))


def _dit(spec: NetworkSpec) -> nn.Module:
    return DiT(**dit_arguments(spec))


def _mlp(spec: NetworkSpec) -> nn.Module:
    return MLP(spec.shape[0], hidden=spec.model.hidden, depth=spec.model.depth or 4, num_classes=spec.num_classes)


def _router(spec: NetworkSpec) -> nn.Module:
    cfg, shape = spec.model, spec.shape
    if len(shape) == 1:
        return MLPRouter(shape[0], cfg.outputs, hidden=cfg.hidden, depth=cfg.depth or 4, num_classes=spec.num_classes)
    return TransformerRouter(shape[1], shape[0], cfg.outputs, patch_size=cfg.patch_size,
                             hidden_size=cfg.hidden_size or 128, depth=cfg.depth or 4, num_heads=cfg.num_heads or 4,
                             num_classes=spec.num_classes, text=spec.text)


def _autoencoder_kl(spec: NetworkSpec) -> nn.Module:
    cfg, shape = spec.model, spec.shape
    cells = 2 ** (len(cfg.block_out_channels) - 1)
    if shape[1] % cells:
        raise ValueError(f"block_out_channels: {len(cfg.block_out_channels)} blocks downsample by {cells}, which does "
                         f"not divide images of {shape[1]}x{shape[2]}")
    return AutoencoderKLNet(autoencoder_kl(shape[0], tuple(cfg.block_out_channels), cfg.latent_channels,
                                           cfg.layers_per_block, cfg.norm_num_groups, cfg.mid_block_attention,
                                           shape[1]))


def _diffusers(spec: NetworkSpec) -> nn.Module:
    from islands.nets.diffusers_net import build_diffusers  # imports diffusers (about 2 s)

    return build_diffusers(spec.model.class_name, spec.model.config, spec.shape, spec.num_classes, spec.text)


# model.arch -> the constructor arguments of Islands' own networks that export to diffusers (islands/export.py)
OWN_NETWORK_ARGUMENTS = {"unet": unet_arguments, "dit": dit_arguments}
# model.arch -> (builder, the example shapes it takes: "vectors", "images" or "any")
NETWORKS = {"unet": (_unet, "images"), "dit": (_dit, "images"), "mlp": (_mlp, "vectors"), "router": (_router, "any"),
            "autoencoder_kl": (_autoencoder_kl, "images"), "diffusers": (_diffusers, "images")}


def build_network(spec: NetworkSpec) -> nn.Module:
    """The network a spec's model config names, sized for its examples and built for its condition."""
    cfg, shape = spec.model, spec.shape
    build, takes = NETWORKS[cfg.arch]
    if takes == "vectors" and len(shape) != 1:
        raise ValueError(f"model.arch: {cfg.arch!r} needs vector data, got examples of shape {shape}")
    if takes == "images" and (len(shape) != 3 or shape[1] != shape[2]):
        raise ValueError(f"model.arch: {cfg.arch!r} needs square images (C, H, H), got examples of shape {shape}")
    try:  # the constructors check their own sizes (heads divide width, patches divide the image)
        return build(spec)
    except ValueError as err:
        raise ValueError(f"model: {err}") from None


__all__ = ["AutoencoderKLNet", "DiT", "DIT_PRESETS", "MLP", "NETWORKS", "NetworkSpec", "OWN_NETWORK_ARGUMENTS", "UNet",
           "build_network"]
