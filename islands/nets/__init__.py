"""Networks: ignorant of objectives and parallelism; each exposes `blocks` for outside wrapping."""

from torch import nn

from islands.nets.dit import DIT_PRESETS, DiT
from islands.nets.mlp import MLP
from islands.nets.unet import UNet


def build_network(cfg, shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The network a `ModelConfig` names, sized for examples of `shape` and `num_classes` labels."""
    if cfg.num_classes and cfg.num_classes != num_classes:
        raise ValueError(f"model.num_classes: {cfg.num_classes} does not match the data's {num_classes} classes")
    classes = cfg.num_classes
    if cfg.arch == "mlp":
        if len(shape) != 1:
            raise ValueError(f"model.arch: 'mlp' needs vector data, got examples of shape {shape}")
        return MLP(shape[0], hidden=cfg.hidden, depth=cfg.depth or 4, num_classes=classes)
    if len(shape) != 3 or shape[1] != shape[2]:
        raise ValueError(f"model.arch: {cfg.arch!r} needs square images (C, H, H), got examples of shape {shape}")
    channels, size = shape[0], shape[1]
    if cfg.arch == "unet":
        return UNet(channels, size, channels=cfg.channels, channel_mult=tuple(cfg.channel_mult),
                    num_res_blocks=cfg.num_res_blocks, attention_resolutions=tuple(cfg.attention_resolutions),
                    num_heads=cfg.num_heads or 4, dropout=cfg.dropout, num_classes=classes)
    preset = DIT_PRESETS[cfg.preset]
    return DiT(size, channels, patch_size=cfg.patch_size, hidden_size=cfg.hidden_size or preset["hidden_size"],
               depth=cfg.depth or preset["depth"], num_heads=cfg.num_heads or preset["num_heads"],
               mlp_ratio=cfg.mlp_ratio, num_classes=classes)


__all__ = ["DiT", "DIT_PRESETS", "MLP", "UNet", "build_network"]
