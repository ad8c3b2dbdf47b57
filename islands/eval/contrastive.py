"""Islands' own prompt judge, for captioned images where no CLIP weights can be had: a contrastive image-caption model.

CLIP's objective (Radford et al. 2021, Fig. 3: the symmetric cross-entropy of the scaled cosine similarities within a
batch) between an image tower, the feature classifier's convolutions (islands/eval/features.py) and a linear
projection, and a caption tower, a two-layer MLP on the caption's pooled embedding by the bundled text encoder
(MiniLM-L6, frozen: it already knows language; the MLP maps it to what the images show). It trains on the examples
whose caption is not held out (islands/eval/prompt_following.py), deterministic from its seed, and is cached under
the data's hash, the text encoder's weights, the seed and the epochs.

Its image tower's 128 pooled features are also the feature space of FD, KID and precision/recall on captioned images
(`eval.features: contrastive`, their default): trained to tell captions apart, they see what the captions name, where
a classifier of the nine emoji groups learns little (68% accuracy against the largest group's 59%).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from islands.config import ConfigError
from islands.data.fingerprint import cache_dir, data_fingerprint
from islands.data.sources import Source, View
from islands.eval.features import BATCH, Classifier, Features, cached_or_trained, fit
from islands.eval.prompt_following import PromptJudge, held_out, normalised
from islands.nets.text_encoder import TextEncoder
from islands.nets.text_folder import bundled_text_encoder

EMBED = 64  # the shared space's width
TEMPERATURE = 0.07  # CLIP's initial temperature; learnt, its scale capped at 100 as CLIP caps it


class CaptionImageModel(nn.Module):
    def __init__(self, channels: int, text_width: int):
        super().__init__()
        self.image = Classifier(channels, EMBED)  # its body's 128 features, its head the projection
        self.caption = nn.Sequential(nn.Linear(text_width, 256), nn.SiLU(), nn.Linear(256, EMBED))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / TEMPERATURE)))

    def forward(self, images: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """The batch's CLIP loss: image i and caption i are the pair, every other caption of the batch a negative."""
        a, b = F.normalize(self.image(images), dim=-1), F.normalize(self.caption(pooled), dim=-1)
        logits = self.logit_scale.exp().clamp(max=100) * a @ b.T
        target = torch.arange(len(a))
        return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


@torch.no_grad()
def pooled_captions(encoder: TextEncoder, captions: list[str]) -> torch.Tensor:
    """The encoder's pooled embedding of each caption, float32 on the CPU."""
    return torch.cat([encoder.encode(captions[lo:lo + BATCH]).pooled.float().cpu()
                      for lo in range(0, len(captions), BATCH)])


class ContrastiveJudge(PromptJudge):
    def __init__(self, model: CaptionImageModel, encoder: TextEncoder, name: str):
        self.model, self.encoder, self.name = model.eval(), encoder, name
        self._texts = {}  # caption -> embedding: evaluations rank the same held-out captions again and again

    @torch.no_grad()
    def images(self, x: torch.Tensor) -> torch.Tensor:
        return normalised(self.model.image(x.float()))

    @torch.no_grad()
    def texts(self, captions: list[str]) -> torch.Tensor:
        new = [c for c in dict.fromkeys(captions) if c not in self._texts]
        if new:
            self._texts.update(zip(new, normalised(self.model.caption(pooled_captions(self.encoder, new))),
                                   strict=True))
        return torch.stack([self._texts[c] for c in captions])

    def features(self) -> Features:
        return ContrastiveFeatures(self.model.image, self.name)


class ContrastiveFeatures(Features):
    """The judge's image tower before its projection: 128 features per image."""

    def __init__(self, image_tower: Classifier, name: str):
        self.net, self.name = image_tower, name

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.body(x.float())


def train_judge(images: Source, pooled: torch.Tensor, seed: int, epochs: int, batch: int = 256, lr: float = 2e-3,
                progress: bool = False) -> CaptionImageModel:
    """AdamW with a one-cycle schedule on (image, caption embedding) pairs; weights and order from `seed` alone."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = CaptionImageModel(images.shape[0], pooled.shape[1])
    return fit(model, lambda chosen: model(images.get(chosen.tolist())[0], pooled[chosen]), len(images), seed, epochs,
               batch, lr, 0.1, "training the prompt judge", progress)


class _Subset(View):
    def __init__(self, source: Source, indices: list[int]):
        super().__init__(source)
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    def read(self, indices, fields) -> dict:
        return self.source.read([self.indices[i] for i in indices], fields)


def load_judge(source: Source, seed: int = 0, epochs: int = 30, progress: bool = False) -> ContrastiveJudge:
    """The judge of this exact data (by hash), text encoder and seed: from the cache, or trained and cached."""
    if not source.captioned or len(source.shape) != 3:
        raise ConfigError(f"eval.features: 'contrastive' needs captioned images; {source!r} has none")
    encoder = bundled_text_encoder()
    fingerprint = data_fingerprint(source)
    name = f"contrastive-{fingerprint[:16]}-{encoder.sha256[:16]}-seed{seed}-epochs{epochs}"
    path = cache_dir() / "judges" / f"{name}.safetensors"
    with torch.random.fork_rng():  # evaluating during training must not move the run's random numbers
        empty = CaptionImageModel(source.shape[0], encoder.pooled_width)

    def train():
        captions = source.captions(range(len(source)))
        kept = sorted(set(range(len(source))) - set(held_out(captions)))
        if len(kept) < 2:
            raise ConfigError(f"eval.features: the prompt judge needs at least 2 captioned examples outside the "
                              f"held-out fifth; {source!r} has {len(kept)}")
        pooled = pooled_captions(encoder, [captions[i] for i in kept])
        return train_judge(_Subset(source, kept), pooled, seed, epochs, progress=progress)

    model = cached_or_trained(path, fingerprint, empty, train, {"seed": seed, "epochs": epochs})
    return ContrastiveJudge(model, encoder, name)
