"""Routers: p(cluster | x_t, t, class or caption) for a Decentralized Diffusion Model (McAllister et al. 2025).

The paper's router is a small transformer of the denoiser's kind, conditioned on t and the class, trained
with cross-entropy against the cluster of noised training images. Here: DiT blocks over image patches,
mean-pooled, then a linear head; and a residual MLP of the same shape for vector data. Both return logits.

Both are anchored at the prior. At t = 1, x_t is pure noise and p(k | x_t, t, c) is exactly p(k | c), the cluster
shares of class c; near it the log-posterior departs from the log-prior in proportion to 1 - t (the log-weight of
training point i is ((1 - t) <x_t, x_i> - (1 - t)^2 |x_i|^2 / 2) / t^2, islands.data.posterior). So the logits are
log p(k | c) + (1 - t) f(x_t, t, c): the network learns only the departure, and cannot be wrong at t = 1, where the
mode weights of the samples are decided. The prior table is a buffer, filled from the partition before training.
"""

import torch
from torch import nn

from islands.nets.condition import Conditioned, TextWidths
from islands.nets.dit import DiTBlock, sincos_2d
from islands.nets.layers import ConditionEmbedder
from islands.nets.mlp import MLP


class PriorAnchor(nn.Module):
    """log p(k | c) + (1 - t) * logits; row c of `log_prior` is class c, the last row no class (the cluster sizes)."""

    def __init__(self, outputs, num_classes=0):
        super().__init__()
        self.num_classes = num_classes
        self.register_buffer("log_prior", torch.zeros(num_classes + 1, outputs))  # uniform until set

    def set_prior(self, table: torch.Tensor) -> None:
        """p(k | c) as a (num_classes + 1, K) table of probabilities; zeros are kept finite (held-out classes)."""
        self.log_prior.copy_(torch.as_tensor(table, dtype=self.log_prior.dtype).clamp_min(1e-6).log())

    def forward(self, logits, t, cond=None):
        if cond is None or cond.dim() != 1:  # no class (none, or a caption: p(k | text) has no table): the last row
            cond = torch.full((logits.shape[0],), self.num_classes, dtype=torch.long, device=logits.device)
        rows = self.log_prior[cond]
        return rows.to(logits.dtype) + (1 - t).to(logits.dtype).unsqueeze(1) * logits


class TransformerRouter(Conditioned, nn.Module):
    def __init__(self, input_size, in_channels, outputs, patch_size=4, hidden_size=128, depth=4, num_heads=4,
                 num_classes=0, text: TextWidths | None = None):
        super().__init__()
        if input_size % patch_size or hidden_size % num_heads or hidden_size % 4:
            raise ValueError(f"patch_size {patch_size} must divide input size {input_size}, num_heads {num_heads} "
                             f"and 4 must divide hidden_size {hidden_size}")
        grid = input_size // patch_size
        self.num_classes = num_classes
        self.x_embedder = nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size)
        # a caption's pooled vector joins t in adaLN, as the class does (the paper's router is conditioned on text so)
        self.embed = ConditionEmbedder(hidden_size, num_classes, text=text, text_tokens=False)
        self.register_buffer("pos_embed", sincos_2d(grid, hidden_size).unsqueeze(0).float())
        self.blocks = nn.ModuleList(DiTBlock(hidden_size, num_heads) for _ in range(depth))
        self.norm = nn.LayerNorm(hidden_size)
        self.head = nn.Linear(hidden_size, outputs)
        self.anchor = PriorAnchor(outputs, num_classes)

    def forward(self, x, t, cond=None):
        h = self.x_embedder(x).flatten(2).transpose(1, 2) + self.pos_embed
        c = self.embed(t, cond)
        for block in self.blocks:
            h = block(h, c)
        return self.anchor(self.head(self.norm(h.mean(1))), t, cond)


class MLPRouter(MLP):
    """The denoising MLP with its output layer replaced by logits over the clusters."""

    def __init__(self, dim, outputs, hidden=128, depth=4, num_classes=0):
        super().__init__(dim, hidden=hidden, depth=depth, num_classes=num_classes)
        self.proj_out = nn.Linear(hidden, outputs)  # default initialisation, not the denoiser's zeros
        self.anchor = PriorAnchor(outputs, num_classes)

    def forward(self, x, t, cond=None):
        return self.anchor(super().forward(x, t, cond), t, cond)


def route(router: nn.Module, x: torch.Tensor, t: torch.Tensor, cond=None) -> torch.Tensor:
    """Probabilities over clusters, in the router's own precision."""
    dtype = next(router.parameters()).dtype
    t = torch.as_tensor(t, dtype=dtype, device=x.device).expand(x.shape[0])
    return router(x.to(dtype), t, cond).float().softmax(-1).to(x.dtype)
