"""Routers: p(cluster | x_t, t, class) for a Decentralized Diffusion Model (McAllister et al. 2025).

The paper's router is a small transformer of the denoiser's kind, conditioned on t and the class, trained
with cross-entropy against the cluster of noised training images. Here: DiT blocks over image patches,
mean-pooled, then a linear head; and a residual MLP of the same shape for vector data. Both return logits.
"""

import torch
from torch import nn

from islands.nets.dit import DiTBlock, sincos_2d
from islands.nets.layers import ConditionEmbedder
from islands.nets.mlp import MLP


class TransformerRouter(nn.Module):
    def __init__(self, input_size, in_channels, outputs, patch_size=4, hidden_size=128, depth=4, num_heads=4,
                 num_classes=0):
        super().__init__()
        if input_size % patch_size or hidden_size % num_heads or hidden_size % 4:
            raise ValueError(f"patch_size {patch_size} must divide input size {input_size}, num_heads {num_heads} "
                             f"and 4 must divide hidden_size {hidden_size}")
        grid = input_size // patch_size
        self.num_classes = num_classes
        self.x_embedder = nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size)
        self.embed = ConditionEmbedder(hidden_size, num_classes)
        self.register_buffer("pos_embed", sincos_2d(grid, hidden_size).unsqueeze(0).float())
        self.blocks = nn.ModuleList(DiTBlock(hidden_size, num_heads) for _ in range(depth))
        self.norm = nn.LayerNorm(hidden_size)
        self.head = nn.Linear(hidden_size, outputs)

    def forward(self, x, t, cond=None):
        h = self.x_embedder(x).flatten(2).transpose(1, 2) + self.pos_embed
        c = self.embed(t, cond)
        for block in self.blocks:
            h = block(h, c)
        return self.head(self.norm(h.mean(1)))


def mlp_router(dim, outputs, hidden=128, depth=4, num_classes=0) -> MLP:
    """The denoising MLP with its output layer replaced by logits over the clusters."""
    net = MLP(dim, hidden=hidden, depth=depth, num_classes=num_classes)
    net.proj_out = nn.Linear(hidden, outputs)  # default initialisation, not the denoiser's zeros
    return net


def route(router: nn.Module, x: torch.Tensor, t: torch.Tensor, cond=None) -> torch.Tensor:
    """Probabilities over clusters, in the router's own precision."""
    dtype = next(router.parameters()).dtype
    t = torch.as_tensor(t, dtype=dtype, device=x.device).expand(x.shape[0])
    return router(x.to(dtype), t, cond).float().softmax(-1).to(x.dtype)
