"""Shards served over HTTP (issue 38, section 1): `data.path` at an http:// URL, read-only, with ranged GETs.

The server is a small one of this file on 127.0.0.1 and a free port, over a folder `islands shard` wrote: Python's
SimpleHTTPRequestHandler answers a `Range:` header with the whole file, so this handler answers it with 206 and the
bytes asked (RFC 9110, section 14), and counts the requests it saw."""

import functools
import http.server
import itertools
import os
import re
import shutil
import threading

import numpy as np
import pytest
import torch
from conftest import tiny_unet_config, write_config

from islands.cli import main
from islands.config import validate
from islands.data import build_data, storage
from islands.data.loader import stream_loader
from islands.data.order import build_order
from islands.parallel.launch import free_port
from islands.rundir import latest_checkpoint, load_weights
from islands.trainer import train

pytest.importorskip("fsspec", reason="shards at a URL are read through fsspec: pip install 'islands[remote]'")
pytest.importorskip("aiohttp", reason="fsspec reads http:// through aiohttp: pip install 'islands[remote]'")

SHARD = 10  # image_npz's 64 examples: 7 shards, the last of 4


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """A static file server that answers `Range: bytes=A-B` with 206 and those bytes; `seen` counts the requests of
    each method, and those with a range."""

    seen: dict

    def log_message(self, *args):  # no request log on the test's stderr
        pass

    def send_head(self):
        self.seen[self.command] = self.seen.get(self.command, 0) + 1
        path = self.translate_path(self.path)
        asked = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if asked is None or not os.path.isfile(path):
            return super().send_head()
        self.seen["ranged"] = self.seen.get("ranged", 0) + 1
        size = os.path.getsize(path)
        start, end = int(asked.group(1)), min(int(asked.group(2) or size - 1), size - 1)
        f = open(path, "rb")  # noqa: SIM115 (the server's copyfile reads and closes it)
        f.seek(start)
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        return _Bounded(f, end - start + 1)


class _Bounded:
    """The first `n` bytes from where `f` stands (what copyfile sends of a range)."""

    def __init__(self, f, n: int):
        self.f, self.left = f, n

    def read(self, size: int = -1) -> bytes:
        data = self.f.read(self.left if size < 0 else min(size, self.left))
        self.left -= len(data)
        return data

    def close(self) -> None:
        self.f.close()


@pytest.fixture
def web(tmp_path):
    """A web server on 127.0.0.1 over the folder tmp_path/www: (its URL, the folder, the requests it saw)."""
    folder = tmp_path / "www"
    folder.mkdir()
    seen = {}
    handler = type("Handler", (RangeHandler,), {"seen": seen})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", folder, seen
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def shard_to(tmp_path, image_npz, out: str) -> int:
    """`islands shard` of image_npz into `out` (a folder or a URL), in shards of SHARD. -> its exit status."""
    config = write_config(tmp_path / "npz.yaml", {"run_dir": str(tmp_path / "r"),
                                                  "data": {"source": "npz", "path": str(image_npz)}})
    return main(["shard", config, out, "--shard-size", str(SHARD), "--quiet"])


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_a_run_reads_shards_over_http_in_blocks_with_one_ranged_request_a_block(tmp_path, image_npz, web):
    """The loader of a config whose data.path is the served folder (blocks, the default for a URL) gives the
    examples, positions and flips of the same config on the local folder in blocks order; the server saw one ranged
    GET per block (and none for the tars outside them), and the training from it ends with the same weights."""
    url, folder, seen = web
    assert shard_to(tmp_path, image_npz, str(folder / "shards")) == 0
    blocks = {"source": "shards", "flip": True, "block": 4, "window": 2}
    short = {"images": 16, "checkpoint_every": 16, "sample_every": 0, "log_every": 8}
    local = validate(tiny_unet_config(tmp_path / "local", image_npz, train=short,
                                      data={**blocks, "path": str(folder / "shards"), "order": "blocks"}))
    remote = validate(tiny_unet_config(tmp_path / "remote", image_npz, train=short,
                                       data={**blocks, "path": f"{url}/shards/"}))
    assert remote.data.order == "blocks"
    a, b = build_data(local.data, local.seed), build_data(remote.data, remote.seed)
    assert b.remote and len(b) == len(a) == 64
    seen.clear()
    order = build_order(b, remote.seed, remote.data.order, remote.data.block, remote.data.window)
    assert len(order.first) == 19  # 6 shards of 10 in blocks of 4 (3 each) and one of 4
    batches = [stream_loader(s, 16, remote.seed, order=build_order(s, remote.seed, "blocks", 4, 2))
               for s in (a, b)]
    for x, y in itertools.islice(zip(*batches, strict=True), 4):  # one epoch
        assert torch.equal(x.positions, y.positions) and torch.equal(x.x, y.x) and torch.equal(x.condition, y.condition)
    assert seen.get("ranged") == 19, seen  # every block once, one request each, nothing else read

    for cfg in (local, remote):
        train(cfg, progress=False)
    x, y = (load_weights(latest_checkpoint(tmp_path / run) / "model.safetensors") for run in ("local", "remote"))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_a_missing_folder_and_a_server_that_is_down_are_one_line_naming_the_url(tmp_path, image_npz, web,
                                                                                capsys):
    url, folder, _ = web
    assert shard_to(tmp_path, image_npz, str(folder / "shards")) == 0

    def train_from(path: str) -> int:
        capsys.readouterr()
        return main(["train", write_config(tmp_path / "c.yaml", tiny_unet_config(
            tmp_path / "run", image_npz, data={"source": "shards", "path": path})), "--quiet"])

    assert train_from(f"{url}/nothing-here") == 2  # the server answers 404
    err = one_line(capsys)
    assert f"{url}/nothing-here" in err and "no manifest.json" in err, err

    (folder / "shards" / "shard-000002.tar").unlink()  # a shard the manifest lists, gone from the server
    assert train_from(f"{url}/shards") == 2
    err = one_line(capsys)
    assert f"{url}/shards/shard-000002.tar is missing" in err, err
    with pytest.raises(storage.StorageError, match=r"000002.tar: cannot look it up: no such object \(HTTP 404\)$"):
        storage.stat(f"{url}/shards/shard-000002.tar")  # the server's answer, not fsspec's FileNotFoundError alone

    shutil.rmtree(folder / "shards")
    nobody = f"http://127.0.0.1:{free_port()}/shards"  # nothing listens there
    assert train_from(nobody) == 2
    err = one_line(capsys)
    assert err.startswith(f"islands: {nobody}/manifest.json: cannot reach its server") and "does not answer" in err, err


def test_writing_to_a_web_server_is_refused_in_one_line_before_anything_is_written(tmp_path, image_npz, web, capsys):
    url, folder, seen = web
    seen.clear()
    assert shard_to(tmp_path, image_npz, f"{url}/shards") == 2
    err = one_line(capsys)
    assert err == (f"islands: {url}/shards: cannot write: a web server (http, https) is read-only here; write to a "
                   "local folder or a bucket (s3://, gs://) and serve that"), err
    assert main(["index", str(tmp_path / "none-*.tar"), f"{url}/index", "--quiet"]) == 2
    assert "cannot write: a web server (http, https) is read-only" in one_line(capsys)
    assert not seen and not any(folder.iterdir())  # refused before any request


def test_islands_verify_checks_a_served_folder_and_names_a_changed_shard(tmp_path, image_npz, web, capsys):
    url, folder, _ = web
    assert shard_to(tmp_path, image_npz, str(folder / "shards")) == 0
    capsys.readouterr()
    assert main(["verify", f"{url}/shards", "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == f"{url}/shards: all 64 examples good (every member's sha256 and " \
                                              "every image checked)"
    tar = folder / "shards" / "shard-000001.tar"
    at = int(np.load(folder / "shards" / "shard-000001.idx.npy")[3, 0, 0])
    data = bytearray(tar.read_bytes())
    data[at + 1] ^= 1  # example 13's PNG signature
    tar.write_bytes(bytes(data))
    assert main(["verify", f"{url}/shards", "--quiet"]) == 2
    out, err = capsys.readouterr()
    assert len(out.strip().splitlines()) == 1 and f"{url}/shards/shard-000001.tar" in out, out
    assert len(err.strip().splitlines()) == 1 and "1 of 64 examples are bad" in err, err
