"""Shards in Google Cloud Storage (issue 38, section 1): gs:// URLs through gcsfs, against gcp-storage-emulator (a
pure-Python GCS JSON API) on 127.0.0.1 and a free port, started for each test and stopped after. gcsfs finds it as
it would on a developer's machine: STORAGE_EMULATOR_HOST in the environment, never the config."""

import importlib
import itertools
import logging
import sys

import pytest
import torch
from conftest import tiny_unet_config, write_config
from test_url_http import one_line, shard_to

from islands.cli import main
from islands.config import validate
from islands.data import build_data, storage
from islands.data.loader import stream_loader
from islands.data.order import build_order
from islands.data.shards import ShardSource
from islands.parallel.launch import free_port

BUCKET = "islands-test"


def _fresh_clients() -> None:
    """gcsfs keeps one client per process and arguments, made with the environment of its first use."""
    import gcsfs

    gcsfs.GCSFileSystem.clear_instance_cache()


@pytest.fixture
def gcs(monkeypatch):
    """A GCS endpoint on 127.0.0.1 with an empty bucket: (its gs:// URL, the ranged GETs it answered)."""
    pytest.importorskip("gcsfs", reason="gs:// URLs are read through gcsfs: pip install 'islands[remote]'")
    emulator = pytest.importorskip("gcp_storage_emulator.server", reason="the gs:// tests run gcp-storage-emulator: "
                                                                         "pip install gcp-storage-emulator (the test "
                                                                         "extra)")
    from gcp_storage_emulator.handlers import objects

    # The emulator logs each missing object as an error; gcsfs warns at each open that, without Google credentials,
    # it cannot ask the bucket's layout (it falls back to the plain API, which is what the emulator serves).
    loggers = {name: logging.getLogger(name).level for name in ("gcp_storage_emulator", "gcsfs")}
    for name in loggers:
        logging.getLogger(name).setLevel(logging.CRITICAL)  # setLevel: the loggers' cached levels go too
    ranged = []

    def download(request, response, *args, **kwargs):
        if request.get_header("range", None):
            ranged.append(request.params["object_id"])
        return objects.download(request, response, *args, **kwargs)

    for _, handlers in emulator.HANDLERS:
        for method, handler in list(handlers.items()):
            if handler is objects.download:
                monkeypatch.setitem(handlers, method, download)
    port = free_port()
    server = emulator.create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    _fresh_clients()
    yield f"gs://{BUCKET}", ranged
    _fresh_clients()
    server.stop()
    for name, level in loggers.items():
        logging.getLogger(name).setLevel(level)


def test_islands_shard_to_a_gs_bucket_writes_a_disk_s_bytes_and_a_run_reads_them_in_blocks_of_one_request(
        tmp_path, image_npz, gcs):
    url, ranged = gcs
    assert shard_to(tmp_path, image_npz, str(tmp_path / "local")) == 0
    assert shard_to(tmp_path, image_npz, f"{url}/shards/") == 0
    local = {p.name: p.read_bytes() for p in (tmp_path / "local").iterdir()}
    remote = {name: storage.read_bytes(f"{url}/shards/{name}") for name in storage.listdir(f"{url}/shards")}
    assert remote == local and len(local) == 22  # 7 tars, indices and sha256 files, the manifest; nothing else

    data = {"source": "shards", "flip": True, "block": 4, "window": 2}
    at_disk = validate(tiny_unet_config(tmp_path / "a", image_npz, data={**data, "path": str(tmp_path / "local"),
                                                                         "order": "blocks"}))
    at_gs = validate(tiny_unet_config(tmp_path / "b", image_npz, data={**data, "path": f"{url}/shards"}))
    assert at_gs.data.order == "blocks"  # a URL's default
    a, b = build_data(at_disk.data, at_disk.seed), build_data(at_gs.data, at_gs.seed)
    assert isinstance(b, ShardSource) and b.remote and len(b) == 64
    ranged.clear()
    loaders = [stream_loader(s, 16, at_gs.seed, order=build_order(s, at_gs.seed, "blocks", 4, 2)) for s in (a, b)]
    for x, y in itertools.islice(zip(*loaders, strict=True), 4):  # one epoch
        assert torch.equal(x.positions, y.positions) and torch.equal(x.x, y.x) and torch.equal(x.condition, y.condition)
    # every block read once with one ranged GET: 3 blocks of 4 in each shard of 10, 1 in the last of 4
    assert sorted(ranged) == sorted([f"shards/shard-{s:06d}.tar" for s in range(6) for _ in range(3)] +
                                    ["shards/shard-000006.tar"]), ranged


def test_a_missing_gs_bucket_is_one_line_for_a_reader_and_a_writer(tmp_path, image_npz, gcs, capsys):
    config = write_config(tmp_path / "c.yaml", tiny_unet_config(
        tmp_path / "run", image_npz, data={"source": "shards", "path": "gs://no-such-bucket/shards"}))
    assert main(["train", config, "--quiet"]) == 2
    err = one_line(capsys)
    assert err == "islands: gs://no-such-bucket/shards/manifest.json: cannot read: no bucket 'no-such-bucket' at " \
                  "the endpoint", err
    assert shard_to(tmp_path, image_npz, "gs://no-such-bucket/shards") == 2
    err = one_line(capsys)
    assert err == "islands: gs://no-such-bucket/shards: cannot write: no bucket 'no-such-bucket' at the endpoint " \
                  "(create it first)", err


def test_an_emulator_that_is_down_is_one_line_naming_where_the_endpoint_comes_from(tmp_path, image_npz, gcs,
                                                                                 capsys, monkeypatch):
    import gcsfs.retry

    class NoBackOff:  # gcsfs' retry module sees asyncio without its back-off: 6 tries of a refused connection
        async def sleep(self, _):  # in an instant, not 16 s a request
            pass

    monkeypatch.setattr(gcsfs.retry, "asyncio", NoBackOff())
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    _fresh_clients()
    config = write_config(tmp_path / "c.yaml", tiny_unet_config(
        tmp_path / "run", image_npz, data={"source": "shards", "path": f"{gcs[0]}/shards"}))
    assert main(["train", config, "--quiet"]) == 2
    err = one_line(capsys)
    assert f"{gcs[0]}/shards/manifest.json: cannot" in err and "STORAGE_EMULATOR_HOST" in err, err


def test_a_gs_url_without_gcsfs_is_one_line_naming_the_extra(tmp_path, image_npz, capsys, monkeypatch):
    """Where gcsfs is not installed (simulated: its import fails, and fsspec forgets the class it may have loaded)."""
    monkeypatch.setitem(sys.modules, "gcsfs", None)
    for scheme in ("gs", "gcs"):
        monkeypatch.delitem(importlib.import_module("fsspec.registry")._registry, scheme, raising=False)
    config = write_config(tmp_path / "c.yaml", tiny_unet_config(
        tmp_path / "run", image_npz, data={"source": "shards", "path": "gs://bucket/shards"}))
    assert main(["train", config, "--quiet"]) == 2
    err = one_line(capsys)
    assert err.startswith("islands: gs://bucket/shards/manifest.json: no file system for this URL") and \
           "pip install 'islands[remote]'" in err, err
