"""Layers shared by the networks: time and condition embeddings, modulation, init helpers."""

import math
from abc import ABC, abstractmethod

import torch
import torch.nn as nn

from islands.nets.condition import NetworkCondition, TextWidths, network_condition


def timestep_embedding(t, dim, max_period=10000):
    """Sinusoidal embedding of continuous times t in [0, 1], shape (B,) -> (B, dim).

    Frequencies follow Vaswani et al. 2017, "Attention Is All You Need", Sec. 3.5.
    t is scaled by 1000 so the embedding spans the same range as for the integer
    steps of DDPM / ADM / DiT, whose frequencies were tuned for that range.
    """
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = 1000.0 * t.float()[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


class TimestepEmbedder(nn.Module):
    """Sinusoid followed by a two-layer MLP, as in ADM and DiT."""

    def __init__(self, hidden_size, frequency_size=256):
        super().__init__()
        self.frequency_size = frequency_size
        self.mlp = nn.Sequential(
            nn.Linear(frequency_size, hidden_size),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size),
        )

    def forward(self, t):
        return self.mlp(timestep_embedding(t, self.frequency_size))


class ConditionEmbedder(nn.Module):
    """Time embedding plus the condition's embedding (ADM / DiT sum them): a class's when num_classes > 0, a
    caption's pooled vector given `text` (SD3 adds it to the timestep's the same way); what else the condition gives
    (cross-attention's context, input channels) its module says (islands/nets/condition.py)."""

    def __init__(self, hidden_size, num_classes=0, frequency_size=256, text: TextWidths | None = None,
                 text_tokens: bool = True, condition_channels: int = 0):
        super().__init__()
        self.time = TimestepEmbedder(hidden_size, frequency_size)
        # named `label` in the checkpoints of every run so far (embed.label.embedding_table.weight)
        self.label = network_condition(hidden_size, num_classes, text, text_tokens, condition_channels)

    @property
    def condition(self) -> NetworkCondition | None:
        return self.label

    @property
    def channels(self) -> int:
        """Input channels the condition adds."""
        return 0 if self.label is None else self.label.channels

    def forward(self, t, cond=None):
        emb = self.time(t)
        added = None if self.label is None else self.label.embed(cond, t.shape[0], t.device)
        return emb if added is None else emb + added

    def context(self, cond, batch: int, device) -> tuple:
        """What cross-attention reads: a caption's (tokens, mask); () for any other condition."""
        return () if self.label is None else self.label.context(cond, batch, device)

    def inputs(self, x, cond):
        """The network's input: x, and the condition's channels where it has some."""
        return x if self.label is None else self.label.inputs(x, cond)


def modulate(x, shift, scale):
    """Adaptive normalisation: x * (1 + scale) + shift (FiLM, Perez et al. 2018).

    shift and scale are (B, D); x is (B, D) or (B, T, D) with features last.
    """
    if x.dim() == 3:
        shift, scale = shift.unsqueeze(1), scale.unsqueeze(1)
    return x * (1 + scale) + shift


def zero_module(module):
    """Zero every parameter of module and return it, so a residual branch starts as identity."""
    for p in module.parameters():
        nn.init.zeros_(p)
    return module


def group_norm(channels, max_groups=32):
    """GroupNorm with the largest group count <= max_groups that divides channels."""
    groups = max(g for g in range(1, min(max_groups, channels) + 1) if channels % g == 0)
    return nn.GroupNorm(groups, channels)


class StagedNetwork(nn.Module, ABC):
    """A network written as stem -> blocks -> head over a carried tuple of tensors, so that it can be cut between
    any two blocks from outside (pipeline stages, islands/parallel/pipeline.py) while `forward` stays the plain
    composition. `stem_modules` and `head_modules` name the children the stem and the head use; root buffers
    belong to the stem. `input_shape` is the shape of one example."""

    stem_modules: tuple[str, ...] = ()
    head_modules: tuple[str, ...] = ()

    @abstractmethod
    def stem(self, x, t, cond=None) -> tuple:
        """(x, t, cond) -> the carry into block 0."""

    @abstractmethod
    def block_forward(self, i: int, carry: tuple) -> tuple:
        """Block i: the carry into it -> the carry out of it."""

    @abstractmethod
    def head(self, carry: tuple):
        """The carry out of the last block -> the prediction, shaped like x."""

    def forward(self, x, t, cond=None):
        carry = self.stem(x, t, cond)
        for i in range(len(self.blocks)):
            carry = self.block_forward(i, carry)
        return self.head(carry)
