"""A user's CLIP folder as the prompt judge (`eval.prompt_judge: PATH`): a `transformers` `CLIPModel` saved with
`save_pretrained` (`config.json`, `model.safetensors`, its tokenizer's files, and `preprocessor_config.json`).

The folder may come from another island, so it is read as text_folder.py reads a text encoder's: only the files it
names, each inside the folder, the weights in safetensors only and hashed as loaded, no remote code, nothing
downloaded. Images go through CLIP's own preprocessing, written out here rather than through its image processor
(which needs torchvision): [-1, 1] to [0, 1], the shorter side resized to the vision tower's `image_size` (bicubic,
antialiased, as PIL does) and the centre cropped square, then normalised by the folder's `image_mean` and
`image_std`. The cosines are CLIP's, so `prompt_following` also reports the CLIP score.
"""

import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F

from islands.errors import DataError
from islands.eval.prompt_following import PromptJudge, normalised
from islands.nets.text_folder import CONFIG, check_folder, load_model, token_limit

PREPROCESSOR = "preprocessor_config.json"
# OpenAI's CLIP normalisation, what its image processor uses where preprocessor_config.json says nothing
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
BATCH = 256  # images or captions embedded at a time


class ClipJudge(PromptJudge):
    """A `transformers` `CLIPModel` and its tokenizer, without gradients: image and caption embeddings from its two
    projections, L2-normalised."""

    clip_score = True

    def __init__(self, model, tokenizer, *, sha256: str, max_tokens: int, mean, std, device="cpu"):
        self.model = model.float().eval().requires_grad_(False).to(device)
        self.tokenizer, self.max_tokens, self.sha256 = tokenizer, max_tokens, sha256
        self.device = torch.device(device)
        self.name = f"clip-{sha256[:16]}"
        vision = model.config.vision_config
        self.image_size, self.channels = int(vision.image_size), int(vision.num_channels)
        self.mean = torch.tensor(mean, device=self.device).view(1, -1, 1, 1)
        self.std = torch.tensor(std, device=self.device).view(1, -1, 1, 1)

    def pixels(self, x: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1] (N, C, H, W) -> CLIP's normalised input (N, 3, image_size, image_size); a one-channel
        image is seen as grey."""
        if x.shape[1] == 1 and self.channels == 3:
            x = x.expand(-1, 3, -1, -1)
        if x.shape[1] != self.channels:
            raise ValueError(f"the CLIP judge takes images of {self.channels} channels, not {x.shape[1]}")
        x = (x.float().clamp(-1, 1) + 1) / 2
        height, width = x.shape[-2:]
        # the longer side as CLIP's processor (and torchvision's Resize) rounds it: down
        size = tuple(self.image_size * side // min(height, width) for side in (height, width))
        x = F.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False).clamp(0, 1)
        top, left = (size[0] - self.image_size) // 2, (size[1] - self.image_size) // 2
        x = x[..., top:top + self.image_size, left:left + self.image_size]
        return (x - self.mean) / self.std

    @torch.no_grad()
    def images(self, x: torch.Tensor) -> torch.Tensor:
        out = [self.model.get_image_features(pixel_values=self.pixels(batch.to(self.device))).pooler_output
               for batch in x.split(BATCH)]
        return normalised(torch.cat(out))

    @torch.no_grad()
    def texts(self, captions: list[str]) -> torch.Tensor:
        out = []
        for start in range(0, len(captions), BATCH):
            batch = self.tokenizer(captions[start:start + BATCH], padding=True, truncation=True,
                                   max_length=self.max_tokens, return_tensors="pt")
            out.append(self.model.get_text_features(input_ids=batch["input_ids"].to(self.device),
                                                    attention_mask=batch["attention_mask"].to(self.device)
                                                    ).pooler_output)
        return normalised(torch.cat(out))


def _clip_architecture(folder: Path, config) -> str:
    """The class a CLIP folder's config names: a `CLIPModel` (both towers), refused otherwise."""
    kind = config.get("model_type") if isinstance(config, dict) else None
    names = config.get("architectures") if isinstance(config, dict) else None
    if kind != "clip" or names != ["CLIPModel"]:
        raise DataError(f"CLIP folder {folder}: {CONFIG} describes model_type {kind!r} {names!r}, not a CLIP model "
                        f"(model_type 'clip', ['CLIPModel'])")
    return "CLIPModel"


def _normalisation(folder: Path, preprocessor) -> tuple[tuple, tuple]:
    """(image_mean, image_std) from preprocessor_config.json, OpenAI's where it does not say."""
    if preprocessor is None:
        return CLIP_MEAN, CLIP_STD
    if not isinstance(preprocessor, dict):
        raise DataError(f"CLIP folder {folder}: {PREPROCESSOR} is not a JSON object")
    values = []
    for key, default in (("image_mean", CLIP_MEAN), ("image_std", CLIP_STD)):
        value = preprocessor.get(key, default)
        if not (isinstance(value, list | tuple) and len(value) == 3
                and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
                and (key == "image_mean" or all(v > 0 for v in value))):
            raise DataError(f"CLIP folder {folder}: {PREPROCESSOR}'s {key} {value!r} is not three "
                            f"{'positive ' if key == 'image_std' else ''}numbers, one per colour")
        values.append(tuple(float(v) for v in value))
    return values[0], values[1]


@contextlib.contextmanager
def _named_clip():
    """text_folder refuses a "text encoder folder"; here the folder is a CLIP judge's, and the line says so."""
    try:
        yield
    except DataError as err:
        raise DataError(str(err).replace("text encoder folder", "CLIP folder", 1)) from None


def load_clip_judge(folder: str | Path, device="cpu") -> ClipJudge:
    """The CLIP model in `folder` as a prompt judge; its `name` carries the digest of its files."""
    with _named_clip():
        checked = check_folder(folder, _clip_architecture)
        mean, std = _normalisation(checked.path, checked.read(PREPROCESSOR))
        model, tokenizer, sha256 = load_model(checked)
        max_tokens = token_limit(checked.path, model.config.text_config.to_dict(), tokenizer)
    return ClipJudge(model, tokenizer, sha256=sha256, max_tokens=max_tokens, mean=mean, std=std, device=device)
