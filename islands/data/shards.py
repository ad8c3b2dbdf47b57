"""A data set as webdataset tar shards with an index beside them: written once from any source, read by seek.

    OUT/manifest.json         what the shards hold: examples, shape, classes, members, per shard its count, bytes
                              and sha256, the sha256 of the whole, and the data section it was written from
    OUT/shard-000000.tar      examples 0 .. S-1 in the source's order, webdataset's layout: `000000000.png` (or
                              `.x.npy`, float32; `islands encode`'s latents: `.mean.npy`, `.logvar.npy` and the
                              flip's, stacked along the channels when read), `000000000.txt` (the caption, UTF-8,
                              for a captioned source) and `000000000.cls` (the class, in ASCII)
    OUT/shard-000000.idx.npy  int64 (examples, members, 2): the byte offset and size of each member's data, the
                              members in the manifest's order (`members`); `x` names the one that is the example
    OUT/shard-000000.sha256.npy  uint8 (examples, members, 32): the sha256 of each member's data, checked at every
                              read (format islands-shards/2; a folder of /1 has none, and its tars are hashed whole
                              at every start instead)

The tars are what webdataset, wids and tar read. The index makes them random access (as `wids` does by scanning):
an example is one `pread` of its adjacent members, so the loader orders the stream by position exactly as for an
in-memory source, and a run resumes at any image on any number of ranks and loader workers. Shard i holds examples
[i S, (i + 1) S) whoever wrote it: under torchrun rank r of W writes the shards i = r mod W, and the files are the
same bytes as one process writes. Nothing is unpickled: arrays by `np.load(allow_pickle=False)`, images by PIL.
Examples come back as stored, never clamped: images in [-1, 1], latents on their own scale.

A shard folder may come from elsewhere, so nothing in it is trusted: every file read lies inside the folder (no link
out), the manifest's numbers are bounded, each index's offsets lie inside its tar, a class is one of the manifest's,
and each member's bytes match their sha256 when read. That last check is what lets data/fingerprint.py remember a
run's whole-shard check by the manifest, indices and sha256 files alone: a tar changed afterwards, whatever its
size and mtime, fails at the read of the first changed member, naming it. It costs one sha256 of the bytes read
(about 1.5 GB/s a core, less than decoding a PNG).
"""

import hashlib
import io
import json
import math
import os
import tarfile
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

import numpy as np
import torch
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from tqdm import tqdm

from islands.data import storage
from islands.data.fingerprint import cache_dir
from islands.data.sources import CAPTION, CAPTION_EMBEDDING, LABEL, Source, X
from islands.data.sources import _to_unit as to_unit
from islands.errors import DataError, IslandsWarning
from islands.rundir import Record, one_line
from islands.untrusted import file_sha256, inside

if TYPE_CHECKING:
    from islands.data import tar_index

MANIFEST = "manifest.json"
FORMAT = "islands-shards/2"  # /2: each member's sha256 beside the index, checked at every read
UNCHECKED_FORMAT = "islands-shards/1"  # still read: without member sha256, its tars are hashed at every start
MAX_EXAMPLE_NUMBERS = 1 << 28  # numbers in one example (a GiB of float32): a manifest asking more is not ours
MAX_CLASSES = 1 << 20
OPEN_FILES = 64  # shard files a process keeps open (least recently read closed first)
READ_CHUNK = 1024  # examples taken from the source at a time while writing
HELD_BLOCK = 256  # at a URL: the examples one ranged request reads, unless the loader's order says otherwise
HELD_BLOCKS = 2  # ... and the blocks a process holds, unless the loader's order says otherwise


CAPTION_MEMBER = "caption.npy"  # a caption's packed embedding (islands encode --text-encoder)


def shard_name(i: int) -> str:
    return f"shard-{i:06d}.tar"


def index_name(i: int) -> str:
    return f"shard-{i:06d}.idx.npy"


def digests_name(i: int) -> str:
    return f"shard-{i:06d}.sha256.npy"


def whole_sha256(shards: list[dict]) -> str:
    """The content hash of a shard set: of every shard's name, count and sha256, in order."""
    return hashlib.sha256(json.dumps([[s["tar"], s["examples"], s["sha256"]] for s in shards]).encode()).hexdigest()


# --- writing --------------------------------------------------------------------------------------------------------

def example_member(source: Source) -> str:
    """The member that holds an example: a PNG for 8-bit images (exact, and what people bring), else float32."""
    return "png" if source.quantised and len(source.shape) == 3 and source.shape[0] in (1, 3) else "x.npy"


def _encode(x: torch.Tensor, member: str) -> bytes:
    buffer = io.BytesIO()
    if member == "png":
        u = torch.round((x + 1) * 127.5).clamp_(0, 255).to(torch.uint8)
        if not torch.equal(to_unit(u), x):  # a source that says it is 8-bit must decode back to its own floats
            raise ValueError("a quantised source gave an example that is not an 8-bit image")
        a = u.numpy()
        Image.fromarray(a[0] if a.shape[0] == 1 else a.transpose(1, 2, 0)).save(buffer, format="PNG")
    else:
        np.save(buffer, x.float().numpy(), allow_pickle=False)
    return buffer.getvalue()


def labelling_members(source: Source) -> list[str]:
    """The members that follow an example's arrays: its caption's and its class's, where the source has them."""
    return [*(["txt"] if source.captioned else []), *(["cls"] if source.num_classes else [])]


class ExampleWriter:
    """What each example of a source becomes in a shard: its members (the example; its caption and class follow,
    `labelling_members`) as bytes. islands encode
    gives another (the latents' mean and log-variance, of the image and its flip) with a manifest entry of its own."""

    def __init__(self, source: Source):
        self.member = example_member(source)
        self.members = [self.member]
        self.manifest = {"shape": list(source.shape), "flip": source.flip, "x": self.member}

    def __call__(self, x: torch.Tensor, captions: list[str] | None = None) -> list[dict[str, bytes]]:
        return [{self.member: _encode(example, self.member)} for example in x]


def shard_count(examples: int, shard_size: int) -> int:
    return -(-examples // shard_size)


def written_order(n: int, shuffle_seed: int | None) -> np.ndarray | None:
    """The source example at each position of the shards: None for the source's own order, else a permutation drawn
    from `shuffle_seed` on a stream of its own (no run's draws), the same on every rank that writes a part."""
    if shuffle_seed is None:
        return None
    return np.random.default_rng([shuffle_seed, 0x5A4D]).permutation(n)


def write_part(source: Source, folder: Path, shard_size: int, rank: int = 0, ranks: int = 1,
               progress: bool = False, writer: ExampleWriter | None = None,
               publish: Callable[..., None] = lambda *names: None, shuffle_seed: int | None = None) -> list[dict]:
    """Rank `rank` of `ranks`: the shards i = rank mod ranks of `source` into `folder`, each with its index, each
    example's members made by `writer` (by default the example itself), each shard's files handed to `publish` once
    written (storage.Staging's: put at a URL). With `shuffle_seed`, position p holds the source's example
    written_order(n)[p]: a shard, and a block of it, is then a random sample of the source even where the source is
    sorted (a folder of class subfolders, a crawl), which the block order (data/order.py) needs. -> their manifest
    entries."""
    try:  # only writing needs it
        from webdataset import TarWriter
    except ImportError as err:
        raise DataError(f"islands shard needs webdataset ({err}); pip install 'islands[shards]'") from None

    members, n = writer or ExampleWriter(source), len(source)
    order = written_order(n, shuffle_seed)
    mine = range(rank, shard_count(n, shard_size), ranks)
    entries = []
    bar = tqdm(total=sum(min(n, (i + 1) * shard_size) - i * shard_size for i in mine), disable=not progress,
               desc=f"shards (rank {rank})" if ranks > 1 else "shards", unit="ex")
    for i in mine:
        lo, hi = i * shard_size, min(n, (i + 1) * shard_size)
        tar = folder / shard_name(i)
        # fixed owner and time: the same examples make the same bytes, whichever rank or day wrote them
        with TarWriter(str(tar), encoder=False, mtime=0, user="islands", group="islands") as tar_writer:
            for start in range(lo, hi, READ_CHUNK):
                chunk = list(range(start, min(hi, start + READ_CHUNK)))
                got = source.read(chunk if order is None else order[chunk].tolist(), (X, LABEL, CAPTION))
                x, y, captions = got[X], got.get(LABEL), got.get(CAPTION)
                for j, example in enumerate(members(x, captions)):
                    example = {"__key__": f"{start + j:09d}", **example}
                    if captions is not None:
                        example["txt"] = captions[j].encode()
                    if y is not None:
                        example["cls"] = str(int(y[j])).encode()
                    tar_writer.write(example)
                bar.update(len(x))
        index = _index_of(tar, lo, hi, [*members.members, *labelling_members(source)])
        np.save(folder / index_name(i), index, allow_pickle=False)
        np.save(folder / digests_name(i), _digests_of(tar, index), allow_pickle=False)
        entries.append({"tar": shard_name(i), "index": index_name(i), "digests": digests_name(i),
                        "examples": hi - lo, "bytes": tar.stat().st_size, "sha256": file_sha256(tar),
                        "index_sha256": file_sha256(folder / index_name(i)),
                        "digests_sha256": file_sha256(folder / digests_name(i))})
        publish(shard_name(i), index_name(i), digests_name(i))
    bar.close()
    return entries


def _index_of(tar: Path, lo: int, hi: int, members: list[str]) -> np.ndarray:
    """(examples, members, 2) int64: each member's data offset and size, found by reading the tar's headers."""
    index = np.zeros((hi - lo, len(members), 2), dtype=np.int64)
    with tarfile.open(tar) as f:
        for info in f:
            key, _, ext = info.name.partition(".")
            index[int(key) - lo, members.index(ext)] = (info.offset_data, info.size)
    return index


def _digests_of(tar: Path, index: np.ndarray) -> np.ndarray:
    """(examples, members, 32) uint8: the sha256 of each member's data, read back from the tar where `index` says."""
    digests = np.zeros((*index.shape[:2], 32), dtype=np.uint8)
    with open(tar, "rb") as f:
        for (row, column), (at, size) in zip(np.ndindex(index.shape[:2]), index.reshape(-1, 2), strict=True):
            digests[row, column] = np.frombuffer(hashlib.sha256(os.pread(f.fileno(), int(size), int(at))).digest(),
                                                 dtype=np.uint8)
    return digests


refuse_written_over = storage.refuse_written_over


def write_shards(source: Source, out: Path, shard_size: int, made_from: dict, rank: int = 0, ranks: int = 1,
                 barrier: Callable[[], None] = lambda: None, progress: bool = False,
                 writer: ExampleWriter | None = None, shuffle_seed: int | None = None) -> dict | None:
    """Every rank its shards (`write_part`), rank 0 the manifest, all into a hidden folder beside `out` renamed to
    `out` once whole, so that no half-written shard folder is ever left as `out` (which must be absent or empty); at
    a URL, each shard put as it is finished and the manifest last (storage.Staging). -> the manifest on rank 0, None
    on the others. `barrier` waits for every rank (a World's). `shuffle_seed`: the examples written in a seeded
    shuffled order (write_part), recorded in the manifest as `shuffled_with_seed`."""
    refuse_written_over(out)
    stage = storage.Staging(out, rank, barrier)
    try:
        writer = writer or ExampleWriter(source)
        part = RankShards(shards=write_part(source, stage.local, shard_size, rank, ranks, progress, writer,
                                            stage.publish, shuffle_seed))
        part.write(stage.local / RankShards.file(rank))
        stage.publish(RankShards.file(rank))
        barrier()  # every rank's shards are written
        if rank != 0:
            return None
        parts = [RankShards.file(r) for r in range(ranks)]
        shards = [entry.model_dump(exclude_unset=True) for name in parts
                  for entry in RankShards.read(stage.fetch(name)).shards]
        stage.discard(*parts)
        manifest = write_manifest(stage.local, shards, source, shard_size, made_from, writer, shuffle_seed)
        stage.publish(MANIFEST)
        stage.finish()
        return manifest
    finally:
        stage.close()


def write_manifest(folder: Path, shards: list[dict], source: Source, shard_size: int, made_from: dict,
                   writer: ExampleWriter | None = None, shuffle_seed: int | None = None) -> dict:
    writer = writer or ExampleWriter(source)
    shards = sorted(shards, key=lambda s: s["tar"])
    manifest = {"format": FORMAT, "examples": len(source), **writer.manifest, "num_classes": source.num_classes,
                "members": [*writer.members, *labelling_members(source)],
                "shard_size": shard_size, "sha256": whole_sha256(shards), "made_from": made_from,
                **({} if shuffle_seed is None else {"shuffled_with_seed": shuffle_seed}), "shards": shards}
    ShardManifest.read(manifest, folder / MANIFEST)  # what a reader will hold it to
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


# --- reading --------------------------------------------------------------------------------------------------------

class BadMember(DataError):
    """A member read that is not what its index says (its sha256 differs, it is cut short, it does not decode, its
    class is out of range): the example it belongs to is bad. `data.on_error` decides: stop the run, or skip it."""


SKIP_SLOTS = 64  # counters of skipped examples shared by a source's processes: the main one and its loader workers
SKIP_WARNINGS = 10  # skipped examples a process names in a warning; after those, metrics.jsonl counts them
GAP = 1 << 20  # members of one example further apart than this are read one by one (a GNU tar of a folder)


class ShardSource(Source):
    """The examples of a shard folder (`islands shard`), read by seek through the index; a folder that `islands
    index` wrote (tars indexed where they lie) is read by its subclass, data/tar_index.py's `IndexedTars`. Missing or
    truncated shards, files that lead out of the folder, indices and member sha256 files that are not the ones the
    manifest lists, and a manifest that is not a shard folder's are refused when it is built; every member read is
    checked against its sha256. Nothing of the tars is read at the start: the indices are memory-mapped, not loaded,
    so a process (a loader worker too) holds no per-example array of its own. `data.on_error: skip` replaces a bad
    example by the next good one of the data set (a function of its index alone, so a resumed run replaces the
    same ones), counting it (`skipped_examples`)."""

    remedy = "write the shards again with 'islands shard'"

    def __new__(cls, path=None, *args, **options):
        if cls is ShardSource and path is not None:
            from islands.data.tar_index import TARS_FORMAT, IndexedTars

            if _format_of(storage.location(path)) == TARS_FORMAT:  # a folder `islands index` wrote
                cls = IndexedTars
        return super().__new__(cls)

    @property
    def manifest(self) -> dict:
        """The manifest as the JSON it was read from, for a person to look at (`record` is it typed: what is read)."""
        return self.record.model_dump(mode="json", exclude_unset=True)

    def __init__(self, path, resolution=None, channels=None, background=None, on_error="stop", cache=None,
                 cache_bytes=None):
        self.root = storage.location(path)
        self.record = m = _own_manifest(self.root)
        self.shape, self.num_classes, self.flip = tuple(m.shape), m.num_classes, m.flip
        if resolution is not None and tuple(self.shape[1:]) != (resolution, resolution) or \
                channels is not None and self.shape[0] != channels:
            raise DataError(f"shard folder {self.root} holds examples of shape {self.shape} as 'islands shard' wrote "
                            "them: leave data.resolution and data.channels out (only indexed tars are resized)")
        self.member, self.quantised = m.x, m.x == "png"
        # the columns of the index read: the example's arrays (one, or a latent's mean and log-variance, of the image
        # and of its flip: stacked along the channels, as `islands encode` wrote them), then its class's
        self.arrays = [i for i, member in enumerate(m.members) if member not in ("txt", "cls", CAPTION_MEMBER)]
        # `islands encode --text-encoder`: each caption's packed embedding, a condition read apart from the example
        self.stored_captions = m.caption_embeddings
        self.holds = frozenset({X} | {field for field, there in ((LABEL, self.num_classes),
                                                                  (CAPTION, "txt" in m.members),
                                                                  (CAPTION_EMBEDDING, self.stored_captions)) if there})
        self.member_shape = (self.shape[0] // len(self.arrays), *self.shape[1:])
        self.tars = [self._file_named(s.tar) for s in m.shards]
        self.index_files = [self._file_named(s.index) for s in m.shards]
        self.checked_per_member = m.format == FORMAT
        self.digest_files = [self._file_named(s.digests) for s in m.shards] if self.checked_per_member else []
        self._at(cache, cache_bytes)
        if self.remote:
            if not self.checked_per_member:
                raise DataError(f"shard folder {self.root}: format {m.format} (no member sha256) is read from a "
                                f"local disk only; {self.remedy}")
            found = storage.sizes(self.tars)
            for tar, entry in zip(self.tars, m.shards, strict=True):
                _check_object_size(tar, found.get(tar), entry.bytes)
        else:
            for tar, index, entry in zip(self.tars, self.index_files, m.shards, strict=True):
                _check_size(tar, index, entry)
        self._ready(on_error)

    def _at(self, cache, cache_bytes) -> None:
        """Where the folder lies: on this disk, or at a URL (storage.py), whose manifest, indices and member sha256 are
        copied to a local folder (each checked against the manifest where it is mapped, as a local one is) and whose
        tars are read by ranged requests, a block of examples at a time, or kept whole in `cache` (DiskCache)."""
        self.remote = storage.is_url(self.root)
        self.cache = None
        if not self.remote:
            return
        key = storage.cache_key(f"{self.root}\n{json.dumps(self.manifest, sort_keys=True)}")  # another set: another
        self.local_files = (Path(cache) / "meta" if cache is not None else cache_dir() / "remote") / key
        if cache is not None:
            self.cache = storage.DiskCache(Path(cache) / "tars", cache_bytes)
        self.hold_blocks(HELD_BLOCK, HELD_BLOCKS)

    def hold_blocks(self, block: int | None, held: int | None = HELD_BLOCKS) -> None:
        """At a URL, read rows [k block, (k + 1) block) of a shard with one ranged request and keep it: the `held`
        blocks last read (least recently used out), or with `held` None until `hold_until` says its window is read
        (data.order blocks' blocks, each read once per process: the loader sets it, data/loader.py). `block` None:
        one request per example (data.order global, where a block's other examples are wanted far later). Nothing
        changes for a local folder."""
        self._block, self._held_capacity, self._held = block, held, OrderedDict()
        self._ends, self._now = {}, 0

    def hold_until(self, ends: dict[int, int], now: int) -> None:
        """The batch about to be read: for each example, the position its window ends at (a block read for it is
        held until then), and the batch's first position: blocks whose window ended before it are dropped."""
        self._ends, self._now = ends, now
        for key in [key for key, (_, until) in self._held.items() if until <= now]:
            del self._held[key]

    def _ready(self, on_error: str) -> None:
        """What every kind of shard folder does once its files are named: the per-process state and the skip counter.
        A shard's index and member sha256 file are checked against the manifest where a process first reads the
        shard (`_index`), not at the start: a run's start reads the manifest alone, whatever the data's size."""
        if on_error not in ("stop", "skip"):
            raise ValueError(f"on_error must be 'stop' or 'skip', got {on_error!r}")
        m = self.record
        self.on_error = on_error
        self.columns = [*self.arrays, *([m.members.index("cls")] if self.num_classes else [])]
        # an example is bad when any of these fails: its arrays, its class, its caption
        self.checked_columns = [*self.columns, *([m.members.index("txt")] if self.captioned else [])]
        self.starts = np.cumsum([0] + [s.examples for s in m.shards])
        self._indices, self._files, self._pid, self._warned = {}, OrderedDict(), os.getpid(), 0
        self._held, self._ends, self._now = OrderedDict(), {}, 0
        self._skipped = torch.zeros(SKIP_SLOTS, dtype=torch.int64).share_memory_() if on_error == "skip" else None
        self._remember_by_content()

    def _file_named(self, name: str):
        return _named(self.root, name)

    def _remember_by_content(self) -> None:
        """What data/fingerprint.py keys its memory of this source on (the sha256 of `read_from`, the size and mtime
        of `checked_when_read`). The manifest lists the sha256 of every index and member sha256 file, checked when
        the source is built, and every member read is checked against those: the manifest alone is the content, and
        the tars' size and mtime only make an honest change be found at the start. A folder without member sha256
        (format /1) is keyed on its tars' content too: hashed whole at every start."""
        manifest = self.root / MANIFEST if isinstance(self.root, Path) else \
            self._local_copy(storage.join(self.root, MANIFEST))
        if self.remote:  # every member read is checked: the manifest is the content
            self.read_from, self.checked_when_read = (manifest,), ()
        elif self.checked_per_member:
            self.read_from = (manifest,)
            self.checked_when_read = tuple(self.tars)
        else:
            self.read_from = (manifest, *self.tars, *self.index_files)
            self.checked_when_read = ()

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def shard_starts(self) -> tuple:
        """Each shard's first example, then the number of examples: where the blocks of data.order blocks are cut."""
        return tuple(int(s) for s in self.starts)

    def __getstate__(self):  # a worker started by spawn opens and maps its own files
        return {**self.__dict__, "_files": OrderedDict(), "_indices": {}, "_held": OrderedDict()}

    def _local_copy(self, url: str, sha256: str | None = None) -> Path:
        """A file of the folder at a URL, copied into this machine's `local_files` (again where `sha256` is given and
        the copy is not those bytes); what it holds is checked by the caller, as a local folder's file is."""
        local = self.local_files / storage.name_of(url)
        if sha256 is None or not local.exists() or file_sha256(local) != sha256:
            if sha256 is None:  # the manifest: read afresh, written only where it changed
                data = storage.read_bytes(url)
                if not local.exists() or local.read_bytes() != data:
                    local.parent.mkdir(parents=True, exist_ok=True)
                    tmp = local.with_name(f".{local.name}.{os.getpid()}")
                    tmp.write_bytes(data)
                    os.replace(tmp, local)
            else:
                storage.download(url, local)
        return local

    @property
    def skipped_examples(self) -> int | None:
        """Examples this source's processes replaced under `on_error: skip` (None: it stops instead)."""
        return None if self._skipped is None else int(self._skipped.sum())

    def _locate(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """-> the shard of each example and its row in it."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(idx) and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"example indices outside 0..{len(self) - 1}")
        shard = np.searchsorted(self.starts, idx, side="right") - 1
        return shard, idx - self.starts[shard]

    def _example(self, shard: int, row: int) -> str:
        """An example as people find it in the tar: its number in the whole set (the members' key)."""
        return f"example {int(self.starts[shard]) + row}"

    def read(self, indices, fields) -> dict:
        idx, got = np.asarray(indices, dtype=np.int64).reshape(-1), {}
        if X in fields or LABEL in fields and self.num_classes:
            got.update(self._examples(idx))
        if CAPTION in fields and self.captioned:
            column = self.record.members.index("txt")
            got[CAPTION] = [self._good(int(i), lambda s, r: self._caption(s, r, column)) for i in idx]
        if CAPTION_EMBEDDING in fields and self.stored_captions is not None:
            got[CAPTION_EMBEDDING] = self._caption_embeddings(idx)
        return {name: value for name, value in got.items() if name in fields}

    def _examples(self, idx: np.ndarray) -> dict:
        shard, rows = self._locate(idx)
        examples, labels = [None] * len(rows), np.zeros(len(rows), dtype=np.int64)
        for i in np.lexsort((rows, shard)):  # in file order: each shard read front to back
            examples[i], labels[i] = self._good(int(idx[i]), lambda s, r: self._read(s, r), count=True)
        x = torch.from_numpy(np.stack(examples)) if examples else torch.zeros((0, *self.shape))
        return {X: to_unit(x) if self.quantised and examples else x,
                **({LABEL: torch.from_numpy(labels)} if self.num_classes else {})}

    def _good(self, index: int, read, count: bool = False):
        """read(shard, row) of example `index`; under `on_error: skip`, of the first example from `index` on (the
        data set read round) whose members are good, so that what replaces a bad example is a function of its index
        alone. `count`: this read is the example's (get's), counted and warned of once per read."""
        for step in range(len(self) if self.on_error == "skip" else 1):
            shard, row = (int(v[0]) for v in self._locate([(index + step) % len(self)]))
            try:
                return read(shard, row)
            except BadMember as bad:
                if self.on_error == "stop":
                    raise
                if count and step == 0:
                    self._count_skip(bad)
        raise DataError(f"shard folder {self.root}: no example is good (data.on_error skip found none to read)")

    def _count_skip(self, bad: BadMember) -> None:
        info = torch.utils.data.get_worker_info()
        self._skipped[0 if info is None else 1 + info.id % (SKIP_SLOTS - 1)] += 1
        self._warned += 1
        if self._warned <= SKIP_WARNINGS:
            warnings.warn(f"skipped (data.on_error skip): {bad}" + ("; further skips are counted in metrics.jsonl "
                          "(skipped_examples)" if self._warned == SKIP_WARNINGS else ""), IslandsWarning, stacklevel=2)

    def _caption_embeddings(self, idx: np.ndarray) -> torch.Tensor:
        """The examples' caption embeddings as `islands encode --text-encoder` stored them (packed, float32)."""
        column = self.record.members.index(CAPTION_MEMBER)
        shape = tuple(self.stored_captions.shape)
        arrays = [self._good(int(i), lambda s, r: self._caption_embedding(s, r, column, shape)) for i in idx]
        return torch.from_numpy(np.stack(arrays)) if arrays else torch.zeros((0, *shape))

    def _caption_embedding(self, shard: int, row: int, column: int, shape: tuple) -> np.ndarray:
        self._check_members(shard, row)
        blob = self._member(shard, row, column)
        try:
            a = np.load(io.BytesIO(blob), allow_pickle=False)
        except Exception as e:  # damaged bytes
            raise BadMember(f"shard {self.tars[shard]}: the caption embedding of {self._example(shard, row)} cannot "
                            f"be decoded: {e}") from None
        if a.shape != shape or a.dtype != np.float32:
            raise BadMember(f"shard {self.tars[shard]}: the caption embedding of {self._example(shard, row)} is "
                            f"{a.dtype} {a.shape}, the manifest says {shape}")
        return a

    def _check_members(self, shard: int, row: int) -> None:
        """Under `on_error: skip`, a caption is read only with its example's members checked (their sha256, not
        decoded), so that a bad example's caption is replaced by the same example's as its pixels are."""
        if self.on_error == "skip":
            self._members(shard, row, self.checked_columns)

    def _caption(self, shard: int, row: int, column: int) -> str:
        self._check_members(shard, row)
        try:
            return self._member(shard, row, column).decode()
        except UnicodeDecodeError as e:
            raise BadMember(f"shard {self.tars[shard]}: the caption of {self._example(shard, row)} cannot be read: "
                            f"{e}") from None

    def _member(self, shard: int, row: int, column: int) -> bytes:
        """One member's data, whole and checked against its sha256."""
        return self._members(shard, row, [column])[0]

    def _members(self, shard: int, row: int, columns: list[int]) -> list[bytes]:
        """The data of an example's members, each checked against its sha256: one read where they lie together (as
        webdataset writes them), one each where they do not (a GNU tar of a folder)."""
        where = np.asarray(self._index(shard)[0][row, columns])
        self._check_row(shard, row, columns, where)
        first, end = int(where[:, 0].min()), int((where[:, 0] + where[:, 1]).max())
        if self._ranged(shard) and self._block:
            held = self._held_block(shard, row)
            if held is not None and held[0] <= first and end <= held[0] + len(held[1]):
                return [self._checked(shard, row, column, held[1][at - held[0]:at - held[0] + size])
                        for column, (at, size) in zip(columns, where.tolist(), strict=True)]
        if end - first <= int(where[:, 1].sum()) + GAP:
            data = self._pread(shard, row, first, end)
            blobs = [data[at - first:at - first + size] for at, size in where.tolist()]
        else:
            blobs = [self._pread(shard, row, at, at + size) for at, size in where.tolist()]
        return [self._checked(shard, row, column, blob) for column, blob in zip(columns, blobs, strict=True)]

    def _pread(self, shard: int, row: int, first: int, end: int) -> bytes:
        data = self._bytes(shard, first, end)
        if len(data) != end - first:
            size = f"{first + len(data)}+" if self._ranged(shard) else os.fstat(self._file(shard)).st_size
            raise BadMember(f"truncated shard {self.tars[shard]}: {self._example(shard, row)} ends at byte {end}, the "
                            f"file has {size}")
        return data

    def _bytes(self, shard: int, first: int, end: int) -> bytes:
        """Bytes [first, end) of a shard: a `pread` of a local file (or of a URL's tar kept in data.cache), else one
        ranged request."""
        if self._ranged(shard):
            return storage.read_range(self.tars[shard], first, end)
        return os.pread(self._file(shard), end - first, first)

    def _ranged(self, shard: int) -> bool:
        """The shard is read by ranged requests: at a URL, and not kept whole in data.cache."""
        return self.remote and self.cache is None and not isinstance(self.tars[shard], Path)

    def _held_block(self, shard: int, row: int) -> tuple[int, bytes] | None:
        """The block of examples that holds `row`, read with one ranged request the first time this process needs it
        and held (the `_held_capacity` last used); None where its members do not lie together (a GNU tar of a folder
        keeps each kind apart: read one by one then)."""
        if os.getpid() != self._pid:
            self._forked()
        key = (shard, row // self._block)
        if key in self._held:
            self._held.move_to_end(key)
            return self._held[key][0]
        index = self._index(shard)[0]
        rows = np.asarray(index[key[1] * self._block:(key[1] + 1) * self._block])
        at, size = rows[..., 0], rows[..., 1]
        first, end = int(at.min()), int((at + size).max())
        block = None
        if end - first <= 2 * int(size.sum()) + GAP:
            block = (first, storage.read_range(self.tars[shard], first, end))
        # an example read through a wrapper that renumbers examples (a partition's cluster) has no end given: its
        # block is held while the batch's windows are read
        self._held[key] = block, self._ends.get(int(self.starts[shard]) + row, max(self._ends.values(), default=0))
        while self._held_capacity is not None and len(self._held) > self._held_capacity:
            self._held.popitem(last=False)
        return block

    def _checked(self, shard: int, row: int, column: int, blob: bytes) -> bytes:
        """`blob`, a member's data, if its sha256 is the one written beside the index (a folder of format /1 has
        none: its tars were hashed whole when the run started)."""
        digests = self._index(shard)[1]
        if digests is not None and hashlib.sha256(blob).digest() != digests[row, column].tobytes():
            raise BadMember(self._changed(shard, row, column))
        return blob

    def _changed(self, shard: int, row: int, column: int) -> str:
        return (f"shard {self.tars[shard]} changed since it was written: the {self.record.members[column]} of "
                f"{self._example(shard, row)} is not the bytes {storage.name_of(self.digest_files[shard])} records; "
                f"{self.remedy}")

    def _read(self, shard: int, row: int) -> tuple[np.ndarray, int]:
        members = self._members(shard, row, self.checked_columns)
        arrays = [self._decode(blob, shard, row) for blob in members[:len(self.arrays)]]
        x = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        return x, (self._class_of(members[len(self.arrays)], shard, row) if self.num_classes else -1)

    def _class_of(self, blob: bytes, shard: int, row: int) -> int:
        """The class a `cls` member names: ASCII digits of one of the manifest's classes. `num_classes` itself would be
        the null row of unconditional training, so it is refused like any other number out of range."""
        if blob.isdigit() and len(blob) <= len(str(MAX_CLASSES)) and int(blob) < self.num_classes:
            return int(blob)
        shown = blob[:20].decode("ascii", "backslashreplace")
        raise BadMember(f"shard {self.tars[shard]}: {self._example(shard, row)} has class {shown!r}, not one of the "
                        f"manifest's 0..{self.num_classes - 1}")

    def _decode(self, blob: bytes, shard: int, row: int) -> np.ndarray:
        try:
            if self.quantised:
                with Image.open(io.BytesIO(blob)) as img:
                    a = np.asarray(img, dtype=np.uint8)
                a = a[None] if a.ndim == 2 else a.transpose(2, 0, 1)
            else:
                a = np.load(io.BytesIO(blob), allow_pickle=False)
        except Exception as e:  # decoders of damaged bytes raise all sorts of things
            raise BadMember(f"shard {self.tars[shard]}: {self._example(shard, row)} cannot be decoded: {e}") from None
        if a.shape != self.member_shape or a.dtype != (np.uint8 if self.quantised else np.float32):
            raise BadMember(f"shard {self.tars[shard]}: {self._example(shard, row)} is {a.dtype} {a.shape}, the "
                            f"manifest says {self.member_shape}")
        return a

    def _check_listed(self, shard: int) -> None:
        """The shard's index and member sha256 file are the ones the manifest lists (streamed through sha256, never
        held whole) and of the shape it gives."""
        entry, members = self.record.shards[shard], len(self.record.members)
        index = self._mapped(self.index_files[shard], entry.index_sha256)
        _check_listed_file(index, entry.index_sha256, "shard index", self.remedy, self.index_files[shard])
        _check_array(index, (entry.examples, members, 2), np.int64, "shard index",
                     f"does not index the {entry.examples} examples the manifest gives {entry.tar}")
        if self.checked_per_member:
            path = self._mapped(self.digest_files[shard], entry.digests_sha256)
            _check_listed_file(path, entry.digests_sha256, "shard sha256 file", self.remedy,
                               self.digest_files[shard])
            _check_array(path, (entry.examples, members, 32), np.uint8, "shard sha256 file",
                         f"does not hold a sha256 of each member of the {entry.examples} examples of {entry.tar}")

    def _mapped(self, listed, sha256: str) -> Path:
        """The local file a listed index or sha256 file is mapped from: itself, or for a folder at a URL its copy."""
        return self._local_copy(listed, sha256) if self.remote else listed

    def _open_cached(self, shard: int) -> int:
        """A URL's tar, whole, from data.cache (downloaded there first where it is not)."""
        if self.cache is None:
            raise DataError(f"shard {self.tars[shard]}: a URL has no descriptor (no data.cache)")
        entry = self.record.shards[shard]
        return self.cache.open(self.tars[shard], entry.bytes, entry.sha256, entry.mtime_ns)

    def _index(self, shard: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The shard's index and member sha256 (None for format /1), memory-mapped in this process, checked against
        the manifest (their sha256, their shape, every offset inside the tar) when it first maps them."""
        if os.getpid() != self._pid:
            self._forked()
        if shard not in self._indices:
            self._check_listed(shard)
            entry = self.record.shards[shard]
            digests = np.load(self._mapped(self.digest_files[shard], entry.digests_sha256), mmap_mode="r") \
                if self.checked_per_member else None
            self._indices[shard] = np.load(self._mapped(self.index_files[shard], entry.index_sha256),
                                           mmap_mode="r"), digests
            self._check_offsets(shard)
        return self._indices[shard]

    def _check_row(self, shard: int, row: int, columns: list[int], where: np.ndarray) -> None:
        """The members read lie inside the tar: a negative offset or a size past the end would be an OSError or a
        read of terabytes."""
        tar_bytes = self.record.shards[shard].bytes
        for column, (at, size) in zip(columns, where.tolist(), strict=True):
            if at < 0 or size < 0 or at > tar_bytes or size > tar_bytes - at:
                raise DataError(f"shard index {self.index_files[shard]}: the {self.record.members[column]} of "
                                f"{self._example(shard, row)} is {size} bytes at byte {at}, outside the {tar_bytes} "
                                f"bytes of {storage.name_of(self.tars[shard])}")

    def _check_offsets(self, shard: int) -> None:
        """Every member of the shard lies inside the tar (the whole index, memory-mapped, at once)."""
        index = self._indices[shard][0]
        at, size, tar_bytes = index[..., 0], index[..., 1], self.record.shards[shard].bytes
        outside = (at < 0) | (size < 0) | (at > tar_bytes) | (size > tar_bytes - at)
        if outside.any():
            row, column = (int(v) for v in np.argwhere(outside)[0])
            self._check_row(shard, row, [column], np.asarray(index[row, [column]]))

    def _forked(self) -> None:
        """In a process forked from the one that opened them, its own descriptors and maps."""
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()
        self._indices, self._held = {}, OrderedDict()
        self._pid = os.getpid()

    def _file(self, shard: int) -> int:
        """An open descriptor of the shard, this process's own (a forked loader worker opens its own)."""
        if os.getpid() != self._pid:
            self._forked()
        if shard in self._files:
            self._files.move_to_end(shard)
        else:
            try:
                self._files[shard] = os.open(self.tars[shard], os.O_RDONLY) if isinstance(self.tars[shard], Path) \
                    else self._open_cached(shard)
            except OSError as e:
                raise DataError(f"shard {self.tars[shard]}: cannot read: {e.strerror or e}") from None
            if len(self._files) > OPEN_FILES:
                os.close(self._files.popitem(last=False)[1])
        return self._files[shard]

    def check(self):
        """Nothing to read for a folder of member sha256 (section 5 of issue 36): the start reads the manifest alone;
        each index is checked where a process first maps it, each member as it is read, and `islands verify` reads
        them all when a person asks. A folder of format /1 (no member sha256) has every shard hashed whole and its
        classes read instead. data/fingerprint.py remembers the pass by the manifest."""
        for i in range(len(self.tars)):
            if self.checked_per_member:
                continue
            entry = self.record.shards[i]
            if file_sha256(self.tars[i]) != entry.sha256:
                raise DataError(f"shard {self.tars[i]} changed since it was written, or the manifest is another data "
                                f"set's (its sha256 is not the one {self.root / MANIFEST} lists); {self.remedy}")
            if self.num_classes:
                column = self.record.members.index("cls")
                for row in range(entry.examples):
                    self._class_of(self._member(i, row, column), i, row)

    def verify(self, progress: bool = False) -> list[str]:
        """The whole pass `islands verify` makes: every member of every example read, checked against its sha256 and
        decoded. -> a line for each bad example (empty: every example good)."""
        columns = list(range(len(self.record.members)))
        bad = []
        with tqdm(total=len(self), disable=not progress, desc="verify", unit="ex") as bar:
            for shard in range(len(self.tars)):
                for row in range(self.record.shards[shard].examples):
                    try:
                        self._verify_example(shard, row, columns)
                    except BadMember as e:
                        bad.append(str(e))
                    bar.update(1)
        return bad

    def _verify_example(self, shard: int, row: int, columns: list[int]) -> None:
        self._members(shard, row, columns)
        self._read(shard, row)
        if self.captioned:
            self._caption(shard, row, self.record.members.index("txt"))


def shard_source_of(source: Source) -> "ShardSource | None":
    """The shard folder under `source`, seen through any wrappers (a partition's cluster, stored conditions, latents);
    None for other data."""
    while source is not None:
        if isinstance(source, ShardSource):
            return source
        source = getattr(source, "source", None)
    return None


def skipped_examples(source: Source) -> int | None:
    """How many examples the shard folder under `source` replaced under `data.on_error: skip` in this process and its
    loader workers; None where nothing is skipped (other data, or `on_error: stop`)."""
    shards = shard_source_of(source)
    return None if shards is None else shards.skipped_examples


class ManifestFormat(BaseModel):
    """The one key of a manifest read before its model is chosen: which layout (`format`) it says it is."""

    model_config = ConfigDict(extra="ignore", strict=True)
    format: str


def _format_of(root) -> str | None:
    """The `format` a folder's manifest names, None where there is none to read (refused later, by name)."""
    try:
        return _format_in(json.loads(storage.read_bytes(_named(root, MANIFEST))))
    except (OSError, ValueError, DataError):
        return None


def _format_in(raw) -> str | None:
    try:
        return ManifestFormat.model_validate(raw).format
    except ValidationError:
        return None


def _named(root, name: str):
    """A file named by a shard folder's manifest, inside it: no link out of a local folder (`inside`); at a URL, a name
    without a slash (the manifest's check) under its prefix."""
    return inside(root, name, "shard folder") if isinstance(root, Path) else storage.join(root, name)


def _check_listed_file(path: Path, sha256: str, what: str, remedy: str, shown=None) -> None:
    """The file is the one the manifest lists: streamed through sha256, never held whole. `shown`: what it is called
    in a message (a URL's local copy is named by its URL)."""
    shown = path if shown is None else shown
    try:
        found = file_sha256(path)
    except OSError as e:
        raise DataError(f"{what} {shown}: cannot read: {e.strerror or e}") from None
    if found != sha256:
        raise DataError(f"{what} {shown} is not the one {storage.join(storage.parent_of(shown), MANIFEST)} lists: the "
                        f"manifest is another data set's, or the files were written over; {remedy}")


def _check_array(path: Path, shape: tuple, dtype, what: str, why: str) -> None:
    """An .npy file's header: the shape and dtype the manifest implies (its data is mapped, never parsed)."""
    try:
        a = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise DataError(f"{what} {path}: cannot read: {e}") from None
    if a.shape != shape or a.dtype != dtype:
        raise DataError(f"{what} {path}: {a.dtype} {a.shape} {why}")


def _check_index(index: Path, entry: dict) -> None:
    try:
        found = file_sha256(index)
    except OSError as e:
        raise DataError(f"shard index {index}: cannot read: {e.strerror or e}") from None
    if found != entry.index_sha256:
        raise DataError(f"shard index {index} is not the one {index.parent / MANIFEST} lists: the manifest is "
                        "another data set's, or the shards were written over; write them again with 'islands shard'")


def _check_object_size(tar: str, size: int | None, expected: int) -> None:
    """A shard at a URL is there at the size the manifest says (its listing's size: no request per shard)."""
    if size is None:
        raise DataError(f"shard {tar} is missing (the manifest lists it)")
    if size != expected:
        raise DataError(f"shard {tar} changed since it was written: {size} bytes, the manifest says {expected}; write "
                        "it again with 'islands shard'")


def _check_size(tar: Path, index: Path, entry: dict) -> None:
    """The shard is there at the size the manifest says; a size that differs with an index that differs too
    means a manifest of other shards."""
    try:
        size = tar.stat().st_size
    except FileNotFoundError:
        raise DataError(f"shard {tar} is missing (the manifest lists it)") from None
    except OSError as e:
        raise DataError(f"shard {tar}: cannot read: {e.strerror or e}") from None
    if size != entry.bytes:
        _check_index(index, entry)
        raise DataError(f"{'truncated' if size < entry.bytes else 'grown'} shard {tar}: {size} bytes, the "
                        f"manifest says {entry.bytes}")


# --- the manifest, read as untrusted: a typed record ----------------------------------------------------------------

EXAMPLE_MEMBERS = ("png", "x.npy", "latent.npy", "mean.npy")
Count = Annotated[int, Field(ge=0)]
Size = Annotated[int, Field(ge=1)]


class ManifestRecord(BaseModel):
    """A manifest read from a folder that may come from elsewhere: strict JSON types (a `true` is no count), no key
    it does not know, and `read` turns the first thing wrong into one line naming the file and the key."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @classmethod
    def read(cls, raw, path, what: str = "shard manifest") -> "ManifestRecord":
        try:
            return cls.model_validate(raw)
        except ValidationError as err:
            raise DataError(f"{what} {one_line(err, path)}") from None


class ShardEntry(ManifestRecord):
    """One shard of `islands shard`: its tar, index and member sha256 file (format /2), their sizes and sha256 (in
    the order the writer lists them, which a dump keeps)."""

    tar: str
    index: str
    digests: str | None = None  # format /2's
    examples: Count
    bytes: Count
    sha256: str
    index_sha256: str
    digests_sha256: str | None = None
    mtime_ns: ClassVar[None] = None  # a shard is checked by its sha256; an indexed tar (TarEntry) by its mtime


class RankShards(Record):
    """OUT/.rank-R.json while `islands shard` writes: the entries of the shards rank R wrote, which rank 0 lists in
    the manifest (read back, and discarded, in the same command)."""

    shards: list[ShardEntry]

    @staticmethod
    def file(rank: int) -> str:
        return f".rank-{rank}.json"


class CaptionEmbeddings(ManifestRecord):
    """`islands encode --text-encoder` (data/captions.py's CaptionWriter): what encoded the captions (its name and
    its files' sha256), the tokens and widths they were packed at, and each embedding's shape."""

    text_encoder: str
    sha256: str
    tokens: Size
    width: Size
    pooled_width: Size
    shape: Annotated[list[Size], Field(min_length=2, max_length=2)]
    dtype: Literal["float32"] = "float32"


class LatentsSection(ManifestRecord):
    """`islands encode`'s latents (data/encode.py's LatentWriter): the autoencoder they were encoded with (its files'
    sha256, its scale and shift), their shape and the images', whether the flips were encoded too."""

    autoencoder_sha256: str
    scaling_factor: float
    shift_factor: float | None = None
    latent_shape: Annotated[list[Size], Field(min_length=1, max_length=4)]
    image_shape: Annotated[list[Size], Field(min_length=1, max_length=4)]
    flipped: bool
    dtype: Literal["float32"] = "float32"


class ShardManifest(ManifestRecord):
    """OUT/manifest.json of `islands shard` and `islands encode`. Its version is `format`: islands-shards/2 (each
    member's sha256 beside its index) or /1 (read still, its tars hashed whole at every start)."""

    format: Literal["islands-shards/2", "islands-shards/1"]
    examples: Count
    shape: Annotated[list[Size], Field(min_length=1, max_length=4)]
    num_classes: Annotated[int, Field(ge=0, le=MAX_CLASSES)]
    flip: bool
    x: Literal[EXAMPLE_MEMBERS]
    members: list[str]
    shard_size: Size
    sha256: str
    made_from: dict | None = None
    shuffled_with_seed: int | None = None  # the examples' written order (write_part); absent: the source's own
    latents: LatentsSection | None = None  # islands encode's: the autoencoder and its scale (data/latents.py reads it)
    caption_embeddings: CaptionEmbeddings | None = None
    shards: list[ShardEntry]

    @model_validator(mode="after")
    def _sizes(self):
        """Counts the reader allocates or seeks by: an example no larger than a GiB, no shard above shard_size, and
        format /2's member sha256 file named for every shard."""
        for name, shape in (("shape", self.shape), ("caption_embeddings.shape",
                                                    self.caption_embeddings and self.caption_embeddings.shape)):
            if shape and math.prod(shape) > MAX_EXAMPLE_NUMBERS:
                raise ValueError(f"{name} {shape} is not an example's shape (at most {MAX_EXAMPLE_NUMBERS:,} numbers)")
        for i, s in enumerate(self.shards):
            if s.examples > self.shard_size:
                raise ValueError(f"shards[{i}].examples {s.examples} is outside 0..{self.shard_size} (shard_size)")
            if self.format == FORMAT and (s.digests is None or s.digests_sha256 is None):
                raise ValueError(f"shards[{i}]: format {FORMAT} names each shard's digests and digests_sha256")
        return self


def read_manifest(root: Path) -> "ShardManifest | tar_index.TarsManifest":
    """The manifest of a shard folder (a local path or a URL), `islands shard`'s or `islands index`'s
    (data/tar_index.py), its structure and numbers checked; one line on trouble."""
    root = storage.location(root)
    if _format_of(root) is not None:
        from islands.data.tar_index import TARS_FORMAT, read_tars_manifest

        if _format_of(root) == TARS_FORMAT:
            return read_tars_manifest(root)
    return _own_manifest(root)


def _own_manifest(root: Path) -> ShardManifest:
    """The manifest `islands shard` wrote, its structure and numbers checked and its whole hash recomputed."""
    if isinstance(root, Path) and not root.is_dir():
        raise DataError(f"shard folder {root} does not exist; write it with 'islands shard CONFIG {root}'")
    path = _named(root, MANIFEST)
    m = _manifest_json(path)
    found = _format_in(m)
    if found is not None and found not in (FORMAT, UNCHECKED_FORMAT):
        raise DataError(f"shard manifest {path}: format {found!r}, this Islands reads {FORMAT!r} (and "
                        f"{UNCHECKED_FORMAT!r})")
    m = ShardManifest.read(m, path)
    _check_members(m, path)
    if whole_sha256([s.model_dump() for s in m.shards]) != m.sha256 or sum(s.examples for s in m.shards) != m.examples:
        raise DataError(f"shard manifest {path}: its shards do not add up to its sha256 and count (edited by hand?)")
    names = [name for s in m.shards for name in (s.tar, s.index, s.digests) if name is not None]
    if any(Path(name).name != name for name in names):
        raise DataError(f"shard manifest {path}: shard names must be file names inside {root}")
    return m


def _manifest_json(path):
    if not isinstance(path, Path) and not storage.exists(path):
        storage.check_bucket(path, "read")
        raise DataError(f"shard folder {storage.parent_of(path)} has no {MANIFEST}; write it with 'islands shard'")
    try:
        return json.loads(storage.read_bytes(path))
    except FileNotFoundError:
        raise DataError(f"shard folder {path.parent} has no {MANIFEST}; write it with 'islands shard'") from None
    except storage.StorageError:
        raise
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DataError(f"shard manifest {path}: cannot read: {e}") from None


def _is(value, kind: type) -> bool:
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))  # JSON's true is no count


def _check_members(m: ShardManifest, path: Path) -> None:
    members = m.members
    if len(set(members)) != len(members):
        raise DataError(f"shard manifest {path}: members {members} are not distinct names")
    if m.x not in members:
        raise DataError(f"shard manifest {path}: unknown example member {m.x!r}")
    if ("cls" in members) != (m.num_classes > 0):
        raise DataError(f"shard manifest {path}: {m.num_classes} classes, but 'cls' is "
                        f"{'' if 'cls' in members else 'not '}a member")
    if (m.caption_embeddings is not None) != (CAPTION_MEMBER in members):
        raise DataError(f"shard manifest {path}: caption_embeddings and the member {CAPTION_MEMBER!r} go together")
    arrays = [name for name in members if name not in ("txt", "cls", CAPTION_MEMBER)]
    if m.shape[0] % len(arrays):
        raise DataError(f"shard manifest {path}: shape {m.shape} does not stack its {len(arrays)} arrays "
                        f"({', '.join(arrays)}) along the channels")
