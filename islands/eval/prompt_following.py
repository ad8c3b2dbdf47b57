"""Prompt following: how well a text-conditioned model's samples show the prompts they were drawn for.

A judge embeds images and captions into one space (`PromptJudge`). Each sample's own prompt is ranked among all the
distinct prompts by cosine similarity (Radford et al. 2021, CLIP's zero-shot retrieval): top-1 and top-5 retrieval
accuracy and the mean rank (1 is best). Real images ranked against their own captions give the ceiling.

The prompts are the captions a judge never trained on: every caption whose sha256 falls in the held-out fifth
(`held_out`), so that a judge trained on the rest ranks the samples' prompts, and the real images' ceiling, as
unseen text. The split is by caption, not by position, so the same caption is on the same side in any data set.

Judges: Islands' own contrastive image-caption model (islands/eval/contrastive.py), trained on the other four fifths
against the frozen caption embeddings of the bundled text encoder; or a user's CLIP folder (`eval.prompt_judge`),
which also gives the CLIP score (Hessel et al. 2021: 100 * max(cos, 0), as torchmetrics reports it).
"""

import hashlib
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

HELD_OUT = 5  # one caption in HELD_OUT is held out of the judge's training, for evaluation
TOP = (1, 5)  # retrieval accuracies reported: top-1 and top-5


class PromptJudge(ABC):
    name: str  # names what made it (a cache key, a folder's weights), for metrics.json entries
    clip_score: bool = False  # whether its cosine is CLIP's, so that the CLIP score means what it says

    @abstractmethod
    def images(self, x: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1] (N, C, H, W) -> L2-normalised embeddings (N, D), float32 on the CPU."""

    @abstractmethod
    def texts(self, captions: list[str]) -> torch.Tensor:
        """Captions -> L2-normalised embeddings (M, D), float32 on the CPU."""


def is_held_out(caption: str) -> bool:
    """Whether a caption is in the judge's held-out fifth: by its sha256, so by its text alone."""
    return int.from_bytes(hashlib.sha256(caption.encode()).digest()[:8], "big") % HELD_OUT == 0


def held_out(captions: list[str]) -> list[int]:
    """The indices of the examples whose caption the judge does not train on."""
    return [i for i, c in enumerate(captions) if is_held_out(c)]


def prompt_following(image_embeddings: torch.Tensor, prompts: list[str], judge: PromptJudge) -> dict:
    """Rank each image's own prompt among the distinct prompts: {"prompt_top1", "prompt_top5", "prompt_rank"} and, for
    a CLIP judge, "clip_score". `image_embeddings` are the judge's, row i drawn for prompts[i]."""
    distinct = sorted(set(prompts))
    where = {c: i for i, c in enumerate(distinct)}
    own = torch.tensor([where[p] for p in prompts])
    texts = judge.texts(distinct)
    similarity = image_embeddings.float() @ texts.T
    own_similarity = similarity[torch.arange(len(own)), own]
    # rank 1: no other prompt is closer (ties counted against the image: an all-equal judge scores no better)
    rank = 1 + (similarity > own_similarity[:, None]).sum(1) + (similarity == own_similarity[:, None]).sum(1) - 1
    out = {f"prompt_top{k}": (rank <= k).double().mean().item() for k in TOP}
    out["prompt_rank"] = rank.double().mean().item()
    out["prompt_choices"] = len(distinct)
    if judge.clip_score:
        out["clip_score"] = (100 * own_similarity.clamp(min=0)).double().mean().item()
    return out


def normalised(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x.float(), dim=-1).cpu()
