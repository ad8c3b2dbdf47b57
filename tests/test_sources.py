import gzip
import json
import os
import re
import struct
from typing import ClassVar

import numpy as np
import pytest
import torch
from conftest import fashion_mnist_or_skip
from PIL import Image

from islands.data.registry import build_source
from islands.data.sources import (
    ArrayFile,
    DataError,
    FashionMnist,
    ImageFolder,
    Mnist5k,
    Source,
    has_captions,
    read_idx,
)

# -----------------------------------------------------------------------------
# helpers

def write_idx(path, array, compress=False):
    """Write an IDX file independently of the parser under test."""
    codes = {np.dtype(np.uint8): 0x08, np.dtype(np.int16): 0x0B,
             np.dtype(np.int32): 0x0C, np.dtype(np.float32): 0x0D}
    header = struct.pack(">BBBB", 0, 0, codes[array.dtype], array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    raw = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    with (gzip.open if compress else open)(path, "wb") as f:
        f.write(raw)


def write_fashion(directory, n=12, split="train", compress=True, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    images[0, 0, 0], images[0, 0, 1] = 0, 255  # both extremes present
    labels = (np.arange(n) % 10).astype(np.uint8)
    prefix = {"train": "train", "test": "t10k"}[split]
    ext = ".gz" if compress else ""
    write_idx(directory / f"{prefix}-images-idx3-ubyte{ext}", images, compress)
    write_idx(directory / f"{prefix}-labels-idx1-ubyte{ext}", labels, compress)
    return images, labels


def save_image(path, size, color, mode="RGB"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, color).save(path)


# -----------------------------------------------------------------------------
# mnist5k

@pytest.fixture(scope="module")
def mnist():
    return Mnist5k()


def test_mnist5k(mnist):
    assert isinstance(mnist, Source)
    assert len(mnist) == 5000
    assert mnist.shape == (1, 28, 28) and mnist.num_classes == 10 and mnist.flip is False
    x, y = mnist.get(np.arange(5000))
    assert x.dtype == torch.float32 and x.shape == (5000, 1, 28, 28)
    assert y.dtype == torch.int64 and y.shape == (5000,)
    assert x.min() == -1.0 and x.max() == 1.0
    counts = torch.bincount(y, minlength=10)
    assert len(counts) == 10 and (counts - 500).abs().max() <= 50


def test_mnist5k_resolution():
    src = build_source("mnist5k", resolution=16)
    x, y = src.get(np.array([0, 4999]))
    assert src.shape == (1, 16, 16) and x.shape == (2, 1, 16, 16)
    assert x.min() >= -1.0 and x.max() <= 1.0 and y.tolist() == [0, 9]


def test_get_subset_matches_full(mnist):
    x_all, y_all = mnist.get(np.arange(5000))
    idx = np.array([4999, 3, 3, 2500])
    x, y = mnist.get(idx)
    assert torch.equal(x, x_all[idx]) and torch.equal(y, y_all[idx])


# -----------------------------------------------------------------------------
# IDX / fashion_mnist

@pytest.mark.parametrize("compress", [True, False])
def test_idx_round_trip(tmp_path, compress):
    a = np.random.default_rng(1).integers(0, 256, size=(3, 5, 7), dtype=np.uint8)
    write_idx(tmp_path / "a.idx", a, compress)
    b = read_idx(tmp_path / "a.idx")
    assert b.dtype == np.uint8 and np.array_equal(a, b)
    f = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    write_idx(tmp_path / "f.idx", f, compress)
    assert np.array_equal(read_idx(tmp_path / "f.idx"), f)


@pytest.mark.parametrize("compress", [True, False])
def test_fashion_round_trip(tmp_path, compress):
    images, labels = write_fashion(tmp_path, n=12, compress=compress)
    src = build_source("fashion_mnist", path=str(tmp_path), split="train")
    assert len(src) == 12 and src.shape == (1, 28, 28) and src.num_classes == 10
    assert src.flip is False
    x, y = src.get(np.arange(12))
    back = np.rint((x.numpy()[:, 0] + 1) * 127.5).astype(np.uint8)
    assert np.array_equal(back, images)
    assert y.tolist() == labels.tolist()
    assert x.min() == -1.0 and x.max() == 1.0


def test_fashion_test_split_and_resolution(tmp_path):
    write_fashion(tmp_path, n=5, split="test")
    src = FashionMnist(path=tmp_path, split="test", resolution=32)
    x, _ = src.get(np.arange(5))
    assert src.shape == (1, 32, 32) and x.shape == (5, 1, 32, 32)
    assert x.min() >= -1.0 and x.max() <= 1.0
    with pytest.raises(DataError, match="train-images-idx3-ubyte"):
        FashionMnist(path=tmp_path, split="train")  # only the test split was written


def test_idx_truncated(tmp_path):
    write_fashion(tmp_path, n=4, compress=False)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:100])
    message = f"{path}: expected {16 + 4 * 784} bytes, found 100"
    with pytest.raises(DataError, match=re.escape(message)):
        FashionMnist(path=tmp_path)
    # a gzip stream cut short is caught too
    write_idx(tmp_path / "cut.gz", np.zeros((4, 28, 28), np.uint8), compress=True)
    gz = tmp_path / "cut.gz"
    gz.write_bytes(gz.read_bytes()[:-12])
    with pytest.raises(DataError, match=re.escape(f"{gz}: corrupt gzip")):
        read_idx(gz)


def test_idx_bad_headers(tmp_path):
    p = tmp_path / "bad.idx"
    p.write_bytes(b"\x01\x00\x08\x01" + struct.pack(">I", 1) + b"\x00")
    with pytest.raises(DataError, match="bad magic"):
        read_idx(p)
    p.write_bytes(b"\x00\x00\x07\x01" + struct.pack(">I", 1) + b"\x00")
    with pytest.raises(DataError, match="dtype code 0x07"):
        read_idx(p)
    p.write_bytes(b"\x1f\x8b not really gzip")
    with pytest.raises(DataError, match=re.escape(f"{p}: corrupt gzip")):
        read_idx(p)


def test_fashion_label_mismatch(tmp_path):
    write_fashion(tmp_path, n=4)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(3, np.uint8), compress=True)
    with pytest.raises(DataError, match="3 labels for 4 images"):
        FashionMnist(path=tmp_path)


def test_fashion_missing_dir(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match=re.escape(str(missing)) + ".*dataset-fashion-mnist"):
        FashionMnist(path=missing)


@pytest.mark.parametrize("ci, root, outcome", [("true", True, "fail"), ("true", False, "skip"), ("", True, "skip")])
def test_absent_fashion_mnist_fails_in_ci_and_is_skipped_elsewhere(tmp_path, monkeypatch, ci, root, outcome):
    monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(os, "geteuid", lambda: 0 if root else 1000)
    expected = pytest.fail.Exception if outcome == "fail" else pytest.skip.Exception
    with pytest.raises(expected, match=re.escape(str(tmp_path / "absent"))):
        fashion_mnist_or_skip(tmp_path / "absent")
    fashion_mnist_or_skip(tmp_path)  # present: nothing happens


def test_fashion_real():
    fashion_mnist_or_skip()
    src = FashionMnist(split="test")
    x, y = src.get(np.arange(len(src)))
    assert len(src) == 10000 and x.shape == (10000, 1, 28, 28)
    assert x.min() == -1.0 and x.max() == 1.0
    assert torch.bincount(y).tolist() == [1000] * 10


# -----------------------------------------------------------------------------
# folder

@pytest.fixture
def image_tree(tmp_path):
    root = tmp_path / "images"
    save_image(root / "cats" / "a.png", (40, 20), (255, 0, 0))
    save_image(root / "cats" / "deep" / "b.jpg", (20, 30), (0, 0, 255))
    save_image(root / "dogs" / "c.jpeg", (16, 16), 255, mode="L")
    save_image(root / "dogs" / "d.PNG", (50, 50), (0, 255, 0, 128), mode="RGBA")
    (root / "dogs" / "notes.txt").write_text("not an image")
    return root


def test_folder_labels_and_shapes(image_tree):
    src = build_source("folder", path=str(image_tree), resolution=8, channels=3)
    assert len(src) == 4 and src.shape == (3, 8, 8)
    assert src.num_classes == 2 and src.classes == ["cats", "dogs"] and src.flip is True
    x, y = src.get(np.arange(4))
    assert x.dtype == torch.float32 and x.shape == (4, 3, 8, 8)
    assert y.dtype == torch.int64 and y.tolist() == [0, 0, 1, 1]
    assert x.min() >= -1.0 and x.max() <= 1.0
    red = x[0].mean(dim=(1, 2))  # a.png is pure red: exact after resize of a flat image
    assert torch.allclose(red, torch.tensor([1.0, -1.0, -1.0]))
    assert torch.allclose(x[2], torch.ones(3, 8, 8))  # white greyscale -> RGB
    src.check()


def test_folder_grey_channel(image_tree):
    src = ImageFolder(image_tree, resolution=5, channels=1)
    x, y = src.get(np.array([3, 1]))
    assert src.shape == (1, 5, 5) and x.shape == (2, 1, 5, 5) and y.tolist() == [1, 0]


def test_folder_resize_then_centre_crop(tmp_path):
    # 60x20 image: left third black, middle white, right third black. Shorter side
    # 20 -> 10 makes it 30x10; the centre 10x10 crop is the white middle.
    a = np.zeros((20, 60), np.uint8)
    a[:, 20:40] = 255
    Image.fromarray(a).save(tmp_path / "wide.png")
    src = ImageFolder(tmp_path, resolution=10, channels=1)
    x, y = src.get(np.array([0]))
    assert y is None and src.num_classes == 0
    assert x.shape == (1, 1, 10, 10)
    assert x[0, 0, :, 2:-2].min() > 0.9  # interior is white; only edges may blur


@pytest.mark.parametrize("background", [None, 0, 100])
@pytest.mark.parametrize("channels", [1, 3])
def test_folder_composites_transparent_images_on_the_background(tmp_path, background, channels):
    """Under a transparent pixel lies red that nobody sees: it must become the background (white by default), a
    half-transparent black pixel the mean of black and the background, an opaque one stay itself."""
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[:, :2] = (255, 0, 0, 0)  # transparent red
    rgba[:, 2] = (0, 0, 0, 255)  # opaque black
    rgba[:, 3] = (0, 0, 0, 128)  # half-transparent black
    Image.fromarray(rgba, "RGBA").save(tmp_path / "icon.png")
    src = build_source("folder", path=tmp_path, resolution=4, channels=channels, background=background)
    x = (src.get([0])[0][0] + 1) * 127.5  # back to 0..255
    grey = 255 if background is None else background
    assert x.shape == (channels, 4, 4)
    assert torch.allclose(x[:, :, :2], torch.tensor(float(grey)), atol=0.51)
    assert torch.allclose(x[:, :, 2], torch.tensor(0.0), atol=0.51)
    assert torch.allclose(x[:, :, 3], torch.tensor(grey * 127 / 255), atol=1.01)


def test_folder_unlabeled_when_images_at_root(image_tree):
    save_image(image_tree / "root.png", (10, 10), (1, 2, 3))
    src = ImageFolder(image_tree, resolution=4)
    assert len(src) == 5 and src.num_classes == 0
    assert src.get(np.arange(5))[1] is None


def test_folder_corrupt_image(image_tree):
    bad = image_tree / "dogs" / "e.png"
    bad.write_bytes(np.random.default_rng(0).integers(0, 256, 300, dtype=np.uint8).tobytes())
    src = ImageFolder(image_tree, resolution=8)  # listing alone does not decode
    i = src.files.index(str(bad))
    src.get(np.array([0, 1]))  # good images still load
    message = re.escape(f"corrupt image file {bad}: cannot identify image file")
    with pytest.raises(DataError, match=message):
        src.get(np.array([0, i]))
    with pytest.raises(DataError, match=message):
        src.check()


def test_folder_empty_and_missing(tmp_path):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "readme.txt").write_text("hi")
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'empty'} contains no PNG or JPEG")):
        ImageFolder(tmp_path / "empty", resolution=8)
    with pytest.raises(DataError, match="does not exist"):
        ImageFolder(tmp_path / "missing", resolution=8)


# -----------------------------------------------------------------------------
# npz

def test_npz_uint8_images(tmp_path):
    x = np.random.default_rng(0).integers(0, 256, size=(6, 3, 4, 4), dtype=np.uint8)
    x[0, 0, 0, :2] = (0, 255)
    y = np.array([0, 1, 2, 0, 1, 4])
    np.savez(tmp_path / "d.npz", x=x, y=y)
    src = build_source("npz", path=str(tmp_path / "d.npz"))
    assert len(src) == 6 and src.shape == (3, 4, 4) and src.num_classes == 5
    xb, yb = src.get(np.arange(6))
    assert torch.allclose(xb, torch.from_numpy(x.astype(np.float32) / 127.5 - 1))
    assert xb.min() == -1.0 and xb.max() == 1.0 and yb.tolist() == y.tolist()
    # (n, H, W) gains a channel axis; resolution resizes once at load
    np.savez(tmp_path / "g.npz", x=x[:, 0])
    src = ArrayFile(tmp_path / "g.npz", resolution=8)
    assert src.shape == (1, 8, 8) and src.num_classes == 0
    assert src.get(np.arange(2))[1] is None


def test_npz_float_vectors_untouched(tmp_path):
    v = np.random.default_rng(0).normal(size=(50, 2)).astype(np.float64) * 10
    np.savez(tmp_path / "v.npz", points=v)
    src = ArrayFile(tmp_path / "v.npz", key="points")
    assert src.shape == (2,) and src.num_classes == 0 and src.flip is False
    x, y = src.get(np.arange(50))
    assert y is None and x.dtype == torch.float32
    assert torch.equal(x, torch.from_numpy(v.astype(np.float32)))
    np.save(tmp_path / "v.npy", v.astype(np.float32))  # a plain .npy works too
    assert torch.equal(ArrayFile(tmp_path / "v.npy").get(np.arange(50))[0], x)


def test_npz_float_images_out_of_range(tmp_path):
    np.savez(tmp_path / "f.npz", x=np.full((2, 1, 4, 4), 200.0, np.float32))
    with pytest.raises(DataError, match="must lie in \\[-1, 1\\]"):
        ArrayFile(tmp_path / "f.npz")


def test_npz_missing_key(tmp_path):
    np.savez(tmp_path / "d.npz", images=np.zeros((2, 4, 4), np.uint8), targets=np.zeros(2))
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'd.npz'}: no key 'x'; "
                                                  "available keys: images, targets")):
        ArrayFile(tmp_path / "d.npz")


def test_npz_label_mismatch(tmp_path):
    np.savez(tmp_path / "d.npz", x=np.zeros((3, 4, 4), np.uint8), y=np.zeros(2, np.int64))
    with pytest.raises(DataError, match="2 labels in 'y' for 3 examples"):
        ArrayFile(tmp_path / "d.npz")


class Bomb:
    """Unpickling this would append to a list; the loader must never do it."""
    ran: ClassVar[list] = []

    def __reduce__(self):
        return (Bomb.ran.append, ("unpickled!",))


def test_npz_refuses_pickles(tmp_path):
    obj = np.empty(2, dtype=object)
    obj[0], obj[1] = Bomb(), Bomb()
    np.save(tmp_path / "o.npy", obj, allow_pickle=True)
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "o.npy"))):
        ArrayFile(tmp_path / "o.npy")
    np.savez(tmp_path / "o.npz", x=obj)
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "o.npz"))):
        ArrayFile(tmp_path / "o.npz")
    assert Bomb.ran == []


def test_npz_corrupt_and_missing(tmp_path):
    (tmp_path / "c.npz").write_bytes(b"PK\x03\x04 garbage")
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'c.npz'}: cannot load")):
        ArrayFile(tmp_path / "c.npz")
    with pytest.raises(DataError, match="not found"):
        ArrayFile(tmp_path / "none.npz")


def test_unknown_source():
    with pytest.raises(ValueError, match="unknown data source"):
        build_source("imagenet")


def test_the_fingerprint_of_a_data_file_is_remembered_until_the_file_or_the_options_change(tmp_path, image_npz):
    import hashlib

    from islands.data.fingerprint import data_fingerprint

    with np.load(image_npz) as data:
        x, y = data["x"], data["y"]
    truth = hashlib.sha256(b"64:(1, 8, 8)")  # every example decoded to [-1, 1] in order, then every label
    truth.update((x.astype(np.float32) / np.float32(127.5) - 1).tobytes())
    truth.update(y.astype(np.int64).tobytes())
    source = build_source("npz", path=image_npz)
    assert data_fingerprint(source) == truth.hexdigest()

    def undecodable(indices):
        raise AssertionError("decoded again")

    source.get = undecodable
    assert data_fingerprint(source) == truth.hexdigest()  # remembered
    unlabelled = build_source("npz", path=image_npz, label_key="")
    assert data_fingerprint(unlabelled) != truth.hexdigest()  # other options: hashed anew
    np.savez(image_npz, x=x[::-1], y=y)
    os.utime(image_npz, ns=(1, 1))  # another state of the file
    assert data_fingerprint(build_source("npz", path=image_npz)) != truth.hexdigest()


@pytest.mark.parametrize("check,damaged", [({}, "b.jpg"), ({"check": "headers"}, "a.png")])
def test_a_damaged_image_stops_a_run_before_anything_is_written_naming_the_file(tmp_path, capsys, check, damaged):
    """A truncated file would stop the run when a batch reaches it; data.check finds it before the first step: the
    default decodes every image, 'headers' verifies a PNG's chunks (not a JPEG's data)."""
    from conftest import tiny_unet_config, write_config

    from islands.cli import main

    root = tmp_path / "images"
    rng = np.random.default_rng(0)
    for i in range(16):
        save_image(root / ("cats", "dogs")[i % 2] / f"{i}.png", (12, 12), int(rng.integers(0, 256)), mode="L")
    save_image(root / "cats" / "a.png", (12, 12), 7, mode="L")
    save_image(root / "cats" / "b.jpg", (12, 12), 7, mode="L")
    bad = root / "cats" / damaged
    bad.write_bytes(bad.read_bytes()[:-40])
    run = tmp_path / "run"
    config = write_config(tmp_path / "c.yaml", tiny_unet_config(
        run, root, data={"source": "folder", "resolution": 8, "channels": 1, **check}, model={"num_classes": 2}))
    assert main(["train", config, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"islands: corrupt image file {bad}: ") and err.count("\n") == 1, err
    assert not run.exists() or not any(run.iterdir())  # no step taken: no config, metrics or checkpoint


# folder captions (issue 36 section 2)

def captioned_tree(root, layout: str):
    """Four images in two class folders, captioned the way `layout` says: sidecars, a metadata.jsonl at the root,
    or a metadata.csv in each class folder (with the caption in a column of another name)."""
    names = {"cats/a.png": "a red cat", "cats/b.webp": "a blue cat", "dogs/c.jpg": "a green dog",
             "dogs/d.png": "a grey dog"}
    colours = {"cats/a.png": (255, 0, 0), "cats/b.webp": (0, 0, 255), "dogs/c.jpg": (0, 255, 0),
               "dogs/d.png": (128, 128, 128)}
    for name in names:
        save_image(root / name, (12, 10), colours[name])
    if layout == "sidecars":
        for name, caption in names.items():
            (root / name).with_suffix(".txt").write_text(f"  {caption}\n", encoding="utf-8")
    elif layout == "jsonl":
        (root / "metadata.jsonl").write_text("".join(
            json.dumps({"file_name": name, "text": caption}) + "\n" for name, caption in names.items()))
    else:
        for folder in ("cats", "dogs"):
            rows = [(n.split("/")[1], c) for n, c in names.items() if n.startswith(folder)]
            (root / folder / "metadata.csv").write_text("file_name,prompt\n" + "".join(f"{n},{c}\n" for n, c in rows))
    return names


@pytest.mark.parametrize("layout", ["sidecars", "jsonl", "csv"])
def test_folder_captions_come_from_sidecars_or_a_metadata_table(tmp_path, layout):
    names = captioned_tree(tmp_path / "images", layout)
    key = {"caption_key": "prompt"} if layout == "csv" else {}
    src = build_source("folder", path=str(tmp_path / "images"), resolution=8, **key)
    assert src.captioned and src.num_classes == 2 and len(src) == 4
    files = [os.path.relpath(f, tmp_path / "images") for f in src.files]
    assert src.captions(range(4)) == [names[f] for f in files]
    x, y = src.get(range(4))
    assert y.tolist() == [0, 0, 1, 1]
    assert x[files.index("cats/b.webp"), 2].mean() > 0.9  # the WebP decodes: its blue is there
    assert has_captions(str(tmp_path / "images"))


def test_a_partly_captioned_folder_is_refused_naming_the_first_uncaptioned_image_unless_empty_is_asked(tmp_path):
    names = captioned_tree(tmp_path / "images", "sidecars")
    (tmp_path / "images" / "dogs" / "c.txt").unlink()
    with pytest.raises(DataError, match=r"dogs/c.jpg has no caption \(1 of 4 images have none, 3 have one\)"):
        build_source("folder", path=str(tmp_path / "images"), resolution=8)
    src = build_source("folder", path=str(tmp_path / "images"), resolution=8, missing_caption="empty")
    assert src.captions(range(4)) == [names["cats/a.png"], names["cats/b.webp"], "", names["dogs/d.png"]]


def test_a_folder_without_captions_is_not_captioned_and_bad_tables_are_one_line(tmp_path, image_tree):
    src = build_source("folder", path=str(image_tree), resolution=8)  # notes.txt is no image's sidecar
    assert not src.captioned and not has_captions(str(image_tree))
    with pytest.raises(DataError, match="has no captions"):
        src.captions([0])
    root = tmp_path / "bad"
    captioned_tree(root, "jsonl")
    (root / "metadata.jsonl").write_text('{"file_name": "../../etc/passwd", "text": "x"}\n')
    with pytest.raises(DataError, match="row 1 names '../../etc/passwd', outside"):
        build_source("folder", path=str(root), resolution=8)
    (root / "metadata.jsonl").write_text('{"file_name": "cats/a.png"}\n')
    with pytest.raises(DataError, match="row 1 lacks a file_name or a 'text' text"):
        build_source("folder", path=str(root), resolution=8)
    (root / "metadata.jsonl").unlink()
    (root / "cats" / "a.txt").write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(DataError, match="a.txt: cannot read as UTF-8"):
        build_source("folder", path=str(root), resolution=8, missing_caption="empty")
