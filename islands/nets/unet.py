"""ADM-style U-Net.

Ho et al. 2020, "Denoising Diffusion Probabilistic Models" (architecture, App. B) and
Dhariwal & Nichol 2021, "Diffusion Models Beat GANs on Image Synthesis" (ADM: scale-shift
conditioning, attention at several resolutions, skips from every block).

Every repeated unit lives in self.blocks and is called as block(h, emb); the skip
connections are carried between blocks (UNet.block_forward), so blocks can be checkpointed,
sharded or put on pipeline stages alone.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from islands.nets.condition import Conditioned, TextWidths
from islands.nets.layers import ConditionEmbedder, StagedNetwork, group_norm, zero_module


class ResBlock(nn.Module):
    """GroupNorm-SiLU-conv twice; the embedding scales and shifts the second norm (ADM)."""

    def __init__(self, in_channels, out_channels, emb_dim, dropout=0.0):
        super().__init__()
        self.norm1 = group_norm(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.emb_proj = nn.Sequential(nn.SiLU(), nn.Linear(emb_dim, 2 * out_channels))
        self.norm2 = group_norm(out_channels)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = zero_module(nn.Conv2d(out_channels, out_channels, 3, padding=1))
        self.skip = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else nn.Identity()

    def forward(self, x, emb):
        h = self.conv1(F.silu(self.norm1(x)))
        scale, shift = self.emb_proj(emb)[:, :, None, None].chunk(2, dim=1)
        h = self.norm2(h) * (1 + scale) + shift
        h = self.conv2(self.dropout(F.silu(h)))
        return self.skip(x) + h


class AttentionBlock(nn.Module):
    """Multi-head self-attention over all spatial positions, with a residual connection."""

    def __init__(self, channels, num_heads):
        super().__init__()
        if channels % num_heads:
            raise ValueError(f"channels ({channels}) must be divisible by num_heads ({num_heads})")
        self.num_heads = num_heads
        self.norm = group_norm(channels)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.proj = zero_module(nn.Conv2d(channels, channels, 1))

    def forward(self, x):
        B, C, H, W = x.shape
        qkv = self.qkv(self.norm(x)).reshape(B, 3, self.num_heads, C // self.num_heads, H * W)
        # Contiguous (B, heads, HW, head_dim): SDPA's fused CPU kernel refuses a last dimension with a stride, and
        # its fallback materialises the whole attention matrix.
        q, k, v = qkv.transpose(-1, -2).contiguous().unbind(1)
        h = F.scaled_dot_product_attention(q, k, v)
        h = h.transpose(-1, -2).reshape(B, C, H, W)
        return x + self.proj(h)


class CrossAttentionBlock(nn.Module):
    """Every spatial position attends to a caption's tokens (the U-Net of latent diffusion, Rombach et al. 2022,
    Sec. 3.3), padding masked out, with a residual connection whose projection starts at zero."""

    def __init__(self, channels, context_dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.norm = group_norm(channels)
        self.q = nn.Conv2d(channels, channels, 1)
        self.kv = nn.Linear(context_dim, 2 * channels)
        self.proj = zero_module(nn.Conv2d(channels, channels, 1))

    def forward(self, x, context, mask):
        B, C, H, W = x.shape
        heads = self.num_heads
        q = self.q(self.norm(x)).reshape(B, heads, C // heads, H * W).transpose(-1, -2).contiguous()
        k, v = self.kv(context.to(x.dtype)).reshape(B, -1, 2, heads, C // heads).permute(2, 0, 3, 1, 4).unbind(0)
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        return x + self.proj(h.transpose(-1, -2).reshape(B, C, H, W))


class UNetBlock(nn.Module):
    """One ResBlock, optionally followed by self-attention (and, for a caption, cross-attention to its tokens): the
    unit of the down and up paths."""

    def __init__(self, in_channels, out_channels, emb_dim, attention, num_heads, dropout, context_dim=None):
        super().__init__()
        self.res = ResBlock(in_channels, out_channels, emb_dim, dropout)
        self.attn = AttentionBlock(out_channels, num_heads) if attention else None
        # cross-attention at the attention resolutions only; a block without it passes the caption by
        self.cross = CrossAttentionBlock(out_channels, context_dim, num_heads) if attention and context_dim else None

    def forward(self, x, emb, context=None, mask=None):
        x = self.res(x, emb)
        if self.attn is not None:
            x = self.attn(x)
        return self.cross(x, context, mask) if self.cross is not None and context is not None else x


class Downsample(nn.Module):
    """Stride-2 3x3 conv; (n + 1) // 2 output size, so odd sizes such as 7 -> 4 work."""

    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=1)

    def forward(self, x, emb, context=None, mask=None):
        return self.conv(x)  # emb and context unused; the signature matches the other blocks


class MiddleBlock(nn.Module):
    """ResBlock - attention - ResBlock at the lowest resolution."""

    def __init__(self, channels, emb_dim, num_heads, dropout, context_dim=None):
        super().__init__()
        self.res1 = ResBlock(channels, channels, emb_dim, dropout)
        self.attn = AttentionBlock(channels, num_heads)
        if context_dim:
            self.cross = CrossAttentionBlock(channels, context_dim, num_heads)
        self.res2 = ResBlock(channels, channels, emb_dim, dropout)

    def forward(self, x, emb, context=None, mask=None):
        h = self.attn(self.res1(x, emb))
        return self.res2(self.cross(h, context, mask) if context is not None else h, emb)


class UNet(Conditioned, StagedNetwork):
    """Predicts a tensor of x's shape from (x, t, cond).

    attention_resolutions lists feature-map sides (e.g. 16 means 16x16) that get attention.
    Upsampling is nearest-neighbour to the size of the skip it is joined with, so sizes that
    halve unevenly (28 -> 14 -> 7 -> 4) come back exactly. The carry between blocks is (h, emb, *skips): the skips
    still waiting for their up block travel with the activations, so a stage boundary may fall anywhere.
    """

    stem_modules, head_modules = ("embed", "conv_in"), ("norm_out", "conv_out")

    def __init__(self, in_channels, resolution, channels=64, channel_mult=(1, 2, 2), num_res_blocks=2,
                 attention_resolutions=(16,), num_heads=4, dropout=0.0, num_classes=0,
                 text: TextWidths | None = None, condition_channels: int = 0):
        super().__init__()
        self.num_classes = num_classes
        self.input_shape = (in_channels, resolution, resolution)
        emb_dim = 4 * channels
        self.embed = ConditionEmbedder(emb_dim, num_classes, frequency_size=channels, text=text,
                                       condition_channels=condition_channels)
        # a caption's tokens, projected to emb_dim by the condition module, read where there is self-attention
        context = emb_dim if text is not None else None
        self.reads_text = text is not None
        # a condition laid out as the example (a low-resolution image) joins the input's channels
        self.conv_in = nn.Conv2d(in_channels + condition_channels, channels, 3, padding=1)

        # Feature-map side at each level: a stride-2 conv maps n to (n + 1) // 2.
        level_res = [resolution]
        for _ in channel_mult[1:]:
            level_res.append((level_res[-1] + 1) // 2)
        use_attn = [r in attention_resolutions for r in level_res]

        blocks = []
        skip_channels = [channels]
        ch = channels
        for level, mult in enumerate(channel_mult):
            for _ in range(num_res_blocks):
                blocks.append(UNetBlock(ch, mult * channels, emb_dim, use_attn[level], num_heads, dropout, context))
                ch = mult * channels
                skip_channels.append(ch)
            if level < len(channel_mult) - 1:
                blocks.append(Downsample(ch))
                skip_channels.append(ch)
        self.num_down = len(blocks)

        blocks.append(MiddleBlock(ch, emb_dim, num_heads, dropout, context))

        # One more block per level than on the way down: it consumes the Downsample's skip
        # (or conv_in's at the top level).
        for level, mult in reversed(list(enumerate(channel_mult))):
            for _ in range(num_res_blocks + 1):
                blocks.append(UNetBlock(ch + skip_channels.pop(), mult * channels, emb_dim,
                                        use_attn[level], num_heads, dropout, context))
                ch = mult * channels
        self.blocks = nn.ModuleList(blocks)

        self.norm_out = group_norm(ch)
        self.conv_out = zero_module(nn.Conv2d(ch, in_channels, 3, padding=1))

    def stem(self, x, t, cond=None):
        h = self.conv_in(self.embed.inputs(x, cond))
        context = self.embed.context(cond, x.shape[0], x.device)  # a caption's tokens and mask; () otherwise
        return h, self.embed(t, cond), *context, h

    def block_forward(self, i, carry):
        # (h, emb, [tokens, mask,] *skips): the caption travels beside the embedding
        h, emb, *rest = carry
        context, skips = (rest[:2], rest[2:]) if self.reads_text else ((), rest)
        if i < self.num_down:
            h = self.blocks[i](h, emb, *context)
            return h, emb, *context, *skips, h
        if i == self.num_down:
            return self.blocks[i](h, emb, *context), emb, *context, *skips
        skip = skips.pop()
        if h.shape[-2:] != skip.shape[-2:]:
            h = F.interpolate(h, size=skip.shape[-2:], mode="nearest")
        return self.blocks[i](torch.cat([h, skip], dim=1), emb, *context), emb, *context, *skips

    def head(self, carry):
        return self.conv_out(F.silu(self.norm_out(carry[0])))
