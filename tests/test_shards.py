"""Tar shards (`islands shard`, `data.source: shards`): the same examples as their source, read by seek, so the
stream resumes exactly on any number of ranks and loader workers; refused by name when missing, cut or changed."""

import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_ranks, tiny_unet, tiny_unet_config, write_config
from PIL import Image

from islands.cli import main
from islands.config import validate
from islands.data import build_data
from islands.data.clusters import ClusterSubset
from islands.data.loader import stream_loader
from islands.data.registry import build_source
from islands.data.shards import ShardSource, write_manifest, write_part
from islands.data.sources import _ArraySource
from islands.ddm.partition import partition
from islands.rundir import latest_checkpoint, load_weights
from islands.trainer import train

SHARD = 10  # examples per shard: image_npz's 64 examples make 7 shards, the last of 4


def shards_of(source, folder: Path, shard_size: int = SHARD) -> Path:
    folder.mkdir()
    write_manifest(folder, write_part(source, folder, shard_size), source, shard_size, {"source": "test"})
    return folder


@pytest.fixture
def npz_shards(tmp_path, image_npz):
    return shards_of(build_source("npz", path=str(image_npz)), tmp_path / "shards")


def test_shards_give_back_their_source_exactly_in_any_order(image_npz, npz_shards):
    source, shards = build_source("npz", path=str(image_npz)), ShardSource(npz_shards)
    assert (len(shards), shards.shape, shards.num_classes, shards.flip) == (64, (1, 8, 8), 4, False)
    assert len(list(npz_shards.glob("shard-*.tar"))) == 7 and shards.member == "png"
    order = np.random.default_rng(1).permutation(64)
    for want, got in zip(source.get(order), shards.get(order), strict=True):
        assert torch.equal(want, got)


def test_a_folder_of_colour_photographs_round_trips_through_png(tmp_path):
    """RGB images decoded and resized by the folder source come back from their PNG members bit for bit, with the
    folder's classes and flip."""
    rng = np.random.default_rng(3)
    for i in range(6):
        (tmp_path / "photos" / f"class{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (13 + i, 11, 3), dtype=np.uint8)).save(
            tmp_path / "photos" / f"class{i % 2}" / f"{i}.png")
    source = build_source("folder", path=str(tmp_path / "photos"), resolution=8)
    shards = ShardSource(shards_of(source, tmp_path / "shards", shard_size=4))
    assert (shards.shape, shards.num_classes, shards.flip, shards.member) == ((3, 8, 8), 2, True, "png")
    for want, got in zip(source.get(range(6)), shards.get(range(6)), strict=True):
        assert torch.equal(want, got)


def test_float_vectors_without_labels_are_stored_as_arrays_and_not_clamped(tmp_path):
    x = np.random.default_rng(0).normal(0, 3, size=(23, 5)).astype(np.float32)  # far outside [-1, 1], as latents
    np.savez(tmp_path / "v.npz", x=x)
    shards = ShardSource(shards_of(build_source("npz", path=str(tmp_path / "v.npz")), tmp_path / "shards"))
    got, labels = shards.get(range(23))
    assert shards.member == "x.npy" and labels is None and torch.equal(got, torch.from_numpy(x))


def test_a_latent_member_is_read_as_stored(tmp_path, monkeypatch):
    """Shards whose examples are `latent.npy` members (as precomputed latents are written) read like any array."""
    from islands.data import shards as module

    x = np.random.default_rng(2).normal(0, 4, size=(12, 4, 2, 2)).astype(np.float32)
    monkeypatch.setattr(module, "example_member", lambda source: "latent.npy")
    folder = shards_of(_ArraySource(torch.from_numpy(x), None, 0), tmp_path / "s")  # far outside [-1, 1]
    monkeypatch.undo()
    shards = ShardSource(folder)
    with tarfile.open(folder / "shard-000000.tar") as tar:
        assert tar.getnames()[:2] == ["000000000.latent.npy", "000000001.latent.npy"]
    assert shards.member == "latent.npy" and torch.equal(shards.get(range(12))[0], torch.from_numpy(x))


def test_the_tars_are_webdatasets_own(image_npz, npz_shards):
    """Another reader of the format, webdataset's, sees the same images and classes."""
    import webdataset

    x, y = build_source("npz", path=str(image_npz)).get(range(64))
    urls = sorted(str(p) for p in npz_shards.glob("shard-*.tar"))
    seen = list(webdataset.WebDataset(urls, shardshuffle=False).decode("l8").to_tuple("__key__", "png", "cls"))
    assert [int(key) for key, _, _ in seen] == list(range(64))
    assert torch.equal(torch.from_numpy(np.stack([png for _, png, _ in seen]))[:, None].float() / 127.5 - 1, x)
    assert [cls for _, _, cls in seen] == y.tolist()


def _stream(source, positions: int, batch: int, start: int = 0, world: int = 1, workers: int = 0) -> dict:
    """{position: (example, label, noise)} of the first `positions` positions from `start`, read by `world` ranks."""
    seen = {}
    for rank in range(world):
        loader = iter(stream_loader(source, batch, seed=5, start=start, rank=rank, world=world, workers=workers,
                                    flip=True))
        for _ in range((positions - start) // batch):
            b = next(loader)
            seen.update({int(p): (b.x[i], int(b.condition[i]), b.noise[i]) for i, p in enumerate(b.positions)})
    return seen


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for p in a:
        assert torch.equal(a[p][0], b[p][0]) and a[p][1] == b[p][1] and torch.equal(a[p][2], b[p][2]), p


@pytest.mark.parametrize("before, after", [((2, 0), (1, 0)), ((1, 0), (3, 0)), ((1, 0), (1, 2))])
def test_a_killed_stream_resumes_at_the_next_image_on_other_ranks_and_workers(image_npz, npz_shards, before, after):
    """Positions 0..47 read on one layout, then, as after a kill at image 48, 48..119 (past the epoch's end at 64)
    on another: every position holds what an uninterrupted single process reading the npz itself gives it."""
    reference = _stream(build_source("npz", path=str(image_npz)), 120, 12)
    shards = ShardSource(npz_shards)
    (w0, k0), (w1, k1) = before, after
    resumed = _stream(shards, 48, 12, world=w0, workers=k0) | _stream(shards, 120, 12, start=48, world=w1, workers=k1)
    _same(reference, resumed)


class Counting(ShardSource):
    """Shards that remember which examples this process read."""

    def read(self, indices, fields):
        self.seen = [*getattr(self, "seen", []), *indices]
        return super().read(indices, fields)


def test_each_rank_reads_its_own_share_of_each_epoch(npz_shards):
    ranks = [Counting(npz_shards) for _ in range(4)]
    for rank, source in enumerate(ranks):
        loader = iter(stream_loader(source, 16, seed=5, rank=rank, world=4))
        for _ in range(4):  # one epoch: 64 examples in global batches of 16
            next(loader)
    shares = [set(source.seen) for source in ranks]
    assert all(len(share) == 16 for share in shares)
    assert set.union(*shares) == set(range(64))  # disjoint, and together the whole epoch


def test_an_expert_reads_its_cluster_from_the_shards_through_a_partition_of_the_source(tmp_path, image_npz,
                                                                                         npz_shards):
    """A partition made of the npz applies to its shards (the same examples, so the same fingerprint), and an
    expert's data is its cluster's examples read from the shards, in order, nothing rewritten."""
    source = build_source("npz", path=str(image_npz))
    made = partition(source, 3, method="kmeans", fine=8, seed=0)
    made.save(tmp_path / "partition")
    for k in range(3):
        cfg = validate({"run_dir": str(tmp_path / "run"), "data": {"source": "shards", "path": str(npz_shards),
                                                                    "partition": str(tmp_path / "partition"),
                                                                    "cluster": k}})
        expert = build_data(cfg.data, cfg.seed, check=True)
        assert isinstance(expert, ClusterSubset) and isinstance(expert.source, ShardSource)
        members = made.members(k)
        x, y = expert.get(range(len(expert)))
        assert len(expert) == len(members) and torch.equal(x, source.get(members)[0])
        assert torch.equal(y, source.get(members)[1])


def test_islands_shard_on_two_ranks_writes_the_bytes_one_process_writes(tmp_path, image_npz):
    config = write_config(tmp_path / "c.yaml", data_config(tmp_path, image_npz))
    assert main(["shard", config, str(tmp_path / "one"), "--shard-size", "10", "--quiet"]) == 0
    ranks = run_ranks(["shard", config, str(tmp_path / "two"), "--shard-size", "10", "--quiet"], nproc=2, timeout=120)
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-2000:] for r in ranks]
    one, two = (sorted(p.name for p in (tmp_path / out).iterdir()) for out in ("one", "two"))
    assert one == two and len(one) == 22  # 7 tars, 7 indices, 7 member sha256 files, the manifest; nothing else
    for name in one:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    assert not list(tmp_path.glob(".*partial"))


def test_islands_shard_shuffles_a_class_sorted_source_by_the_config_seed_and_keeps_every_example_once(tmp_path):
    """A source sorted by class (a folder of class subfolders) is written shuffled by default: every example exactly
    once, each shard of several classes, the manifest naming the seed; the same seed writes the same shards, and
    `--order given` keeps the source's order."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (40, 1, 8, 8), dtype=np.uint8)
    labels = np.repeat(np.arange(4), 10)  # sorted: ten of class 0, then ten of class 1, ...
    np.savez(tmp_path / "sorted.npz", x=x, y=labels)
    cfg = {"run_dir": str(tmp_path / "run"), "seed": 7, "data": {"source": "npz", "path": str(tmp_path / "sorted.npz")}}
    config = write_config(tmp_path / "c.yaml", cfg)
    for out, *order in (("shuffled", ), ("again", ), ("given", "--order", "given")):
        assert main(["shard", config, str(tmp_path / out), "--shard-size", "10", "--quiet", *order]) == 0
    source = build_source("npz", path=str(tmp_path / "sorted.npz"))
    want, want_y = source.get(range(40))
    got, got_y = ShardSource(tmp_path / "shuffled").get(range(40))
    # each written example is one source example, each source example written once (its pixels are unique)
    found = [next(i for i in range(40) if torch.equal(want[i], example)) for example in got]
    assert sorted(found) == list(range(40)) and found != list(range(40))
    assert torch.equal(got_y, want_y[found])
    assert all(len(set(got_y[s:s + 10].tolist())) > 1 for s in range(0, 40, 10)), got_y  # no shard of one class
    assert json.loads((tmp_path / "shuffled" / "manifest.json").read_text())["shuffled_with_seed"] == 7
    assert all((tmp_path / "shuffled" / p.name).read_bytes() == p.read_bytes() for p in (tmp_path / "again").iterdir())
    assert torch.equal(ShardSource(tmp_path / "given").get(range(40))[0], want)
    assert "shuffled_with_seed" not in json.loads((tmp_path / "given" / "manifest.json").read_text())


def data_config(tmp_path, image_npz) -> dict:
    return {"run_dir": str(tmp_path / "run"), "data": {"source": "npz", "path": str(image_npz)}}


def test_islands_shard_refuses_to_write_over_a_folder_with_files(tmp_path, image_npz, capsys):
    config = write_config(tmp_path / "c.yaml", data_config(tmp_path, image_npz))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    assert main(["shard", config, str(tmp_path / "out"), "--quiet"]) == 2
    assert "out is not an empty folder" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["mine.txt"]


def test_a_run_on_shards_resumed_on_two_workers_is_the_run_on_its_source(tmp_path, image_npz, npz_shards):
    """Killed after its first checkpoint and resumed with two loader workers, a run on the shards ends with the
    weights of an uninterrupted run on the npz they were written from, bit for bit."""
    short = {"images": 32, "checkpoint_every": 16, "sample_every": 0}
    straight = train(tiny_unet(tmp_path / "straight", image_npz, train=short), progress=False)
    on_shards = {"source": "shards", "path": str(npz_shards), "flip": True}
    train(tiny_unet(tmp_path / "resumed", image_npz, data=on_shards, train={**short, "images": 16}), progress=False)
    resumed = train(tiny_unet(tmp_path / "resumed", image_npz, data={**on_shards, "workers": 2}, train=short),
                    progress=False)
    for name in ("model.safetensors", "ema.safetensors"):
        a, b = (load_weights(latest_checkpoint(run) / name) for run in (straight, resumed))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def _cut(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 512)


def _flip_a_byte(path: Path, at: int = 512) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 1  # by default the first member's data: its class, "0" become "1", the file's size unchanged
    path.write_bytes(bytes(data))


def _foreign_manifest(folder: Path) -> None:
    """Shards of other images of the same shape, as many in shards of the same sizes (tars of the same bytes)."""
    other = folder.parent / "other"
    other.mkdir()
    np.savez(other / "images.npz", x=np.zeros((64, 1, 8, 8), dtype=np.uint8), y=np.arange(64) % 4)
    foreign = shards_of(build_source("npz", path=str(other / "images.npz")), folder.parent / "foreign")
    (folder / "manifest.json").write_text((foreign / "manifest.json").read_text())


@pytest.mark.parametrize("damage, says", [
    (lambda f: (f / "shard-000003.tar").unlink(), "shard {f}/shard-000003.tar is missing"),
    (lambda f: _cut(f / "shard-000006.tar"), "truncated shard {f}/shard-000006.tar"),
    (_foreign_manifest, ".idx.npy is not the one {f}/manifest.json lists"),  # at the first shard a batch reads
])
def test_damaged_shards_stop_a_run_before_its_first_step_with_one_line(tmp_path, image_npz, npz_shards, capsys,
                                                                       damage, says):
    """A shard lost or cut, or a manifest of another data set: one line naming the file, exit 2, nothing written."""
    config = write_config(tmp_path / "c.yaml", tiny_unet_config(
        tmp_path / "run", image_npz, data={"source": "shards", "path": str(npz_shards)}))
    damage(npz_shards)
    assert main(["train", config, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says.format(f=npz_shards) in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_shard_changed_under_a_run_stops_its_resume_with_one_line(tmp_path, image_npz, npz_shards, capsys):
    """The run trained on the shards, then every shard changed in place (its size and index the same): the resumed
    run, which reads no tar before its first step, stops at the first changed member it reads with one line naming
    the file, exit 2, its checkpoints untouched."""
    config = write_config(tmp_path / "c.yaml", tiny_unet_config(
        tmp_path / "run", image_npz, data={"source": "shards", "path": str(npz_shards)},
        train={"images": 16, "checkpoint_every": 16, "sample_every": 0}))
    assert main(["train", config, "--quiet"]) == 0
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    for shard in range(7):
        index = np.load(npz_shards / f"shard-{shard:06d}.idx.npy")
        for row in range(len(index)):  # a bit of every example's PNG (its signature), the size unchanged
            _flip_a_byte(npz_shards / f"shard-{shard:06d}.tar", int(index[row, 0, 0]))
    capsys.readouterr()
    assert main(["train", config, "train.images=32", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"shard {npz_shards}/shard-00000" in err
    assert "changed since it was written: the png of example" in err, err
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == checkpoints
