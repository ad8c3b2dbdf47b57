"""Islands' own U-Net and DiT as diffusers models (`ModelMixin`, `ConfigMixin`), for `islands export`: no diffusers
class computes them exactly (the DiT's exact GELU, its timestep and condition embeddings, the learned null caption),
so the export ships these classes with the networks' own code (OUT/islands_networks/, this file and the networks'
files copied as they are, their imports of Islands made relative) and diffusers loads them from there.

The forward follows diffusers' conventions: `timestep` on the scheduler's scale (Islands' t in [0, 1] times
`num_train_timesteps`: sigma x 1000 under FlowMatchEulerDiscreteScheduler, the step under DDPMScheduler), a class
label in [0, num_classes) with `num_classes` or None for none, a caption as its text encoder gives it (token states,
attention mask, pooled vector) or None for the network's own learned null caption; the output's `.sample` is the
network's prediction."""

from dataclasses import dataclass

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils import BaseOutput

from islands.nets.condition import TextWidths, pack_text
from islands.nets.dit import DiT
from islands.nets.unet import UNet


@dataclass
class IslandsOutput(BaseOutput):
    sample: torch.Tensor


class IslandsNetwork(ModelMixin, ConfigMixin):
    """What both classes share: the network in `self.net`, called with Islands' (x, t, condition)."""

    def forward(self, sample, timestep, class_labels=None, encoder_hidden_states=None, encoder_attention_mask=None,
                pooled_projections=None, return_dict=True):
        t = torch.as_tensor(timestep, device=sample.device).expand(sample.shape[0])
        t = (t.double() / self.config.num_train_timesteps).to(sample.dtype)
        condition = class_labels
        if encoder_hidden_states is not None:
            if pooled_projections is None:
                raise ValueError("pooled_projections: a caption's pooled vector is needed beside its token states")
            if encoder_attention_mask is None:
                encoder_attention_mask = torch.ones(encoder_hidden_states.shape[:2], device=sample.device)
            condition = pack_text(encoder_hidden_states, encoder_attention_mask, pooled_projections)
        out = self.net(sample, t, condition)
        return IslandsOutput(sample=out) if return_dict else (out,)


def _widths(text: dict | None) -> TextWidths | None:
    return None if text is None else TextWidths(**text)


class IslandsUNet(IslandsNetwork):
    """Islands' ADM U-Net (islands/nets/unet.py); `text` holds TextWidths' fields for a text-conditioned one."""

    @register_to_config
    def __init__(self, in_channels: int, resolution: int, channels: int = 64, channel_mult: tuple = (1, 2, 2),
                 num_res_blocks: int = 2, attention_resolutions: tuple = (16,), num_heads: int = 4,
                 dropout: float = 0.0, num_classes: int = 0, text: dict | None = None,
                 num_train_timesteps: int = 1000):
        super().__init__()
        self.net = UNet(in_channels, resolution, channels, channel_mult, num_res_blocks, attention_resolutions,
                        num_heads, dropout, num_classes, _widths(text))


class IslandsDiT(IslandsNetwork):
    """Islands' DiT (islands/nets/dit.py); `text` as IslandsUNet's."""

    @register_to_config
    def __init__(self, input_size: int, in_channels: int, patch_size: int = 2, hidden_size: int = 384,
                 depth: int = 12, num_heads: int = 6, mlp_ratio: float = 4.0, num_classes: int = 0,
                 text: dict | None = None, num_train_timesteps: int = 1000):
        super().__init__()
        self.net = DiT(input_size, in_channels, patch_size, hidden_size, depth, num_heads, mlp_ratio, num_classes,
                       _widths(text))


# model.arch -> the class it exports as
EXPORTED_CLASS = {"unet": IslandsUNet, "dit": IslandsDiT}
# The package an export ships these classes in, and the files of islands/nets/ it is made of (this one among them).
PACKAGE = "islands_networks"
SHIPPED = ("condition", "layers", "dit", "unet", "diffusers_wrapper")
