"""Shards in object storage (issue 38, section 1): `islands shard` and `islands index` write to a bucket the bytes they
write to a disk, a run reads them back with ranged requests (a block of examples per request in `blocks` order, one
per example in `global`), resumes exactly on another number of ranks and workers, and every failure of the store (an
object changed under a run, a key or bucket missing, an endpoint that does not answer) is one line naming the URL.

The store is moto's S3 server on 127.0.0.1 and a free port, started for each test and stopped after; the endpoint
and the (fake) keys reach s3fs through the environment only, as they would on a cluster."""

import itertools
import logging
import os
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_unet_config, write_config

from islands.cli import main
from islands.config import validate
from islands.data import build_data, storage
from islands.data.loader import stream_loader
from islands.data.order import BlockOrder, GlobalOrder
from islands.data.registry import build_source
from islands.data.shards import ShardSource
from islands.parallel.launch import free_port
from islands.rundir import latest_checkpoint, load_weights
from islands.trainer import train

moto_server = pytest.importorskip("moto.server", reason="the object-storage tests run moto's S3 server: "
                                                        "pip install 'moto[server]' (the test extra)")
s3fs = pytest.importorskip("s3fs", reason="shards at s3:// URLs are read through s3fs: pip install 'islands[remote]'")

BUCKET = "islands-test"
SHARD = 10  # image_npz's 64 examples: 7 shards, the last of 4


def _fresh_clients() -> None:
    """s3fs keeps one client per process and arguments, made with the environment of its first use."""
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3(monkeypatch):
    """An S3 endpoint on 127.0.0.1 with an empty bucket; its address and fake keys in the environment only."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server's request log
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    # moto keeps its buckets in the process, from one server to the next: each test starts with none
    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/moto-api/reset", method="POST"))
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(key, raising=False)
    _fresh_clients()
    s3fs.S3FileSystem().mkdir(BUCKET)
    yield f"s3://{BUCKET}"
    _fresh_clients()
    server.stop()


def _config(tmp_path, image_npz, **data) -> str:
    return write_config(tmp_path / f"c{len(list(tmp_path.glob('c*.yaml')))}.yaml", tiny_unet_config(
        tmp_path / "run", image_npz, data=data))


def _shard(tmp_path, image_npz, out: str) -> None:
    config = write_config(tmp_path / "npz.yaml", {"run_dir": str(tmp_path / "r"),
                                                  "data": {"source": "npz", "path": str(image_npz)}})
    assert main(["shard", config, out, "--shard-size", str(SHARD), "--order", "given", "--quiet"]) == 0


def _objects(url: str) -> dict[str, bytes]:
    return {name: storage.read_bytes(storage.join(url, name)) for name in storage.listdir(url)}


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_islands_shard_writes_to_a_bucket_the_bytes_it_writes_to_a_disk_and_reads_them_back(tmp_path, image_npz,
                                                                                           s3):
    _shard(tmp_path, image_npz, str(tmp_path / "local"))
    _shard(tmp_path, image_npz, f"{s3}/shards/")
    local, remote = _files(tmp_path / "local"), _objects(f"{s3}/shards")
    assert remote == local and len(local) == 22  # 7 tars, indices and sha256 files, the manifest; nothing else
    source = build_source("npz", path=str(image_npz))
    at_url = ShardSource(f"{s3}/shards")
    assert at_url.remote and len(at_url) == 64
    order = np.random.default_rng(0).permutation(64).tolist()
    for a, b in zip(at_url.get(order), source.get(order), strict=True):
        assert torch.equal(a, b)


def test_islands_shard_to_a_bucket_replaces_what_a_killed_writer_left_and_refuses_anything_else(tmp_path, image_npz,
                                                                                               s3, capsys):
    leftover = tmp_path / "left.tar"
    leftover.write_bytes(b"half a shard")
    storage.put(leftover, f"{s3}/again/shard-000003.tar")  # a writer killed mid-shard: no manifest
    _shard(tmp_path, image_npz, f"{s3}/again")
    assert len(storage.listdir(f"{s3}/again")) == 22
    storage.put(leftover, f"{s3}/theirs/notes.txt")
    config = write_config(tmp_path / "npz.yaml", {"run_dir": str(tmp_path / "r"),
                                                  "data": {"source": "npz", "path": str(image_npz)}})
    assert main(["shard", config, f"{s3}/theirs", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{s3}/theirs is not empty" in err, err
    assert storage.listdir(f"{s3}/theirs") == ["notes.txt"]


def test_islands_index_reads_tars_in_a_bucket_and_writes_its_index_there(tmp_path, image_npz, s3):
    """The tars of `islands shard` indexed where they lie: in a bucket, into a bucket, the same indices and the same
    examples as indexed on a disk into a disk."""
    _shard(tmp_path, image_npz, str(tmp_path / "tars"))
    for tar in sorted((tmp_path / "tars").glob("*.tar")):
        storage.put(tar, f"{s3}/tars/{tar.name}")
    assert main(["index", str(tmp_path / "tars"), str(tmp_path / "index"), "--quiet"]) == 0
    assert main(["index", f"{s3}/tars/", f"{s3}/index", "--quiet"]) == 0
    local, remote = _files(tmp_path / "index"), _objects(f"{s3}/index")
    assert remote.keys() == local.keys()
    for name in local:
        if name.endswith(".npy"):
            assert remote[name] == local[name], name
    a, b = (ShardSource(folder, resolution=8, channels=1) for folder in (tmp_path / "index", f"{s3}/index"))
    assert b.remote and [s["tar"] for s in b.manifest["shards"]][:2] == [f"{s3}/tars/shard-000000.tar",
                                                                         f"{s3}/tars/shard-000001.tar"]
    for x, y in zip(a.get(range(64)), b.get(range(64)), strict=True):
        assert torch.equal(x, y)


class Requests:
    """storage.read_range counted: the ranged requests a reader makes."""

    def __init__(self, monkeypatch):
        self.count, real = 0, storage.read_range

        def counted(url, start, end):
            self.count += 1
            return real(url, start, end)

        monkeypatch.setattr(storage, "read_range", counted)


def _epoch(source, order, batch: int = 16) -> tuple[list, list]:
    positions, examples = [], []
    loader = stream_loader(source, batch, seed=3, order=order)
    for b in itertools.islice(loader, len(source) // batch):
        positions += b.positions.tolist()
        examples += [b.x[i] for i in range(len(b.x))]
    return positions, examples


def test_blocks_are_read_with_one_request_each_and_global_with_one_per_example(tmp_path, image_npz, s3,
                                                                                monkeypatch):
    _shard(tmp_path, image_npz, f"{s3}/shards")
    source = ShardSource(f"{s3}/shards")
    truth = build_source("npz", path=str(image_npz))
    order = BlockOrder(source.shard_starts, 4, 2, 3)
    requests = Requests(monkeypatch)
    _, examples = _epoch(source, order)
    blocks = len(order.first)  # 7 shards of 10 (the last 4): 3 + 3 + ... + 1 blocks of 4
    assert requests.count == blocks == 19
    expected = [order.index_of(p) for p in range(64)]
    assert all(torch.equal(x, truth.get([i])[0][0]) for x, i in zip(examples, expected, strict=True))
    requests.count = 0
    _epoch(ShardSource(f"{s3}/shards"), GlobalOrder(64, 3))
    assert requests.count == 64


def test_a_bucket_run_killed_on_two_ranks_resumes_on_one_process_with_two_workers_bit_identically(tmp_path,
                                                                                                  image_npz, s3):
    """Its first 16 images on 2 ranks read from the bucket (blocks, the default for a URL), stopped there; the rest
    on one process with 2 loader workers: the weights of one process that read a local copy straight through in the
    same order. (A run stopped at its checkpoint is what a kill leaves: the tests of killed ranks show the two are
    alike, tests/test_parallel.py.)"""
    from test_parallel import launch_ranks

    torch.set_num_threads(1)  # as each rank computes: the same sums in the same order
    _shard(tmp_path, image_npz, str(tmp_path / "local"))
    _shard(tmp_path, image_npz, f"{s3}/shards")
    short = {"images": 32, "checkpoint_every": 16, "sample_every": 0, "grad_clip": 0.0}
    blocks = {"source": "shards", "flip": True, "block": 4, "window": 2}
    straight = train(validate(tiny_unet_config(tmp_path / "straight", image_npz, model={"dropout": 0.0},
                                               data={**blocks, "path": str(tmp_path / "local"), "order": "blocks"},
                                               train=short)), progress=False)
    remote = tiny_unet_config(tmp_path / "moved", image_npz, model={"dropout": 0.0},
                              data={**blocks, "path": f"{s3}/shards"}, train=short)
    assert validate(remote).data.order == "blocks"
    ranks = launch_ranks(2, {**remote, "train": {**remote["train"], "images": 16, "accumulate": 1}}, tmp_path,
                         "parallel.strategy=ddp")  # each rank a micro-batch of the one process's two
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    assert latest_checkpoint(tmp_path / "moved").name == "000000000016"
    moved = train(validate({**remote, "data": {**remote["data"], "workers": 2}}), progress=False)
    for name in ("model.safetensors", "ema.safetensors"):
        a, b = (load_weights(latest_checkpoint(run) / name) for run in (straight, moved))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_an_object_changed_under_a_run_stops_its_resume_with_one_line(tmp_path, image_npz, s3, capsys):
    _shard(tmp_path, image_npz, f"{s3}/shards")
    config = write_config(tmp_path / "c.yaml", tiny_unet_config(
        tmp_path / "run", image_npz, data={"source": "shards", "path": f"{s3}/shards", "block": 4, "window": 2},
        train={"images": 16, "checkpoint_every": 16, "sample_every": 0}))
    assert main(["train", config, "--quiet"]) == 0
    for shard in range(7):  # every example's PNG signature flipped, each object's size unchanged
        url = f"{s3}/shards/shard-{shard:06d}.tar"
        data = bytearray(storage.read_bytes(url))
        storage.download(f"{s3}/shards/shard-{shard:06d}.idx.npy", tmp_path / "i.npy")
        for at in np.load(tmp_path / "i.npy")[:, 0, 0]:
            data[int(at) + 1] ^= 1
        (tmp_path / "t.tar").write_bytes(bytes(data))
        storage.put(tmp_path / "t.tar", url)
    capsys.readouterr()
    assert main(["train", config, "train.images=32", "--quiet"]) == 2
    err = _one_line(capsys)
    assert f"shard {s3}/shards/shard-00000" in err and "changed since it was written: the png of example" in err, err
    (tmp_path / "t.tar").write_bytes(b"shorter")
    storage.put(tmp_path / "t.tar", f"{s3}/shards/shard-000002.tar")
    assert main(["train", config, "train.images=32", "--quiet"]) == 2
    assert f"shard {s3}/shards/shard-000002.tar changed since it was written: 7 bytes" in _one_line(capsys)


def test_a_missing_key_a_missing_bucket_and_a_wrong_endpoint_are_one_line_each(tmp_path, image_npz, s3, capsys,
                                                                                monkeypatch):
    _shard(tmp_path, image_npz, f"{s3}/shards")
    source = ShardSource(f"{s3}/shards")
    storage.remove(f"{s3}/shards/shard-000003.idx.npy")  # read where a process first maps its shard
    with pytest.raises(storage.StorageError, match=f"^{s3}/shards/shard-000003.idx.npy: cannot read: no such object"):
        source.get([35])
    storage.remove(f"{s3}/shards/shard-000003.tar")
    assert main(["train", _config(tmp_path, image_npz, source="shards", path=f"{s3}/shards"), "--quiet"]) == 2
    assert f"shard {s3}/shards/shard-000003.tar is missing" in _one_line(capsys)

    assert main(["train", _config(tmp_path, image_npz, source="shards", path="s3://no-such-bucket/shards"),
                 "--quiet"]) == 2
    err = _one_line(capsys)
    assert "s3://no-such-bucket/shards/manifest.json: cannot read: no bucket 'no-such-bucket'" in err, err

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    _fresh_clients()
    assert main(["train", _config(tmp_path, image_npz, source="shards", path=f"{s3}/shards"), "--quiet"]) == 2
    err = _one_line(capsys)
    assert f"{s3}/shards/manifest.json" in err and "AWS_ENDPOINT_URL" in err, err


def test_data_cache_keeps_whole_shards_within_its_budget_and_reads_the_same_examples(tmp_path, image_npz, s3):
    _shard(tmp_path, image_npz, f"{s3}/shards")
    sizes = [s["bytes"] for s in ShardSource(f"{s3}/shards").manifest["shards"]]
    budget = 3 * max(sizes)
    cfg = validate(tiny_unet_config(tmp_path / "run", image_npz, data={
        "source": "shards", "path": f"{s3}/shards", "cache": str(tmp_path / "cache"), "cache_bytes": budget}))
    source, truth = build_data(cfg.data, 3), build_source("npz", path=str(image_npz))
    order = np.random.default_rng(1).permutation(64).tolist()
    for a, b in zip(source.get(order), truth.get(order), strict=True):
        assert torch.equal(a, b)
    kept = list((tmp_path / "cache" / "tars").iterdir())
    assert 0 < sum(p.stat().st_size for p in kept) <= budget and len(kept) == 3
    assert {p.name for p in kept} <= {f"{s['sha256']}.tar" for s in source.manifest["shards"]}
    assert not any(p.name.startswith(".") for p in kept)  # nothing half-written left beside them
    os.utime(kept[0], ns=(0, 0))  # the least recently used goes first
    storage.DiskCache(tmp_path / "cache" / "tars", budget).make_room(max(sizes))
    assert not kept[0].exists() and all(p.exists() for p in kept[1:])


def test_blocks_is_the_default_order_for_a_url_and_global_stays_it_for_a_local_folder(tmp_path, image_npz):
    def order(path, **data):
        return validate(tiny_unet_config(tmp_path / "r", image_npz, data={"source": "shards", "path": path,
                                                                           **data})).data.order

    assert order("s3://bucket/shards") == "blocks" and order("https://host/shards/") == "blocks"
    assert order(str(tmp_path / "shards")) == "global" and order(f"file://{tmp_path}/shards") == "global"
    assert order("s3://bucket/shards", order="global") == "global"  # what a config says stays


def test_refused_credentials_are_one_line_naming_where_credentials_come_from(tmp_path, image_npz, s3, capsys,
                                                                             monkeypatch):
    """moto checks no signature by default; with its authentication on, the fake keys are an unknown user's."""
    from moto import settings

    _shard(tmp_path, image_npz, f"{s3}/shards")
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    _fresh_clients()
    assert main(["train", _config(tmp_path, image_npz, source="shards", path=f"{s3}/shards"), "--quiet"]) == 2
    err = _one_line(capsys)
    assert f"{s3}/shards/manifest.json" in err and "access refused" in err and "AWS_ACCESS_KEY_ID" in err, err


def test_islands_encode_to_a_bucket_writes_a_disk_s_bytes_and_a_run_trains_from_them_as_from_the_disk(
        tmp_path, image_npz, s3):
    """The latents of test_encode's tiny autoencoder put in a bucket are the bytes `islands encode` writes to a
    disk, and a latent run reading them from the bucket ends with the weights of the same run reading the disk."""
    from test_encode import stored_run
    from test_latents import saved_vae

    vae = saved_vae(tmp_path / "vae")
    config = write_config(tmp_path / "c.yaml", {"run_dir": str(tmp_path / "r"),
                                                "data": {"source": "npz", "path": str(image_npz), "flip": True}})
    for out in (str(tmp_path / "latents"), f"{s3}/latents/"):
        assert main(["encode", config, out, "--autoencoder", str(vae), "--shard-size", str(SHARD),
                     "--batch-size", "4", "--quiet"]) == 0
    local = _files(tmp_path / "latents")
    assert _objects(f"{s3}/latents") == local and len(local) == 22
    short = {"images": 16, "checkpoint_every": 16, "sample_every": 0}
    runs = []
    for name, path in (("disk", str(tmp_path / "latents")), ("bucket", f"{s3}/latents")):
        cfg = stored_run(tmp_path / name, path, vae, **short).model_dump()  # test_encode's run, in blocks of 4
        cfg["data"].update(path=path, order="blocks", block=4, window=2)
        runs.append(train(validate(cfg), progress=False))
    a, b = (load_weights(latest_checkpoint(run) / "model.safetensors") for run in runs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_islands_verify_on_a_bucket_checks_every_member_and_names_a_changed_object_in_one_line(tmp_path, image_npz,
                                                                                              s3, capsys):
    _shard(tmp_path, image_npz, f"{s3}/shards")
    capsys.readouterr()
    assert main(["verify", f"{s3}/shards", "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == (f"{s3}/shards: all 64 examples good (every member's sha256 and every "
                                               "image checked)")
    url = f"{s3}/shards/shard-000004.tar"
    data = bytearray(storage.read_bytes(url))
    storage.download(f"{s3}/shards/shard-000004.idx.npy", tmp_path / "i.npy")
    data[int(np.load(tmp_path / "i.npy")[7, 0, 0]) + 1] ^= 1  # example 47's PNG signature, the size unchanged
    (tmp_path / "t.tar").write_bytes(bytes(data))
    storage.put(tmp_path / "t.tar", url)
    assert main(["verify", f"{s3}/shards", "--quiet"]) == 2
    out, err = capsys.readouterr()
    assert len(out.strip().splitlines()) == 1 and url in out, out
    assert len(err.strip().splitlines()) == 1 and "1 of 64 examples are bad" in err, err


def _sha256s(url: str) -> dict[str, str]:
    import hashlib

    return {name: hashlib.sha256(data).hexdigest() for name, data in _objects(url).items()}


def test_islands_shard_and_index_on_two_ranks_put_in_a_bucket_the_bytes_one_process_puts(tmp_path, image_npz, s3):
    """Each rank writes every second shard (and indexes every second tar) and rank 0 the manifest: the objects are
    those one process writes, byte for byte, the manifest included, and nothing else is left in the prefix."""
    from conftest import run_ranks

    config = write_config(tmp_path / "npz.yaml", {"run_dir": str(tmp_path / "r"),
                                                  "data": {"source": "npz", "path": str(image_npz)}})
    for command, made in ((["shard", config], "shards"), (["index", f"{s3}/one-shards/"], "index")):
        for out, nproc in ((f"{s3}/one-{made}", 1), (f"{s3}/two-{made}", 2)):
            extra = ["--shard-size", str(SHARD)] if command[0] == "shard" else []
            ranks = run_ranks([*command, out, *extra, "--quiet"], nproc=nproc, timeout=180)
            assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
        one, two = _sha256s(f"{s3}/one-{made}"), _sha256s(f"{s3}/two-{made}")
        assert one == two and "manifest.json" in one, (made, sorted(one), sorted(two))
    assert len(one) == 15  # the index: an index and a sha256 file per tar, the manifest
