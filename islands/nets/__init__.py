"""Networks: ignorant of objectives and parallelism; each exposes `blocks` for outside wrapping."""

from torch import nn

from islands.config import ConfigError
from islands.nets.dit import DIT_PRESETS, DiT
from islands.nets.mlp import MLP
from islands.nets.router import MLPRouter, TransformerRouter
from islands.nets.unet import UNet


def build_network(cfg, shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The network a `ModelConfig` names, sized for examples of `shape`, with `num_classes` labels (0: none)."""
    if cfg.arch == "router":
        try:
            if len(shape) == 1:
                return MLPRouter(shape[0], cfg.outputs, hidden=cfg.hidden, depth=cfg.depth or 4,
                                  num_classes=num_classes)
            return TransformerRouter(shape[1], shape[0], cfg.outputs, patch_size=cfg.patch_size,
                                     hidden_size=cfg.hidden_size or 128, depth=cfg.depth or 4,
                                     num_heads=cfg.num_heads or 4, num_classes=num_classes)
        except ValueError as err:
            raise ConfigError(f"model: {err}") from None
    if cfg.arch == "mlp" and len(shape) != 1:
        raise ConfigError(f"model.arch: 'mlp' needs vector data, got examples of shape {shape}")
    if cfg.arch != "mlp" and (len(shape) != 3 or shape[1] != shape[2]):
        raise ConfigError(f"model.arch: {cfg.arch!r} needs square images (C, H, H), got examples of shape {shape}")
    try:  # the constructors check their own sizes (heads divide width, patches divide the image)
        if cfg.arch == "mlp":
            return MLP(shape[0], hidden=cfg.hidden, depth=cfg.depth or 4, num_classes=num_classes)
        channels, size = shape[0], shape[1]
        if cfg.arch == "unet":
            return UNet(channels, size, channels=cfg.channels, channel_mult=tuple(cfg.channel_mult),
                        num_res_blocks=cfg.num_res_blocks, attention_resolutions=tuple(cfg.attention_resolutions),
                        num_heads=cfg.num_heads or 4, dropout=cfg.dropout, num_classes=num_classes)
        preset = DIT_PRESETS[cfg.preset]
        return DiT(size, channels, patch_size=cfg.patch_size, hidden_size=cfg.hidden_size or preset["hidden_size"],
                   depth=cfg.depth or preset["depth"], num_heads=cfg.num_heads or preset["num_heads"],
                   mlp_ratio=cfg.mlp_ratio, num_classes=num_classes)
    except ValueError as err:
        raise ConfigError(f"model: {err}") from None


__all__ = ["DiT", "DIT_PRESETS", "MLP", "UNet", "build_network"]
