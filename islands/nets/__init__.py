"""Networks: ignorant of objectives and parallelism; each exposes `blocks` for outside wrapping. Sizes that do not fit
raise ValueError naming the model key; the builders that read the config turn it into a ConfigError."""

from torch import nn

from islands.nets.autoencoder import AutoencoderKLNet, autoencoder_kl
from islands.nets.condition import TextWidths
from islands.nets.dit import DIT_PRESETS, DiT
from islands.nets.mlp import MLP
from islands.nets.router import MLPRouter, TransformerRouter
from islands.nets.unet import UNet


def unet_arguments(cfg, shape: tuple, num_classes: int) -> dict:
    """The U-Net's constructor arguments for a model config, JSON-able but for `text` (the exported class,
    islands/nets/diffusers_wrapper.py, takes these same arguments)."""
    return dict(in_channels=shape[0], resolution=shape[1], channels=cfg.channels,
                channel_mult=list(cfg.channel_mult), num_res_blocks=cfg.num_res_blocks,
                attention_resolutions=list(cfg.attention_resolutions), num_heads=cfg.num_heads or 4,
                dropout=cfg.dropout, num_classes=num_classes, text=text_widths(cfg))


def dit_arguments(cfg, shape: tuple, num_classes: int) -> dict:
    """The DiT's constructor arguments for a model config, as `unet_arguments`."""
    preset = DIT_PRESETS[cfg.preset]
    return dict(input_size=shape[1], in_channels=shape[0], patch_size=cfg.patch_size,
                hidden_size=cfg.hidden_size or preset["hidden_size"], depth=cfg.depth or preset["depth"],
                num_heads=cfg.num_heads or preset["num_heads"], mlp_ratio=cfg.mlp_ratio, num_classes=num_classes,
                text=text_widths(cfg))


def _unet(cfg, shape: tuple, num_classes: int) -> nn.Module:
    return UNet(**unet_arguments(cfg, shape, num_classes))


def _dit(cfg, shape: tuple, num_classes: int) -> nn.Module:
    return DiT(**dit_arguments(cfg, shape, num_classes))


def text_widths(cfg) -> TextWidths | None:
    """A text-conditioned network's widths (model.condition text; the config resolved them), else None."""
    if getattr(cfg, "condition", None) != "text":
        return None
    return TextWidths(cfg.text_width, cfg.text_pooled_width, cfg.text_tokens)


def _mlp(cfg, shape: tuple, num_classes: int) -> nn.Module:
    return MLP(shape[0], hidden=cfg.hidden, depth=cfg.depth or 4, num_classes=num_classes)


def _router(cfg, shape: tuple, num_classes: int) -> nn.Module:
    if len(shape) == 1:
        return MLPRouter(shape[0], cfg.outputs, hidden=cfg.hidden, depth=cfg.depth or 4, num_classes=num_classes)
    return TransformerRouter(shape[1], shape[0], cfg.outputs, patch_size=cfg.patch_size,
                             hidden_size=cfg.hidden_size or 128, depth=cfg.depth or 4, num_heads=cfg.num_heads or 4,
                             num_classes=num_classes, text=text_widths(cfg))


def _autoencoder_kl(cfg, shape: tuple, num_classes: int) -> nn.Module:
    cells = 2 ** (len(cfg.block_out_channels) - 1)
    if shape[1] % cells:
        raise ValueError(f"block_out_channels: {len(cfg.block_out_channels)} blocks downsample by {cells}, which does "
                         f"not divide images of {shape[1]}x{shape[2]}")
    return AutoencoderKLNet(autoencoder_kl(shape[0], tuple(cfg.block_out_channels), cfg.latent_channels,
                                           cfg.layers_per_block, cfg.norm_num_groups, cfg.mid_block_attention,
                                           shape[1]))


def _diffusers(cfg, shape: tuple, num_classes: int) -> nn.Module:
    from islands.nets.diffusers_net import build_diffusers  # imports diffusers (about 2 s)

    return build_diffusers(cfg.class_name, cfg.config, shape, num_classes, text_widths(cfg))


# model.arch -> the constructor arguments of Islands' own networks that export to diffusers (islands/export.py)
OWN_NETWORK_ARGUMENTS = {"unet": unet_arguments, "dit": dit_arguments}
# model.arch -> (builder, the example shapes it takes: "vectors", "images" or "any")
NETWORKS = {"unet": (_unet, "images"), "dit": (_dit, "images"), "mlp": (_mlp, "vectors"), "router": (_router, "any"),
            "autoencoder_kl": (_autoencoder_kl, "images"), "diffusers": (_diffusers, "images")}


def build_network(cfg, shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The network a model config names, sized for examples of `shape`, with `num_classes` labels (0: none)."""
    build, takes = NETWORKS[cfg.arch]
    if takes == "vectors" and len(shape) != 1:
        raise ValueError(f"model.arch: {cfg.arch!r} needs vector data, got examples of shape {shape}")
    if takes == "images" and (len(shape) != 3 or shape[1] != shape[2]):
        raise ValueError(f"model.arch: {cfg.arch!r} needs square images (C, H, H), got examples of shape {shape}")
    try:  # the constructors check their own sizes (heads divide width, patches divide the image)
        return build(cfg, shape, num_classes)
    except ValueError as err:
        raise ValueError(f"model: {err}") from None


__all__ = ["AutoencoderKLNet", "DiT", "DIT_PRESETS", "MLP", "NETWORKS", "OWN_NETWORK_ARGUMENTS", "UNet",
           "build_network"]
