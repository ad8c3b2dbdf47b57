"""Pictures a person would rather see than read: sample grids and scatter plots."""

import io
import math
import textwrap
from pathlib import Path

import numpy as np
import torch
from PIL import Image


def to_uint8(x: torch.Tensor) -> np.ndarray:
    """(N, C, H, W) in [-1, 1] -> (N, H, W, C) uint8."""
    x = ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).cpu().numpy()


def save_grid(x: torch.Tensor, path: Path, nrow: int | None = None, pad: int = 2, upscale: int | None = None) -> Path:
    """Tile images (N, C, H, W) in [-1, 1] into one PNG; small images are enlarged to be legible."""
    imgs = to_uint8(x)
    n, h, w, c = imgs.shape
    nrow = nrow or math.ceil(math.sqrt(n))
    ncol = math.ceil(n / nrow)
    canvas = np.full((ncol * (h + pad) + pad, nrow * (w + pad) + pad, c), 255, dtype=np.uint8)
    for i, img in enumerate(imgs):
        r, col = divmod(i, nrow)
        canvas[pad + r * (h + pad): pad + r * (h + pad) + h, pad + col * (w + pad): pad + col * (w + pad) + w] = img
    image = Image.fromarray(canvas[..., 0] if c == 1 else canvas)
    upscale = upscale or max(1, 64 // h)
    if upscale > 1:
        image = image.resize((image.width * upscale, image.height * upscale), Image.NEAREST)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def _save_figure(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    _pyplot().close(fig)
    return path


def curves_png(panels: dict, xlabel: str, columns: int = 3, shares: tuple = ()) -> bytes:
    """Small multiples, one panel per name, each holding lines {label: (x, y)} (a legend where there are several); a
    panel whose values are all positive and span more than a hundredfold is drawn on a log scale, one named in
    `shares` (an accuracy) from 0 to 1. -> PNG bytes."""
    plt = _pyplot()
    cols = min(columns, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.8 * cols, 2.7 * rows), dpi=80, squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (name, lines) in zip(axes.flat, panels.items(), strict=False):  # more axes than panels
        for label, (x, y) in lines.items():
            ax.plot(x, y, marker="." if len(x) < 30 else None, label=label or None)
        values = [v for _, y in lines.values() for v in y if math.isfinite(v)]
        if name in shares:
            ax.set_ylim(0, 1.02)
        elif values and min(values) > 0 and max(values) > 100 * min(values):
            ax.set_yscale("log")
        if len(lines) > 1:
            ax.legend(fontsize=7)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def save_side_by_side(pictures: dict, path: Path, title: str = "") -> Path:
    """Pictures already written (PNG), next to each other with a caption each."""
    fig, axes = _pyplot().subplots(1, len(pictures), figsize=(4 * len(pictures), 4.4), dpi=100)
    for ax, (caption, picture) in zip(axes, pictures.items(), strict=True):
        ax.imshow(Image.open(picture).convert("RGB"))
        ax.set_title(caption)
        ax.axis("off")
    fig.suptitle(title, fontsize=9)
    return _save_figure(fig, path)


def save_curve(x, y, path: Path, xlabel: str, ylabel: str, title: str = "") -> Path:
    """A line plot against x, e.g. a router's accuracy against t; `y` is one sequence, or {name: sequence} for
    several lines with a legend."""
    lines = y if isinstance(y, dict) else {"": y}
    fig, ax = _pyplot().subplots(figsize=(5, 3.5), dpi=100)
    for name, values in lines.items():
        ax.plot(x, values, marker="o", label=name or None)
    if len(lines) > 1:
        ax.legend(fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=9)
    return _save_figure(fig, path)


def save_bars(labels: list[str], stacks: dict, path: Path, xlabel: str, title: str = "", log: bool = True) -> Path:
    """Horizontal bars, one per label, each the stack of `stacks` ({part: values}) end to end."""
    fig, ax = _pyplot().subplots(figsize=(7, 0.32 * len(labels) + 1.2), dpi=100)
    left = np.zeros(len(labels))
    for part, values in stacks.items():
        ax.barh(labels, values, left=left, label=part)
        left = left + np.asarray(values, dtype=float)
    if log:
        ax.set_xscale("log")
        smallest = [v for values in stacks.values() for v in values if v > 0]
        if smallest:  # so that the first part of every bar shows
            ax.set_xlim(left=min(smallest) / 3)
    ax.invert_yaxis()
    ax.legend(fontsize=8)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3, axis="x")
    ax.set_title(title, fontsize=9)
    return _save_figure(fig, path)


def save_scatter(x: torch.Tensor, path: Path, reference: torch.Tensor | None = None, title: str = "") -> Path:
    """First two coordinates of vector samples, over reference data in grey."""
    fig, ax = _pyplot().subplots(figsize=(5, 5), dpi=100)
    if reference is not None:
        r = reference.float().cpu().numpy()
        ax.scatter(r[:, 0], r[:, 1], s=2, c="0.75", label="data")
    s = x.float().cpu().numpy()
    ax.scatter(s[:, 0], s[:, 1], s=2, c="tab:blue", label="samples")
    ax.set_aspect("equal")
    ax.legend(loc="upper right")
    ax.set_title(title)
    return _save_figure(fig, path)


def save_samples_picture(x: torch.Tensor, path: Path, reference: torch.Tensor | None = None, title: str = "",
                         captions: list[str] | None = None) -> Path:
    """A grid for images (each under its caption, where given: a prompt), a scatter plot for vectors."""
    if x.dim() == 4:
        return save_captioned_grid(x, captions, path) if captions else save_grid(x, path)
    return save_scatter(x, path, reference, title)


def save_captioned_grid(x: torch.Tensor, captions: list[str], path: Path, width: int = 22) -> Path:
    """Images (N, C, H, W) in [-1, 1], each under its caption (wrapped at `width` characters, three lines at most)."""
    plt = _pyplot()
    imgs = to_uint8(x)
    n = len(imgs)
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(1.6 * cols, 1.9 * rows), dpi=100, squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i < n:
            img = imgs[i]
            ax.imshow(img[..., 0] if img.shape[-1] == 1 else img, cmap="gray" if img.shape[-1] == 1 else None,
                      vmin=0, vmax=255, interpolation="nearest")
            lines = textwrap.wrap(captions[i], width)
            ax.set_title("\n".join(lines[:3]) + ("..." if len(lines) > 3 else ""), fontsize=6)
    return _save_figure(fig, path)
