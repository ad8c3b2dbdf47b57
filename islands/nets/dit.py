"""Diffusion Transformer.

Peebles & Xie 2023, "Scalable Diffusion Models with Transformers": patchify, a stack of
adaLN-Zero transformer blocks conditioned on time (+ class), a final adaptive layer, unpatchify.
The output has the input's channels (no learned variance).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from islands.nets.condition import ClassCondition, Conditioned, TextWidths
from islands.nets.layers import ConditionEmbedder, StagedNetwork, modulate

# Model sizes from the paper, Table 1.
DIT_PRESETS = {
    "S": dict(depth=12, hidden_size=384, num_heads=6),
    "B": dict(depth=12, hidden_size=768, num_heads=12),
    "L": dict(depth=24, hidden_size=1024, num_heads=16),
    "XL": dict(depth=28, hidden_size=1152, num_heads=16),
}


def sincos_1d(pos, dim):
    """(N,) positions -> (N, dim) sin/cos features (Vaswani et al. 2017, Sec. 3.5)."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64, device=pos.device) / (dim // 2))
    args = pos.double()[:, None] * omega[None]
    return torch.cat([torch.sin(args), torch.cos(args)], dim=1)


def sincos_2d(grid_size, dim, scale=1.0):
    """(grid_size**2, dim) fixed positional embedding: half the features encode the column,
    half the row, in row-major token order (as in MAE, He et al. 2022, and DiT). Token i sits at
    position (i + 0.5) * scale - 0.5: with scale = g / grid_size the tokens span the extent of a
    g-token grid, its embedding interpolated (`interpolated_pos_embed`); scale 1 gives positions 0, 1, ..."""
    coords = (torch.arange(grid_size, dtype=torch.float64) + 0.5) * scale - 0.5
    rows, cols = torch.meshgrid(coords, coords, indexing="ij")
    emb = torch.cat([sincos_1d(cols.flatten(), dim // 2), sincos_1d(rows.flatten(), dim // 2)], dim=1)
    return emb.float()


def interpolated_pos_embed(pos_embed, grid_size):
    """A DiT's (1, g * g, D) position embedding for a grid of grid_size tokens, each token at the place it takes in
    the image (centres aligned, as bicubic resizing with align_corners=False aligns them): a run trained on smaller
    images goes on at a larger size with every position meaning the same part of the picture. The embedding is
    fixed sin-cos, so it is computed at those places exactly rather than resized bicubically (as a learned one
    would be, Dosovitskiy et al. 2021); the scale of the given embedding (1, or less if it was itself interpolated)
    is read from its first token's column, whose first feature pair is (sin p, cos p) at p = (scale - 1) / 2."""
    g, dim = math.isqrt(pos_embed.shape[1]), pos_embed.shape[2]
    if g == grid_size:
        return pos_embed
    first = pos_embed[0, 0].double()
    scale = 2 * math.atan2(first[0], first[dim // 4]) + 1
    if not torch.allclose(pos_embed[0].double(), sincos_2d(g, dim, scale).double(), atol=1e-4):
        raise ValueError(f"pos_embed: not the sin-cos embedding of a {g}x{g} grid")
    return sincos_2d(grid_size, dim, scale * g / grid_size).unsqueeze(0)


class Attention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, D = x.shape
        qkv = self.qkv(x).reshape(B, T, 3, self.num_heads, D // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, heads, T, head_dim)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, T, D))


class CrossAttention(nn.Module):
    """Queries from the image tokens, keys and values from a caption's tokens, padding masked out (PixArt-alpha's
    cross-attention, Chen et al. 2023, Sec. 2.3). Its output projection starts at zero, so the block starts as the
    identity, as adaLN-Zero's gates make every other branch start."""

    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, context, mask):
        B, T, D = x.shape
        heads, width = self.num_heads, D // self.num_heads
        q = self.q(x).reshape(B, T, heads, width).transpose(1, 2)
        k, v = self.kv(context).reshape(B, -1, 2, heads, width).permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        return self.proj(x.transpose(1, 2).reshape(B, T, D))


class DiTBlock(nn.Module):
    """Transformer block with adaLN-Zero: the conditioning regresses shift, scale and a gate
    for each branch; the gates start at zero, so the block starts as identity (paper Sec. 3.2). With
    `cross_attention`, a caption's tokens are read between self-attention and the MLP (PixArt-alpha's block)."""

    def __init__(self, hidden_size, num_heads, mlp_ratio=4.0, cross_attention=False):
        super().__init__()
        if cross_attention:
            self.norm_cross = nn.LayerNorm(hidden_size, elementwise_affine=True, eps=1e-6)
            self.cross_attn = CrossAttention(hidden_size, num_heads)
        mlp_hidden = int(hidden_size * mlp_ratio)
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden_size, num_heads)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_size, mlp_hidden),
            # exact GELU, not DiT's tanh approximation: they differ by at most 4.7e-4, below bf16's rounding, and
            # on CPU the exact form is 2x faster in fp32 and 9x in bf16 (the tanh form was a fifth of a router call)
            nn.GELU(),
            nn.Linear(mlp_hidden, hidden_size),
        )
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))

    def forward(self, x, c, context=None, mask=None):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        if context is not None:
            x = x + self.cross_attn(self.norm_cross(x), context.to(x.dtype), mask)
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nn.Module):
    """Adaptive LayerNorm then a linear map from tokens to patches."""

    def __init__(self, hidden_size, patch_size, out_channels):
        super().__init__()
        self.norm = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm(x), shift, scale))


class DiT(Conditioned, StagedNetwork):
    stem_modules, head_modules = ("x_embedder", "embed"), ("final_layer",)

    def __init__(self, input_size, in_channels, patch_size=2, hidden_size=384, depth=12, num_heads=6,
                 mlp_ratio=4.0, num_classes=0, text: TextWidths | None = None, condition_channels: int = 0):
        super().__init__()
        if input_size % patch_size:
            raise ValueError(f"input_size ({input_size}) must be divisible by patch_size ({patch_size})")
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})")
        if hidden_size % 4:
            raise ValueError(f"hidden_size ({hidden_size}) must be divisible by 4 for the 2-D sin-cos embedding")
        self.in_channels = in_channels
        self.input_shape = (in_channels, input_size, input_size)
        self.patch_size = patch_size
        self.grid_size = input_size // patch_size
        self.num_classes = num_classes

        # a condition laid out as the example (a low-resolution image) joins the input's channels
        self.x_embedder = nn.Conv2d(in_channels + condition_channels, hidden_size, kernel_size=patch_size,
                                    stride=patch_size)
        self.embed = ConditionEmbedder(hidden_size, num_classes, text=text, condition_channels=condition_channels)
        # Fixed, not learned. A persistent buffer, so loading a checkpoint restores it even
        # when the model was built on the meta device.
        self.register_buffer("pos_embed", torch.zeros(1, self.grid_size ** 2, hidden_size))
        self.blocks = nn.ModuleList(DiTBlock(hidden_size, num_heads, mlp_ratio, cross_attention=text is not None)
                                    for _ in range(depth))
        self.final_layer = FinalLayer(hidden_size, patch_size, in_channels)
        self.initialize_weights()

    @torch.no_grad()
    def initialize_weights(self):
        """The paper's initialisation (Sec. 3.2 and its released code). Call again after
        materialising a meta-device model with to_empty()."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        self.pos_embed.copy_(sincos_2d(self.grid_size, self.pos_embed.shape[-1]).unsqueeze(0))
        # Patch embedding initialised like a linear layer on flattened patches.
        nn.init.xavier_uniform_(self.x_embedder.weight.view(self.x_embedder.weight.shape[0], -1))
        nn.init.zeros_(self.x_embedder.bias)
        if isinstance(self.embed.label, ClassCondition):
            nn.init.normal_(self.embed.label.embedding_table.weight, std=0.02)
        for block in self.blocks:  # cross-attention starts silent (CrossAttention)
            if hasattr(block, "cross_attn"):
                nn.init.zeros_(block.cross_attn.proj.weight)
        nn.init.normal_(self.embed.time.mlp[0].weight, std=0.02)
        nn.init.normal_(self.embed.time.mlp[2].weight, std=0.02)
        # adaLN-Zero: every block starts as the identity and the output starts at zero.
        for block in self.blocks:
            nn.init.zeros_(block.adaLN_modulation[-1].weight)
            nn.init.zeros_(block.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].weight)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)

    def unpatchify(self, x):
        """(B, T, p*p*C) tokens -> (B, C, H, W) image."""
        B, p, g, C = x.shape[0], self.patch_size, self.grid_size, self.in_channels
        x = x.reshape(B, g, g, p, p, C)
        x = torch.einsum("bhwpqc->bchpwq", x)
        return x.reshape(B, C, g * p, g * p)

    def stem(self, x, t, cond=None):
        # The residual stream keeps the patch embedding's dtype: under bf16 autocast an fp32 pos_embed would promote
        # it to fp32 and every block's casts, norms and modulation with it; a bf16 stream made a training step 1.10x
        # faster with the same loss curve (docs/BENCHMARKS.md, networks).
        x = self.x_embedder(self.embed.inputs(x, cond)).flatten(2).transpose(1, 2)  # (B, T, D)
        x = x + self.pos_embed.to(x.dtype)
        context = self.embed.context(cond, x.shape[0], x.device)  # a caption's tokens and mask; () for a class
        return x, self.embed(t, cond), *context

    def block_forward(self, i, carry):
        x, c, *context = carry
        return self.blocks[i](x, c, *context), c, *context

    def head(self, carry):
        x, c = carry[:2]
        return self.unpatchify(self.final_layer(x, c))
