"""An image: a network conditioned on a low-resolution version of its target, the super-resolution stage of a
cascade (SR3, Saharia et al. 2021; Imagen's and eDiff-I's cascades). The condition is made from each example itself
(`data.condition_resolution`: its side, area-averaged from the example), upsampled by the network (bicubic, as SR3)
and concatenated to the noisy input's channels (islands/nets/condition.ImageCondition); zeros are "none", for
dropout and guidance. Samples are drawn for condition images (`islands sample RUN --condition-image FILE|DIR`) or for
the samples of a lower-resolution run (`islands sample BASE --then RUN`)."""

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from islands.conditions.kind import ConditionKind, SampleRequest
from islands.data.sources import IMAGE_EXTENSIONS, View, X, fitted
from islands.errors import ConfigError, DataError
from islands.nets import NetworkSpec

LOW_RESOLUTION = "low_resolution"  # float32 (n, C, r, r): the example, area-averaged to data.condition_resolution


def low_resolution(x: torch.Tensor, side: int) -> torch.Tensor:
    """Images (n, C, H, H) at side `side`: each cell's mean where `side` divides H (which commutes with a horizontal
    flip, so a flipped example's condition is the flipped condition), else antialiased bilinear."""
    if x.shape[-1] % side == 0:
        return F.avg_pool2d(x, x.shape[-1] // side)
    return F.interpolate(x, size=(side, side), mode="bilinear", antialias=True, align_corners=False)


class WithLowResolution(View):
    """A source whose examples also hold their low-resolution version, computed from the example when asked."""

    def __init__(self, source, side: int):
        super().__init__(source)
        self.side, self.holds = side, source.holds | {LOW_RESOLUTION}

    def read(self, indices, fields) -> dict:
        if LOW_RESOLUTION not in fields:
            return self.source.read(indices, fields)
        got = self.source.read(indices, tuple({*fields, X} - {LOW_RESOLUTION}))
        got[LOW_RESOLUTION] = low_resolution(got[X], self.side)
        return got if X in fields else {k: v for k, v in got.items() if k != X}


class ImageKind(ConditionKind):
    name = "image"
    field = LOW_RESOLUTION
    option = "--condition-image"
    keys = {"data": ("condition_resolution",)}
    grid_from_data = True

    def check(self, cfg) -> None:
        super().check(cfg)
        model, data = cfg.model, cfg.data
        if model.arch not in ("unet", "dit"):
            raise ValueError(f"model.condition: image is read by unet and dit networks, not {model.arch!r}")
        if model.num_classes:
            raise ValueError(f"model.condition: 'image' with model.num_classes={model.num_classes} (one condition "
                             "a network; a class needs condition class)")
        if data.condition_resolution is None:
            raise ValueError("data.condition_resolution: model.condition image needs the side of the low-resolution "
                             "condition (e.g. 14 for 28x28 images)")
        if data.autoencoder is not None:
            raise ValueError("data.autoencoder: an image condition is of pixels; train the super-resolution stage "
                             "on images")

    def network_spec(self, model, shape: tuple, num_classes: int) -> NetworkSpec:
        return NetworkSpec(model, shape, condition_channels=shape[0])

    def source(self, cfg, run_dir, source, device="cpu", progress: bool = False):
        side, shape = cfg.data.condition_resolution, tuple(source.shape)
        if len(shape) != 3 or side >= shape[-1]:
            raise DataError(f"data.condition_resolution: {side} is not below the data's {shape[-1]}x{shape[-1]} "
                            f"images (examples of shape {shape})")
        return WithLowResolution(source, side)

    def request(self, sampler, num: int, request: SampleRequest) -> torch.Tensor | None:
        """The condition images in turn, at the run's condition side: a file or a folder of images (read as the
        data's images are, resized to the side), or images (n, C, h, w) in [-1, 1] (a lower-resolution run's
        samples, area-averaged to the side where they are larger); none asked: none."""
        self.refuse_others(sampler, request, self.option)
        images, side, channels = request.images, sampler.cfg.data.condition_resolution, sampler.shape[0]
        if images is None:
            return None
        if isinstance(images, (str, Path)):
            images = read_condition_images(Path(images), side, channels)
        if images.dim() != 4 or images.shape[1] != channels or images.shape[-1] < side:
            raise ConfigError(f"{self.option}: images of shape {tuple(images.shape[1:])} for a run conditioned on "
                              f"{channels}-channel images of side {side}")
        if images.shape[-1] != side:
            images = low_resolution(images.float(), side)
        return images.float()[torch.arange(num) % len(images)]

    def evaluation_request(self, evaluator, num: int) -> SampleRequest:
        """The first `num` examples of the data, as the run saw them during training."""
        source = evaluator.source
        return SampleRequest(images=source.read([i % len(source) for i in range(num)], (X,))[X])

    def check_exportable(self, cfg) -> None:
        raise ConfigError("model.condition: an image-conditioned run has no diffusers pipeline to export to; sample "
                          "it with islands sample --condition-image or --then")


def read_condition_images(path: Path, side: int, channels: int) -> torch.Tensor:
    """A file, or a folder's images in name order, as condition images (n, C, side, side) in [-1, 1]."""
    files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS) if path.is_dir() else [path]
    if not files:
        raise ConfigError(f"--condition-image: {path} holds no image ({', '.join(sorted(IMAGE_EXTENSIONS))})")
    out = []
    for file in files:
        try:
            with Image.open(file) as img:
                out.append(fitted(img, side, channels, background=0))
        except (OSError, ValueError) as err:
            raise ConfigError(f"--condition-image: {file}: not an image ({err})") from None
    return torch.from_numpy(np.stack(out)).float() / 127.5 - 1
