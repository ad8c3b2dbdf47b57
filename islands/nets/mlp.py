"""Residual MLP for low-dimensional vector data (toy 2-D distributions and the like)."""

import torch.nn as nn

from islands.nets.condition import Conditioned
from islands.nets.layers import ConditionEmbedder, StagedNetwork, modulate, zero_module


class ResidualBlock(nn.Module):
    """LayerNorm, scale-shift by the embedding (FiLM, Perez et al. 2018), Linear-SiLU-Linear."""

    def __init__(self, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, elementwise_affine=False)
        # Zero-initialised so the scale-shift starts as identity, as in adaLN-Zero (DiT).
        self.modulation = zero_module(nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden)))
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, h, emb):
        shift, scale = self.modulation(emb).chunk(2, dim=1)
        return h + self.mlp(modulate(self.norm(h), shift, scale))


class MLP(Conditioned, StagedNetwork):
    stem_modules, head_modules = ("embed", "proj_in"), ("norm_out", "proj_out")

    def __init__(self, dim, hidden=256, depth=4, num_classes=0):
        super().__init__()
        self.num_classes = num_classes
        self.input_shape = (dim,)
        self.embed = ConditionEmbedder(hidden, num_classes)
        self.proj_in = nn.Linear(dim, hidden)
        self.blocks = nn.ModuleList(ResidualBlock(hidden) for _ in range(depth))
        self.norm_out = nn.LayerNorm(hidden)
        self.proj_out = zero_module(nn.Linear(hidden, dim))

    def stem(self, x, t, cond=None):
        emb = self.embed(t, cond)
        return self.proj_in(x) + emb, emb  # time enters at once, not only through the zero-initialised modulations

    def block_forward(self, i, carry):
        h, emb = carry
        return self.blocks[i](h, emb), emb

    def head(self, carry):
        return self.proj_out(self.norm_out(carry[0]))
