"""A shard folder handed over by a hostile island or a careless colleague (issue 35): bytes changed in place with
their size and mtime kept, classes and offsets out of range, a manifest of absurd numbers, files that link out of
the folder, and a `.OUT.partial` that is a person's folder. Each is refused in one line naming what is wrong."""

import hashlib
import json
import re

import numpy as np
import pytest
import torch
from conftest import tiny_unet_config, write_config
from hostile import edit_json, flip_byte_in_place, link_out
from test_shards import SHARD, data_config, shards_of

from islands.cli import main
from islands.config import validate
from islands.data import build_data
from islands.data.fingerprint import data_fingerprint
from islands.data.registry import build_source
from islands.data.shards import ShardSource, digests_name, index_name, shard_name, whole_sha256
from islands.errors import DataError
from islands.rundir import BUILDING_MARKER
from islands.untrusted import file_sha256


def _resign(folder):
    """What an author who rewrote files in place does to keep the folder self-consistent: every sha256 the manifest
    lists recomputed from the files as they are now, so that only the reader's own checks can find the change."""
    def resign(m):
        for s in m["shards"]:
            for key, name in (("sha256", "tar"), ("index_sha256", "index"), ("digests_sha256", "digests")):
                s[key] = file_sha256(folder / s[name])
        m["sha256"] = whole_sha256(m["shards"])
    edit_json(folder / "manifest.json", resign)


def _where(folder, example: int, member: str) -> tuple[int, int, int, int]:
    """-> (shard, row, column, byte offset of the member's data) of an example's member."""
    shard, row = divmod(example, SHARD)
    column = json.loads((folder / "manifest.json").read_text())["members"].index(member)
    at = int(np.load(folder / index_name(shard))[row, column, 0])
    return shard, row, column, at


def _forge_member(folder, example: int, member: str, data: bytes) -> None:
    """An example's member rewritten in place (the same size), its sha256 beside the index too, the folder re-signed."""
    shard, row, column, at = _where(folder, example, member)
    with open(folder / shard_name(shard), "r+b") as f:
        f.seek(at)
        f.write(data)
    digests = np.load(folder / digests_name(shard))
    digests[row, column] = np.frombuffer(hashlib.sha256(data).digest(), dtype=np.uint8)
    np.save(folder / digests_name(shard), digests, allow_pickle=False)
    _resign(folder)


@pytest.fixture
def npz_shards(tmp_path, image_npz):
    return shards_of(build_source("npz", path=str(image_npz)), tmp_path / "shards")


@pytest.fixture
def float_npz(tmp_path):
    """Float images: a byte changed in their data is another valid image, which trains without a word unless the
    reader checks the bytes."""
    x = np.random.default_rng(0).uniform(-1, 1, size=(64, 1, 8, 8)).astype(np.float32)
    np.savez(tmp_path / "float.npz", x=x, y=np.arange(64) % 4)
    return tmp_path / "float.npz"


# --- item 3: trusted by (path, size, mtime) ---------------------------------------------------------------------------

def test_shards_changed_in_place_with_size_and_mtime_kept_stop_a_new_run_with_one_line(tmp_path, float_npz, capsys):
    """A run checks the shards and its memory keeps the pass; then every example's data changes by one byte, the
    files' sizes and mtimes kept: a new run stops at its first read with one line naming the shard and the example."""
    folder = shards_of(build_source("npz", path=str(float_npz)), tmp_path / "shards")
    short = {"images": 16, "checkpoint_every": 16, "sample_every": 0}
    data = {"source": "shards", "path": str(folder)}
    first = write_config(tmp_path / "first.yaml", tiny_unet_config(tmp_path / "first", float_npz, data=data,
                                                                   train=short))
    assert main(["train", first, "--quiet"]) == 0
    for example in range(64):  # the first byte of each float image's data: another valid float
        _, _, _, at = _where(folder, example, "x.npy")
        flip_byte_in_place(folder / shard_name(example // SHARD), at + 128)  # past the .npy header
    capsys.readouterr()
    second = write_config(tmp_path / "second.yaml", tiny_unet_config(tmp_path / "second", float_npz, data=data,
                                                                     train=short))
    assert main(["train", second, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"shard {folder}/shard-0000" in err and "changed since it was written" in err
    assert "the x.npy of example " in err, err


def test_a_data_file_changed_in_place_with_size_and_mtime_kept_is_fingerprinted_anew(tmp_path):
    """The same memory keeps other sources' fingerprints: a partition must not accept changed pixels because the
    file's size and mtime are the ones it was made of."""
    path = tmp_path / "images.npy"
    np.save(path, np.random.default_rng(1).integers(0, 256, (16, 1, 4, 4), dtype=np.uint8))
    before = data_fingerprint(build_source("npz", path=str(path)))
    flip_byte_in_place(path)  # the last pixel
    assert data_fingerprint(build_source("npz", path=str(path))) != before


def test_shards_of_the_format_without_member_sha256_are_hashed_at_every_start(tmp_path, image_npz, npz_shards):
    """A folder written before shards carried their members' sha256 (islands-shards/1) is still read; its check is
    remembered by the tars' content, so a byte changed in place with size and mtime kept stops the next start."""
    def as_format_1(m):
        m["format"] = "islands-shards/1"
        for s in m["shards"]:
            del s["digests"], s["digests_sha256"]
    edit_json(npz_shards / "manifest.json", as_format_1)
    data = validate(tiny_unet_config(tmp_path / "run", image_npz, data={"source": "shards",
                                                                      "path": str(npz_shards)})).data
    build_data(data, 0, check=True)
    _, _, _, at = _where(npz_shards, 23, "png")
    flip_byte_in_place(npz_shards / shard_name(2), at + 40)
    with pytest.raises(DataError, match=f"shard {npz_shards}/shard-000002.tar changed since it was written"):
        build_data(data, 0, check=True)


# --- item 4: values from the files used unchecked ------------------------------------------------------------------

@pytest.mark.parametrize("value", [b"4", b"9", b"x"])  # 4 = num_classes: the null row of unconditional training
def test_a_class_out_of_range_is_refused_naming_the_shard_the_example_and_the_value(npz_shards, value):
    _forge_member(npz_shards, 23, "cls", value)
    shards = ShardSource(npz_shards)
    says = f"shard {npz_shards}/shard-000002.tar: example 23 has class {value.decode()!r}, not one of the manifest's"
    with pytest.raises(DataError, match=re.escape(f"{says} 0..3")):
        shards.get([23])
    shards.check()  # a run's start reads no tar (issue 36): the read above stops it, and islands verify finds it
    assert [bad.startswith(says) for bad in shards.verify()] == [True]


@pytest.mark.parametrize("offset, size", [(-512, None), (None, 1 << 40)])
def test_an_index_offset_outside_the_tar_is_refused_in_one_line(npz_shards, offset, size):
    index = np.load(npz_shards / index_name(1))
    at, length = (int(v) for v in index[3, 0])
    index[3, 0] = (at if offset is None else offset, length if size is None else size)
    np.save(npz_shards / index_name(1), index, allow_pickle=False)
    _resign(npz_shards)
    with pytest.raises(DataError, match=f"shard index {npz_shards}/shard-000001.idx.npy: the png of example 13 is "
                                        f"{length if size is None else size} bytes at byte "
                                        f"{at if offset is None else offset}, outside the"):
        ShardSource(npz_shards).get([13])


@pytest.mark.parametrize("key, value", [("num_classes", 1 << 40), ("shape", [-1, 8, 8]), ("shard_size", 0),
                                        ("shape", [1, 1 << 20, 1 << 20]), ("examples", True)])
def test_a_manifest_of_absurd_numbers_is_refused_naming_the_key(npz_shards, key, value):
    edit_json(npz_shards / "manifest.json", lambda m: m.update({key: value}))
    with pytest.raises(DataError, match=f"shard manifest {npz_shards}/manifest.json: .*{key}"):
        ShardSource(npz_shards)


# --- item 7: links out of the folder -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["manifest.json", "shard-000004.tar", "shard-000004.idx.npy",
                                  "shard-000004.sha256.npy"])
def test_a_file_that_links_out_of_the_shard_folder_is_refused(tmp_path, npz_shards, name):
    link_out(npz_shards, name, tmp_path / "elsewhere" / name)
    with pytest.raises(DataError, match=f"shard folder {npz_shards}: {name} leads out of the folder"):
        ShardSource(npz_shards).get(range(64))


# --- item 6: a `.OUT.partial` that is a person's folder -------------------------------------------------------------

def test_a_partial_folder_islands_did_not_make_is_never_removed(tmp_path, image_npz, capsys):
    config = write_config(tmp_path / "c.yaml", data_config(tmp_path, image_npz))
    theirs = tmp_path / ".out.partial"
    theirs.mkdir()
    (theirs / "thesis.tex").write_text("keep")
    assert main(["shard", config, str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{theirs} exists and is not a folder Islands was building" in err
    assert (theirs / "thesis.tex").read_text() == "keep" and not (tmp_path / "out").exists()


def test_a_partial_folder_a_killed_shard_left_is_replaced(tmp_path, image_npz):
    config = write_config(tmp_path / "c.yaml", data_config(tmp_path, image_npz))
    left = tmp_path / ".out.partial"
    left.mkdir()
    (left / BUILDING_MARKER).write_text("")
    (left / "shard-000000.tar").write_bytes(b"half")
    assert main(["shard", config, str(tmp_path / "out"), "--quiet", "--shard-size", "10", "--order", "given"]) == 0
    assert not left.exists() and not (tmp_path / "out" / BUILDING_MARKER).exists()
    x, _ = ShardSource(tmp_path / "out").get(range(64))
    assert torch.equal(x, build_source("npz", path=str(image_npz)).get(range(64))[0])
