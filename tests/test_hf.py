"""data.source hf: a Hugging Face dataset on disk (save_to_disk's folder or parquet files), read in place by index,
decoded as the folder source decodes images, resumed exactly on other rank and worker counts; hub ids, missing
columns, undecodable images and labels out of range refused in one line."""

import io
import json
import pickle
import sys

import numpy as np
import pytest
import torch
from conftest import tiny_unet_config, write_config
from PIL import Image

from islands.cli import main
from islands.config import captioned, validate
from islands.data import build_data
from islands.data.registry import build_source
from islands.errors import DataError
from islands.rundir import latest_checkpoint, list_checkpoints, load_weights
from islands.trainer import train

datasets = pytest.importorskip("datasets")

N = 64  # examples: 4 classes, as the tiny U-Net of conftest takes
CLASSES = ["cat", "dog", "fox", "owl"]


def png(a: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(a).save(out, "PNG")
    return out.getvalue()


def dataset(n: int = N, seed: int = 0, **columns):
    """n colour images of sizes from 8x8 to 15x11 (not square: resized and cropped), a caption and a ClassLabel each;
    `columns` replaces or adds columns (raw values, then cast as the defaults are)."""
    rng = np.random.default_rng(seed)
    images = [png(rng.integers(0, 256, (8 + i % 8, 8 + i % 4, 3), dtype=np.uint8)) for i in range(n)]
    data = {"image": [{"bytes": b, "path": None} for b in images], "text": [f" picture {i} " for i in range(n)],
            "label": [i % len(CLASSES) for i in range(n)], **columns}
    ds = datasets.Dataset.from_dict(data).cast_column("image", datasets.Image())
    if "label" not in columns:
        ds = ds.cast_column("label", datasets.ClassLabel(names=CLASSES))
    return ds


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The same dataset saved both ways: save_to_disk's folder, and parquet in row groups of 10 (7 of them)."""
    root = tmp_path_factory.mktemp("hf")
    ds = dataset()
    ds.save_to_disk(str(root / "saved"))
    (root / "parquet").mkdir()
    ds.to_parquet(str(root / "parquet" / "train-00000-of-00001.parquet"), batch_size=10)
    return root, ds


def by_hand(blob: bytes, r: int, channels: int = 3) -> torch.Tensor:
    """What an image must become, decoded by PIL here: shorter side to r (bicubic), centre crop, [-1, 1]."""
    img = Image.open(io.BytesIO(blob)).convert("RGB" if channels == 3 else "L")
    w, h = img.size
    nw, nh = max(r, round(w * r / min(w, h))), max(r, round(h * r / min(w, h)))
    img = img.resize((nw, nh), Image.BICUBIC)
    a = np.asarray(img.crop(((nw - r) // 2, (nh - r) // 2, (nw - r) // 2 + r, (nh - r) // 2 + r)), dtype=np.float32)
    a = a[None] if a.ndim == 2 else a.transpose(2, 0, 1)
    return torch.from_numpy(a / 127.5 - 1.0)


def hf(path, **options):
    return build_source("hf", path=str(path), resolution=options.pop("resolution", 6), **options)


@pytest.mark.parametrize("layout", ["saved", "parquet", "glob"])
def test_pixels_captions_and_labels_are_the_rows_as_pil_decodes_them(saved, layout):
    root, ds = saved
    path = {"saved": root / "saved", "parquet": root / "parquet", "glob": root / "parquet" / "*.parquet"}[layout]
    source = hf(path)
    assert len(source) == N and source.shape == (3, 6, 6) and source.num_classes == 4 and source.captioned
    order = [37, 2, 63, 2, 10, 0, 19]  # across row groups, one twice
    x, y = source.get(order)
    raw = ds.with_format("arrow")[order]
    truth = torch.stack([by_hand(v["bytes"], 6) for v in raw.column("image").to_pylist()])
    assert x.dtype == torch.float32 and torch.equal(x, truth)
    assert y.tolist() == [i % 4 for i in order] and source.classes == CLASSES
    assert source.captions(order) == [f"picture {i}" for i in order]  # stripped, as the folder's
    grey, _ = hf(path, channels=1, resolution=4).get([5])
    assert torch.equal(grey[0], by_hand(ds.with_format("arrow")[5]["image"][0].as_py()["bytes"], 4, channels=1))


def test_save_to_disk_and_parquet_give_the_same_examples_and_a_split_of_a_dataset_dict(saved, tmp_path):
    root, ds = saved
    a, b = hf(root / "saved"), hf(root / "parquet")
    everything = np.arange(N)
    assert all(torch.equal(u, v) for u, v in zip(a.get(everything), b.get(everything), strict=True))
    assert a.captions(everything) == b.captions(everything)
    datasets.DatasetDict({"train": ds, "test": ds.select([5, 9])}).save_to_disk(str(tmp_path / "dict"))
    test = hf(tmp_path / "dict", split="test")
    assert len(test) == 2 and torch.equal(test.get([0, 1])[0], a.get([5, 9])[0])
    assert len(hf(tmp_path / "dict")) == N  # train, when no split is named
    with pytest.raises(DataError, match=r"has no split 'valid' \(it holds train, test\)"):
        hf(tmp_path / "dict", split="valid")


def test_unlabelled_uncaptioned_and_other_column_names(tmp_path):
    ds = dataset(8).rename_columns({"image": "jpg", "text": "prompt"}).remove_columns("label")
    ds.save_to_disk(str(tmp_path / "d"))
    plain = hf(tmp_path / "d", image_key="jpg")
    assert plain.num_classes == 0 and not plain.captioned and plain.get([1])[1] is None
    with pytest.raises(DataError, match="no captions"):
        plain.captions([0])
    named = hf(tmp_path / "d", image_key="jpg", caption_key="prompt")
    assert named.captions([3]) == ["picture 3"]
    cfg = validate({"run_dir": "r", "data": {"source": "hf", "path": str(tmp_path / "d"), "resolution": 8,
                                             "image_key": "jpg"}})
    assert not captioned(cfg.data)
    assert captioned(cfg.data.model_copy(update={"caption_key": "prompt"}))


def test_encoded_bytes_and_an_integer_label_column(tmp_path):
    """A plain binary column (no Image feature) of encoded images; integer labels give classes 0..max."""
    blobs = [png(np.full((9, 7, 3), 20 * i, np.uint8)) for i in range(5)]
    datasets.Dataset.from_dict({"image": blobs, "label": [0, 2, 1, 2, 0]}).to_parquet(str(tmp_path / "p.parquet"))
    source = hf(tmp_path / "p.parquet")
    x, y = source.get([4, 1])
    assert source.num_classes == 3 and y.tolist() == [0, 2]
    assert torch.equal(x, torch.stack([by_hand(blobs[4], 6), by_hand(blobs[1], 6)]))


def test_the_source_pickles_without_its_table_and_reads_the_same_after(saved):
    root, _ = saved
    for path in (root / "saved", root / "parquet"):
        source = hf(path)
        before = source.get([3, 40])
        copy = pickle.loads(pickle.dumps(source))
        assert len(pickle.dumps(source)) < 4000  # paths and numbers, not the rows
        assert all(torch.equal(u, v) for u, v in zip(before, copy.get([3, 40]), strict=True))


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_bad_inputs_are_refused_in_one_line_naming_the_dataset_row_and_column(tmp_path, saved):
    root, _ = saved
    with pytest.raises(DataError) as hub:
        hf("someone/some-dataset")
    assert "someone/some-dataset" in one_line(hub) and "this library works offline" in one_line(hub)
    with pytest.raises(DataError) as missing:
        hf(root / "saved", caption_key="prompt")
    assert one_line(missing).startswith(f"hf data {root / 'saved'}: has no column 'prompt' (data.caption_key")
    with pytest.raises(DataError, match="has no column 'jpg' \\(data.image_key"):
        hf(root / "saved", image_key="jpg")

    blobs = [{"bytes": png(np.full((8, 8, 3), 30 * i, np.uint8)), "path": None} for i in range(6)]
    blobs[4]["bytes"] = b"\x89PNG\r\n\x1a\n not really"
    dataset(6, image=blobs).save_to_disk(str(tmp_path / "broken"))
    source = hf(tmp_path / "broken")
    source.get([0, 1, 2, 3, 5])  # the others read
    with pytest.raises(DataError) as undecodable:
        source.get([1, 4])
    assert one_line(undecodable).startswith(f"hf data {tmp_path / 'broken'}: row 4: column 'image' does not decode")
    with pytest.raises(DataError, match="row 4: column 'image' does not decode"):
        source.check()

    dataset(6, label=[0, 1, 5, 1, 0, 1]).save_to_disk(str(tmp_path / "labels"))  # integers, then made a
    info = tmp_path / "labels" / "dataset_info.json"  # ClassLabel of two by hand (datasets refuses such a cast)
    meta = json.loads(info.read_text())
    meta["features"]["label"] = {"names": ["a", "b"], "_type": "ClassLabel"}
    info.write_text(json.dumps(meta))
    with pytest.raises(DataError) as out_of_range:
        hf(tmp_path / "labels")
    assert one_line(out_of_range) == f"hf data {tmp_path / 'labels'}: row 2: column 'label' holds 5, outside 0..1 " \
                                     "(its ClassLabel names)"


def test_a_dataset_script_is_never_run_and_the_cli_refuses_a_hub_id_in_one_line(tmp_path, capsys):
    (tmp_path / "scripted").mkdir()
    (tmp_path / "scripted" / "scripted.py").write_text("raise SystemExit('ran')\n")
    with pytest.raises(DataError, match="holds a loading script \\(scripted.py\\) and no data files; dataset "
                                        "scripts are never run"):
        hf(tmp_path / "scripted")
    config = write_config(tmp_path / "c.yaml", {"run_dir": str(tmp_path / "run"), "data": {
        "source": "hf", "path": "someone/some-dataset", "resolution": 8}})
    assert main(["train", config, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "this library works offline" in err, err
    assert not (tmp_path / "run").exists()


def test_without_datasets_the_source_says_which_extra_to_install(saved, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed: its import fails
    for path in (saved[0] / "saved", saved[0] / "parquet"):
        with pytest.raises(DataError) as missing:
            hf(path)
        assert one_line(missing) == "data.source hf needs the `datasets` package: pip install 'islands[hf]'"


# --- exact resume


def _stream(source, positions: int, batch: int, start: int = 0, world: int = 1, workers: int = 0) -> dict:
    from test_shards import _stream as stream

    return stream(source, positions, batch, start, world, workers)


@pytest.mark.parametrize("before, after", [((2, 0), (1, 0)), ((1, 0), (1, 2))])
def test_a_killed_stream_resumes_at_the_next_image_on_other_ranks_and_workers(saved, before, after):
    """Positions 0..47 read on one layout, then, as after a kill at image 48, 48..119 (past the epoch's end at 64) on
    another: every position holds what one process reading straight through gives it (example, label, noise)."""
    from test_shards import _same

    root, _ = saved
    reference = _stream(hf(root / "saved", channels=1, resolution=8), 120, 12)
    for path in (root / "saved", root / "parquet"):
        source = hf(path, channels=1, resolution=8)
        (w0, k0), (w1, k1) = before, after
        resumed = _stream(source, 48, 12, world=w0, workers=k0) | \
            _stream(source, 120, 12, start=48, world=w1, workers=k1)
        _same(reference, resumed)


def hf_run(run_dir, path, workers: int = 0, **train_keys) -> dict:
    """The tiny U-Net of conftest on the dataset's 64 images in grey at 8x8, without dropout or gradient clipping,
    so that 2 ranks of 4 examples compute what 1 process computes with 2 micro-batches of 4, bit for bit."""
    return tiny_unet_config(run_dir, path, data={"source": "hf", "path": str(path), "resolution": 8, "channels": 1,
                                                 "workers": workers},
                            model={"dropout": 0.0}, train={"images": 32, "checkpoint_every": 16, "sample_every": 0,
                                                           "grad_clip": 0.0, **train_keys})


def test_a_run_killed_on_two_ranks_resumes_on_one_process_with_two_workers_bit_identically(saved, tmp_path):
    """Its first 16 images on 2 ranks (parquet read), killed there; the rest on one process of 2 micro-batches with
    2 loader workers (the saved folder read): the weights of one process that read the parquet straight through."""
    from test_parallel import launch_ranks

    root, _ = saved
    torch.set_num_threads(1)
    straight = train(validate(hf_run(tmp_path / "straight", root / "saved")), progress=False)
    ranks = launch_ranks(2, hf_run(tmp_path / "moved", root / "parquet", images=16, accumulate=1), tmp_path,
                         "parallel.strategy=ddp")
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    assert [p.name for p in list_checkpoints(tmp_path / "moved")] == ["000000000016"]  # resumed from there
    moved = train(validate(hf_run(tmp_path / "moved", root / "parquet", workers=2)), progress=False)
    for name in ("model.safetensors", "ema.safetensors"):
        a, b = (load_weights(latest_checkpoint(run) / name) for run in (straight, moved))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_build_data_checks_every_row_before_a_run(saved):
    root, _ = saved
    cfg = validate({"run_dir": "r", "data": {"source": "hf", "path": str(root / "parquet"), "resolution": 8}})
    assert len(build_data(cfg.data, 0, check=True)) == N


def test_a_text_conditioned_run_reads_the_captions_of_an_hf_dataset(saved, tmp_path):
    """The dataset has a caption column, so a DiT on it is text-conditioned with no other key (its schema read, not its
    rows), and trains on the captions through the bundled text encoder."""
    root, _ = saved
    cfg = validate({"run_dir": str(tmp_path / "text"), "seed": 1,
                    "data": {"source": "hf", "path": str(root / "saved"), "resolution": 8},
                    "model": {"arch": "dit", "hidden_size": 32, "depth": 2, "num_heads": 2, "patch_size": 2,
                              "text_tokens": 16},
                    "train": {"images": 32, "batch_size": 16, "lr": 1e-3, "checkpoint_every": 32, "sample_every": 0,
                              "log_every": 16, "label_dropout": 0.2, "ema_halflife_images": 32},
                    "sample": {"num": 2, "steps": 2, "solver": "euler"}, "eval": {"every": 0}})
    assert (cfg.model.condition, cfg.model.text_width) == ("text", 384)
    run = train(cfg, progress=False)
    assert (run / "text_encoder.json").exists() and latest_checkpoint(run).name == "000000000032"
