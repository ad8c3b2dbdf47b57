"""Webdataset tars as people hold them, indexed where they lie (`islands index`, issue 36 sections 4 and 5): three
layouts read, bad examples left out and counted, the images the folder source would give, every member checked as it
is read (a changed byte stops the run in one line or is skipped, the same way on every read), and a start that reads
no byte of the tars."""

import builtins
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_ranks, tiny_unet_config, write_config
from hostile import flip_byte_in_place
from PIL import Image

from islands.cli import main
from islands.config import validate
from islands.data import build_data
from islands.data.shards import ShardSource, skipped_examples
from islands.data.sources import ImageFolder
from islands.data.tar_index import IndexedTars, index_tars, tars_of
from islands.errors import DataError

R = 8  # the resolution a run reads the images at


def _image(seed: int, w: int, h: int, fmt: str) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buffer, format=fmt)
    return buffer.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


FORMATS = [("jpg", "JPEG"), ("png", "PNG"), ("webp", "WEBP")]


def img2dataset_tars(folder, tars: int = 2, per_tar: int = 5) -> tuple[list, list]:
    """Tars as img2dataset writes them: `{key}.jpg|png|webp`, `{key}.txt`, `{key}.json`, members in webdataset's
    sorted order, `_stats.json` and `.parquet` beside each. In tar 0, key 000000001's JPEG is cut in half and key
    000000003 has no image. -> the good examples (tar, key, image bytes, caption, class) in order, and the bad keys."""
    folder.mkdir()
    good, bad = [], []
    for t in range(tars):
        with tarfile.open(folder / f"{t:05d}.tar", "w") as tar:
            for k in range(per_tar):
                key = f"{t:04d}{k:05d}"
                ext, fmt = FORMATS[(t + k) % 3]
                data = _image(10 * t + k, 9 + k, 12 - k, fmt)
                caption, label = f"  a photo number {t}-{k}\n", (t + k) % 3
                if (t, k) == (0, 1):
                    whole = _image(1, 64, 64, "JPEG")
                    ext, data = "jpg", whole[:len(whole) // 2]  # its header whole: it opens, and fails to decode
                    bad.append(key)
                members = {} if (t, k) == (0, 3) else {ext: data}
                members |= {"json": json.dumps({"url": "http://x", "caption": f"json {key}", "label": label,
                                                "status": "success"}).encode(),
                            "txt": caption.encode()}
                for member in sorted(members):
                    _add(tar, f"{key}.{member}", members[member])
                if (t, k) == (0, 3):
                    bad.append(key)
                elif (t, k) != (0, 1):
                    good.append((f"{t:05d}.tar", key, data, caption.strip(), label))
        (folder / f"{t:05d}_stats.json").write_text("{}")
        (folder / f"{t:05d}.parquet").write_bytes(b"PAR1 not read")
    return good, bad


def folder_truth(tmp_path, images: list[bytes], channels: int = 3) -> torch.Tensor:
    """The independent truth: the same bytes as files of an image folder, read by the folder source."""
    root = tmp_path / "truth"
    root.mkdir()
    for i, data in enumerate(images):
        fmt = Image.open(io.BytesIO(data)).format.lower()
        (root / f"{i:05d}.{'jpg' if fmt == 'jpeg' else fmt}").write_bytes(data)
    return ImageFolder(str(root), resolution=R, channels=channels).get(range(len(images)))[0]


@pytest.fixture
def laion(tmp_path):
    good, bad = img2dataset_tars(tmp_path / "laion")
    index_tars(str(tmp_path / "laion"), tmp_path / "index")
    return tmp_path / "index", good, bad


def test_img2dataset_tars_are_indexed_in_place_and_read_as_the_folder_source_reads_their_images(tmp_path, laion):
    out, good, bad = laion
    m = json.loads((out / "manifest.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "shard-000000.idx.npy",
                                                      "shard-000000.sha256.npy", "shard-000001.idx.npy",
                                                      "shard-000001.sha256.npy"]  # no byte of the data copied
    assert m["examples"] == len(good) == 8 and m["members"] == ["image", "txt"] and m["num_classes"] == 0
    assert [s["tar"] for s in m["shards"]] == [str((tmp_path / "laion" / f"{t:05d}.tar").resolve()) for t in (0, 1)]
    assert m["left_out_count"] == 2
    assert {(e["key"], e["why"].split(" (")[0]) for e in m["left_out"]} == {
        (bad[0], "the image does not decode"), (bad[1], "no image")}
    assert all(e["tar"].endswith("00000.tar") for e in m["left_out"])
    assert m["image_sizes"] == {"widths": [9, 13], "heights": [8, 12]}
    source = ShardSource(str(out), resolution=R)
    assert isinstance(source, IndexedTars) and (len(source), source.shape, source.flip) == (8, (3, R, R), True)
    order = np.random.default_rng(0).permutation(8)
    x, y = source.get(order)
    assert y is None and torch.equal(x, folder_truth(tmp_path, [g[2] for g in good])[order])
    assert source.captions(order) == [good[i][3] for i in order]  # the .txt, stripped


def test_captions_and_classes_from_a_json_key(tmp_path):
    good, _ = img2dataset_tars(tmp_path / "laion")
    assert main(["index", str(tmp_path / "laion" / "*.tar"), str(tmp_path / "out"), "--caption-key", "caption",
                 "--class-key", "label", "--quiet"]) == 0
    source = ShardSource(str(tmp_path / "out"), resolution=R, channels=1)
    x, y = source.get(range(8))
    assert source.shape == (1, R, R) and torch.equal(x, folder_truth(tmp_path, [g[2] for g in good], channels=1))
    assert source.num_classes == 3 and y.tolist() == [g[4] for g in good]
    assert source.captions(range(8)) == [f"json {g[1]}" for g in good]


def test_tars_a_shardwriter_and_gnu_tar_wrote_are_indexed_by_their_keys(tmp_path):
    """webdataset's ShardWriter groups members by `__key__`; GNU tar of a folder by the path without its extensions
    (`cat/001.jpg` with `cat/001.txt`, the folders' entries passed over)."""
    import webdataset

    (tmp_path / "wds").mkdir()
    written = [_image(i, 10, 10 + i, "PNG") for i in range(5)]
    with webdataset.ShardWriter(str(tmp_path / "wds" / "part-%06d.tar"), maxcount=3, encoder=False,
                                verbose=0) as sink:
        for i, data in enumerate(written):
            sink.write({"__key__": f"sample{i:03d}", "png": data, "cls": str(i % 2).encode()})
    assert tars_of(str(tmp_path / "wds" / "part-{000000..000001}.tar")) == tars_of(str(tmp_path / "wds"))
    index_tars(str(tmp_path / "wds" / "part-{000000..000001}.tar"), tmp_path / "wds-index")
    wds = ShardSource(str(tmp_path / "wds-index"), resolution=R)
    x, y = wds.get(range(5))
    assert wds.num_classes == 2 and y.tolist() == [0, 1, 0, 1, 0] and not wds.captioned
    assert torch.equal(x, folder_truth(tmp_path, written))

    photos = tmp_path / "photos"
    for i, (kind, fmt) in enumerate([("cat", "JPEG"), ("cat", "PNG"), ("dog", "WEBP")]):
        (photos / kind).mkdir(parents=True, exist_ok=True)
        (photos / kind / f"{i:03d}.{fmt.lower()}").write_bytes(_image(20 + i, 14, 11, fmt))
        (photos / kind / f"{i:03d}.txt").write_text(f"a {kind}")
    subprocess.run(["tar", "-C", str(tmp_path), "--sort=name", "-cf", str(tmp_path / "gnu.tar"), "photos"],
                   check=True)
    index_tars(str(tmp_path / "gnu.tar"), tmp_path / "gnu-index")
    gnu = ShardSource(str(tmp_path / "gnu-index"), resolution=R)
    files = sorted(p for p in photos.rglob("*") if p.suffix in (".jpeg", ".png", ".webp"))
    assert gnu.captions(range(3)) == ["a cat", "a cat", "a dog"]
    assert torch.equal(gnu.get(range(3))[0], folder_truth(tmp_path / "photos", [f.read_bytes() for f in files]))


def _member_at(out, example: int) -> tuple[str, int]:
    """-> (tar, byte) of the middle of an example's image data."""
    m = json.loads((out / "manifest.json").read_text())
    for s in m["shards"]:
        if example < s["examples"]:
            at, size = np.load(out / s["index"])[example, 0]
            return s["tar"], int(at + size // 2)
        example -= s["examples"]
    raise IndexError(example)


def test_a_changed_byte_stops_the_read_in_one_line_naming_the_tar_and_the_member(laion, capsys):
    out, good, _ = laion
    tar, at = _member_at(out, 2)
    flip_byte_in_place(tar, at)  # its size and mtime kept: only the member's sha256 finds it
    source = ShardSource(str(out), resolution=R)
    source.get([0, 1, 3])  # the others read as before
    with pytest.raises(DataError) as err:
        source.get([1, 2])
    said = str(err.value)
    assert len(said.splitlines()) == 1 and f"tar {tar} changed since it was indexed: {good[2][1]}." in said
    assert "the image of example 2" in said, said
    assert main(["verify", str(out), "--quiet"]) == 2  # the whole pass finds it too
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1 and "1 of 8 examples are bad" in captured.err
    assert good[2][1] in captured.out


def test_a_changed_byte_skipped_is_replaced_by_the_next_good_example_the_same_on_every_read(laion):
    out, _, _ = laion
    flip_byte_in_place(*_member_at(out, 4))
    truth = ShardSource(str(out), resolution=R).get([5])[0]
    reads = []
    for _ in range(2):  # a second source: a resumed run's
        source = ShardSource(str(out), resolution=R, on_error="skip")
        with pytest.warns(UserWarning, match="skipped"):
            x, _ = source.get([3, 4, 7])
        assert torch.equal(x[1], truth[0]) and skipped_examples(source) == 1
        assert source.captions([4]) == source.captions([5])  # its caption the replacement's too
        reads.append(x)
    assert torch.equal(*reads)


def test_a_start_reads_no_byte_of_the_tars_and_maps_its_indices(laion, monkeypatch):
    """What a run does before its first step (build the data and check it) opens no tar, nor any index or member
    sha256 file (it reads the manifest alone, whatever the data's size); the first read of a shard does."""
    out, _, _ = laion
    tars = {s["tar"] for s in json.loads((out / "manifest.json").read_text())["shards"]}
    tars |= {str(p) for p in out.glob("shard-*.npy")}  # the indices and member sha256 files too
    opened, read = [], [0]
    real_open, real_os_open, real_pread = builtins.open, os.open, os.pread
    fds = set()

    def counting_open(path, *args, **kwargs):
        if os.fspath(path) in tars if isinstance(path, str | os.PathLike) else False:
            opened.append(path)
        return real_open(path, *args, **kwargs)

    def counting_os_open(path, *args, **kwargs):
        fd = real_os_open(path, *args, **kwargs)
        if os.fspath(path) in tars:
            opened.append(path)
            fds.add(fd)
        return fd

    def counting_pread(fd, n, at):
        data = real_pread(fd, n, at)
        read[0] += len(data) if fd in fds else 0
        return data

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(os, "open", counting_os_open)
    monkeypatch.setattr(os, "pread", counting_pread)
    data = validate({"run_dir": "unused", "data": {"source": "shards", "path": str(out), "resolution": R}}).data
    source = build_data(data, 0, check=True)
    assert opened == [] and read == [0]
    source.get([0])
    tar = [path for path in opened if str(path).endswith(".tar")]
    assert len(tar) == 1 and 0 < read[0] < os.path.getsize(tar[0]) / 3  # one example's members
    # and the first shard's index and member sha256 file, checked, then mapped; no other shard's
    assert {Path(p).name for p in opened} == {Path(tar[0]).name, "shard-000000.idx.npy", "shard-000000.sha256.npy"}
    assert isinstance(source._index(0)[0], np.memmap) and isinstance(source._index(0)[1], np.memmap)


def test_islands_train_and_shard_on_indexed_tars(tmp_path, capsys):
    """A tiny run on indexed tars with classes; `islands shard` of them gives back the same examples; with a changed
    byte and data.on_error skip the run goes on and metrics.jsonl counts what it skipped."""
    img2dataset_tars(tmp_path / "laion", tars=2, per_tar=8)
    assert main(["index", str(tmp_path / "laion"), str(tmp_path / "index"), "--class-key", "label", "--quiet"]) == 0
    assert "14 examples of 2 tars indexed where they lie, 2 left out" in capsys.readouterr().out
    data = {"source": "shards", "path": str(tmp_path / "index"), "resolution": R}
    short = {"images": 16, "checkpoint_every": 16, "sample_every": 0, "log_every": 16}
    config = write_config(tmp_path / "c.yaml", tiny_unet_config(tmp_path / "run", "unused", data=data, train=short,
                                                                 model={"num_classes": 3}))
    assert main(["train", config, "--quiet"]) == 0
    assert main(["shard", config, str(tmp_path / "own"), "--order", "given", "--quiet"]) == 0
    indexed = ShardSource(str(tmp_path / "index"), resolution=R)
    own = ShardSource(tmp_path / "own")
    for a, b in zip(indexed.get(range(14)), own.get(range(14)), strict=True):
        assert torch.equal(a, b)

    flip_byte_in_place(*_member_at(tmp_path / "index", 5))
    skipping = write_config(tmp_path / "s.yaml", tiny_unet_config(
        tmp_path / "skip", "unused", data={**data, "on_error": "skip"}, train=short, model={"num_classes": 3}))
    assert main(["train", skipping, "--quiet"]) == 0  # 16 images: the whole epoch of 14, the bad one among them
    lines = [json.loads(line) for line in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["skipped_examples"] >= 1
    capsys.readouterr()
    assert main(["train", config, "train.images=32", "--quiet"]) == 2  # on_error stop: one line, the checkpoint kept
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "changed since it was indexed" in err
    assert (tmp_path / "run" / "checkpoints" / "000000000016").is_dir()


def _not_a_tar(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.tar").write_bytes(b"not a tar" * 100)
    return str(tmp_path / "d")


def _no_image_decodes(tmp_path):
    (tmp_path / "d").mkdir()
    with tarfile.open(tmp_path / "d" / "x.tar", "w") as tar:
        _add(tar, "a.jpg", b"\xff\xd8 not a jpeg")
        _add(tar, "b.txt", b"a caption alone")
    return str(tmp_path / "d" / "x.tar")


@pytest.mark.parametrize("make, says", [
    (lambda t: str(t / "nowhere" / "x-{0..3}.tar"), "no such tar"),
    (lambda t: (t / "empty").mkdir() or str(t / "empty"), "no .tar files there"),
    (lambda t: str(t / "*.zip"), "no .tar files there"),
    (_not_a_tar, "cannot be read as a tar"),
    (_no_image_decodes, "no example with an image that decodes in 1 tars; 2 left out"),
])
def test_a_bad_input_to_islands_index_is_one_line_and_nothing_is_written(tmp_path, capsys, make, says):
    spec = make(tmp_path)
    assert main(["index", spec, str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()


def test_islands_index_writes_over_nothing(tmp_path, capsys):
    img2dataset_tars(tmp_path / "laion")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    assert main(["index", str(tmp_path / "laion"), str(tmp_path / "out"), "--quiet"]) == 2
    assert "is not an empty folder" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["mine.txt"]


def test_a_run_refuses_in_one_line_a_tar_changed_since_indexing_and_a_missing_resolution(laion):
    out, _, _ = laion
    with pytest.raises(DataError, match=r"the images keep their own sizes \(9..13 x 8..12\); give data.resolution"):
        ShardSource(str(out))
    tar = json.loads((out / "manifest.json").read_text())["shards"][1]["tar"]
    with open(tar, "ab") as f:
        f.write(b"\0" * 512)
    with pytest.raises(DataError, match=f"tar {tar} changed since it was indexed"):
        ShardSource(str(out), resolution=R)


def test_each_rank_indexes_its_tars_and_rank_0_the_manifest(tmp_path):
    img2dataset_tars(tmp_path / "laion", tars=3, per_tar=3)
    assert main(["index", str(tmp_path / "laion"), str(tmp_path / "one"), "--quiet"]) == 0
    ranks = run_ranks(["index", str(tmp_path / "laion"), str(tmp_path / "two"), "--quiet"], nproc=2, timeout=120)
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-2000:] for r in ranks]
    one, two = (sorted(p.name for p in (tmp_path / out).iterdir()) for out in ("one", "two"))
    assert one == two and len(one) == 7
    for name in one:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
