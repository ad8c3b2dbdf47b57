"""Webdataset tars as people already hold them, indexed where they lie (`islands index TARS OUT/`), and read through
the index (`data.source: shards`, `data.path: OUT`): no byte of the data is copied.

    OUT/manifest.json          format islands-tars/1: the examples, their members, classes and caption source, the
                               images' stored sizes, every example left out (its tar, key and why), and per tar its
                               absolute path, size and modification time, and the sha256 of its index files
    OUT/shard-000000.idx.npy   int64 (examples, members, 2): the offset and size of each member's data in its tar
    OUT/shard-000000.sha256.npy  uint8 (examples, members, 32): each member's sha256, checked at every read

The layouts read: img2dataset's (`{key}.jpg|png|webp`, `{key}.txt`, `{key}.json`; the `_stats.json` and `.parquet`
files beside the tars are not tars and are not read), webdataset's ShardWriter output and Islands' own shards
(members grouped by `__key__`: the name up to the first dot of its base name), and GNU tar of a folder (the key is
the path without its extensions, so `cats/001.jpg` and `cats/001.txt` make one example). An example without an
image, or whose image does not decode (each is decoded once while indexing, which also gives its size), is left out
and counted. Captions come from `.txt` or a JSON key (`--caption-key`), classes from `.cls` or a JSON key
(`--class-key`), integers either way; in a set where some examples have a caption (a class) an example without one
is left out too. Images keep their stored size; a run resizes and centre-crops them to its `data.resolution` as the
folder source does (`sources.fitted`).

Trust. The tars are wherever the user's own `islands index` command found them, so the manifest names them by
absolute path: the one exception to "every file read lies inside the folder" (islands/untrusted.py `inside`). It does
not reopen issue 35's item 7, because what the rule protects is still checked: the manifest, the indices and the
sha256 files lie inside OUT (`inside`), the indices and sha256 files are hashed against the manifest when the source
is built, and every byte taken from a tar is checked against the sha256 of its member before it is used, so a tar
named by a folder from elsewhere yields nothing its author did not already hold. A listed tar must be a regular file
named `*.tar` (never a device or a pipe), at the size and modification time the manifest records.

Each member's checksum is a sha256, as `islands shard`'s format /2 has it, not a CRC32C or xxHash: a CRC is forged in
a few lines by whoever hands over a folder. Its cost, measured on one core here: a 256x256 JPEG member (27 KB,
quality 90) hashes in 13 us against 550 us to decode and fit it (2.5%; 1.3% for a 64x64 one of 2 KB), and
`get` of batches of 50 such examples (with captions) in random order reads 763 examples/s checked against 815 with
the check taken out (6%): under the 10% that would justify a weaker check.
"""

import glob
import hashlib
import io
import json
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, ClassVar, Literal

import numpy as np
from PIL import Image
from pydantic import ConfigDict, Field, field_validator, model_validator
from tqdm import tqdm

from islands.data import storage
from islands.data.shards import (
    MANIFEST,
    MAX_CLASSES,
    BadMember,
    Count,
    ManifestRecord,
    ShardSource,
    _is,
    _manifest_json,
    _named,
    digests_name,
    index_name,
    refuse_written_over,
)
from islands.data.sources import CAPTION, LABEL, X, _check_resolution, fitted
from islands.errors import DataError
from islands.rundir import Record
from islands.untrusted import file_sha256

TARS_FORMAT = "islands-tars/1"
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
KINDS = {**{ext: "image" for ext in IMAGE_EXTENSIONS}, "txt": "txt", "json": "json", "cls": "cls"}
RAW = ("image", "caption", "class")  # the columns each rank writes, before rank 0 keeps those the set has
MISSING = -1


# --- which tars -------------------------------------------------------------------------------------------------------

def tars_of(spec: str) -> list:
    """The tars `spec` names, in order: a folder (its `*.tar`, sorted), a glob (sorted) or webdataset's brace notation
    (`data-{000000..000099}.tar`, in its order); each an existing regular file named `*.tar`, as its real absolute
    path, or an object at a URL (`s3://bucket/tars/`, a glob or braces there too). One line on trouble."""
    spec = str(spec)
    if storage.is_url(spec):
        return _tars_at_url(storage.location(spec))
    if "{" in spec:
        from braceexpand import braceexpand

        names = list(braceexpand(spec))
    elif any(c in spec for c in "*?["):
        names = sorted(glob.glob(spec))
    elif Path(spec).is_dir():
        names = sorted(str(p) for p in Path(spec).iterdir() if p.name.endswith(".tar") and not p.name.startswith("."))
    else:
        names = [spec]
    if not names:
        raise DataError(f"{spec}: no .tar files there (give a folder of tars, a glob or data-{{000000..000099}}.tar)")
    tars = []
    for name in names:
        path = Path(name)
        if not path.name.endswith(".tar"):
            raise DataError(f"{name}: not a .tar file (islands index reads webdataset tars)")
        if not path.exists():
            raise DataError(f"{name}: no such tar ({spec} names it)")
        if not path.is_file():
            raise DataError(f"{name}: not a regular file")
        tars.append(path.resolve())
    if len(set(tars)) != len(tars):
        raise DataError(f"{spec}: names the same tar twice")
    return tars


def _tars_at_url(spec: str) -> list[str]:
    if "{" in spec:
        from braceexpand import braceexpand

        names = list(braceexpand(spec))
    elif any(c in spec.split("://", 1)[1] for c in "*?["):
        names = storage.glob(spec)
    elif spec.endswith(".tar"):
        names = [spec]
    else:
        names = [storage.join(spec, n) for n in storage.listdir(spec) if n.endswith(".tar") and not n.startswith(".")]
    if not names:
        raise DataError(f"{spec}: no .tar objects there (give a prefix of tars, a glob or data-{{000000..000099}}.tar)")
    found = storage.sizes(names)
    for name in names:
        if not name.endswith(".tar"):
            raise DataError(f"{name}: not a .tar file (islands index reads webdataset tars)")
        if name not in found:
            raise DataError(f"{name}: no such tar ({spec} names it)")
    if len(set(names)) != len(names):
        raise DataError(f"{spec}: names the same tar twice")
    return names


# --- indexing ---------------------------------------------------------------------------------------------------------

def index_tars(spec: str, out: Path, caption_key: str | None = None, class_key: str | None = None, rank: int = 0,
               ranks: int = 1, barrier: Callable[[], None] = lambda: None, progress: bool = False) -> dict | None:
    """Index the tars `spec` names into the folder `out` (absent or empty): rank `rank` of `ranks` the tars
    i = rank mod ranks, rank 0 the manifest, all into a marked `.OUT.partial` renamed to `out` once whole. -> the
    manifest on rank 0, None on the others."""
    out = storage.location(out)
    refuse_written_over(out)
    tars = tars_of(spec)
    stage = storage.Staging(out, rank, barrier)
    partial = stage.local
    try:
        mine = range(rank, len(tars), ranks)
        with tqdm(total=len(mine), disable=not progress, unit="tar",
                  desc=f"index (rank {rank})" if ranks > 1 else "index") as bar:
            records = []
            for i in mine:
                records.append(_index_tar(tars[i], i, partial, caption_key, class_key))
                stage.publish(*(f".raw-{i:06d}.{part}.npy" for part in ("idx", "sha256", "cls")),
                              f".raw-{i:06d}.lacking.json")
                bar.update(1)
        RankTars(tars=records).write(partial / RankTars.file(rank))
        stage.publish(RankTars.file(rank))
        barrier()  # every rank's tars are indexed
        if rank != 0:
            return None
        manifest = _finish(stage, ranks, spec, caption_key, class_key)
    except BaseException:
        if ranks == 1 and not stage.remote:  # nothing written half: the partial folder goes (under torchrun, the
            shutil.rmtree(partial, ignore_errors=True)  # next attempt removes it; at a URL, the next writer)
        raise
    finally:
        stage.close()
    stage.finish()
    return manifest


def _key_and_ext(name: str) -> tuple[str | None, str]:
    """webdataset's grouping: the key is the path up to the first dot of its base name, the rest the extension."""
    base = name.rsplit("/", 1)[-1]
    if not base or base.startswith(".") or "." not in base:
        return None, ""
    head, _, ext = base.partition(".")
    return name[:len(name) - len(base)] + head, ext.lower()


class _Member:
    __slots__ = ("at", "digest", "size", "value")

    def __init__(self, at: int, size: int, digest: bytes, value):
        self.at, self.size, self.digest, self.value = at, size, digest, value


def _index_tar(tar, i: int, folder: Path, caption_key: str | None, class_key: str | None) -> dict:
    """One tar read front to back (at a URL, in requests of 8 MB): every member that may be an image, a caption or a
    class hashed and parsed (each image decoded), grouped into examples. Writes its raw index, sha256 and classes
    into `folder`. -> its record."""
    size, mtime_ns = (tar.stat().st_size, tar.stat().st_mtime_ns) if isinstance(tar, Path) else storage.stat(tar)
    groups: dict[str, dict[str, _Member]] = {}
    try:
        with (tarfile.open(tar, mode="r:") if isinstance(tar, Path) else
              tarfile.open(fileobj=storage.open_read(tar), mode="r:")) as f:
            for info in f:
                key, ext = _key_and_ext(info.name)
                kind = KINDS.get(ext) if info.isfile() and key is not None else None
                if kind is None or kind in groups.get(key, {}):  # the first of each kind is the example's
                    continue
                data = f.extractfile(info).read()
                groups.setdefault(key, {})[kind] = _Member(info.offset_data, info.size,
                                                           hashlib.sha256(data).digest(), _parse(kind, data))
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataError(f"tar {tar}: cannot be read as a tar: {e}") from None
    rows, left_out, classes, sides = [], [], [], []
    lacking = {"caption": [], "class": []}
    for key, members in groups.items():
        image = members.get("image")
        why = "no image" if image is None else None if isinstance(image.value, tuple) else \
            f"the image does not decode ({image.value})"
        if why:
            left_out.append({"tar": str(tar), "key": key, "why": why})
            continue
        caption = _caption_member(members, caption_key)
        label = _class_member(members, class_key)
        for what, (_, problem) in (("caption", caption), ("class", label)):
            if problem:
                lacking[what].append([len(rows), key, problem])
        rows.append([image, caption[0], label[0]])
        classes.append(MISSING if label[0] is None else label[0].value)
        sides.append(image.value)
    index = np.full((len(rows), len(RAW), 2), MISSING, dtype=np.int64)
    digests = np.zeros((len(rows), len(RAW), 32), dtype=np.uint8)
    for r, members in enumerate(rows):
        for c, m in enumerate(members):
            if m is not None:
                index[r, c] = (m.at, m.size)
                digests[r, c] = np.frombuffer(m.digest, dtype=np.uint8)
    np.save(folder / f".raw-{i:06d}.idx.npy", index, allow_pickle=False)
    np.save(folder / f".raw-{i:06d}.sha256.npy", digests, allow_pickle=False)
    np.save(folder / f".raw-{i:06d}.cls.npy", np.asarray(classes, dtype=np.int64), allow_pickle=False)
    # which examples lack a caption or a class, and why: one entry per example of a set that has none at all, so it
    # waits in a file of its own, read only where the column is kept (a rank's records stay a few numbers per tar)
    Lacking(caption=lacking["caption"], class_=lacking["class"]).write(folder / Lacking.file(i))
    w = [s[0] for s in sides] or [0]
    h = [s[1] for s in sides] or [0]
    return IndexedTar(i=i, tar=str(tar), bytes=size, mtime_ns=mtime_ns, examples=len(rows), left_out=left_out,
                      lacking=LackingCounts(caption=len(lacking["caption"]), class_=len(lacking["class"])),
                      widths=[min(w), max(w)], heights=[min(h), max(h)])


def _parse(kind: str, data: bytes):
    """What indexing learns of a member: an image's size (or why it does not decode), a caption's text, a JSON's
    object, a class's number; the reason as a string where there is none."""
    try:
        if kind == "image":
            with Image.open(io.BytesIO(data)) as img:
                img.load()  # the whole decode: a truncated JPEG fails here, not at its header
                return img.size
        if kind == "txt":
            return data.decode("utf-8").strip()
        if kind == "json":
            return json.loads(data)
        return _class_number(data.decode("ascii").strip())
    except Exception as e:  # decoders of damaged bytes raise all sorts of things
        return _Problem(str(e).splitlines()[0] if str(e) else type(e).__name__)


class _Problem(str):
    """Why a member could not be parsed."""


def _class_number(value) -> int:
    """A class: a non-negative integer (or its digits), below MAX_CLASSES."""
    if isinstance(value, str) and value.isdigit() and len(value) <= len(str(MAX_CLASSES)):
        value = int(value)
    if not _is(value, int) or not 0 <= value < MAX_CLASSES:
        raise ValueError(f"{str(value)[:20]!r} is not a class number (0..{MAX_CLASSES - 1})")
    return value


def _caption_member(members: dict, caption_key: str | None) -> tuple[_Member | None, str | None]:
    """The member an example's caption is read from, and why there is none."""
    if caption_key is None:
        m = members.get("txt")
        return (None, "no .txt") if m is None else (None, f"its .txt is not UTF-8 ({m.value})") \
            if isinstance(m.value, _Problem) else (m, None)
    m = members.get("json")
    if m is None or isinstance(m.value, _Problem):
        return None, "no .json" if m is None else f"its .json does not parse ({m.value})"
    if not isinstance(m.value, dict) or not isinstance(m.value.get(caption_key), str):
        return None, f"its .json has no text under {caption_key!r}"
    return m, None


def _class_member(members: dict, class_key: str | None) -> tuple[_Member | None, str | None]:
    """The member an example's class is read from (its `value` the class), and why there is none."""
    if class_key is None:
        m = members.get("cls")
        if m is None:
            return None, "no .cls"
        return (None, f"its .cls is not a class number ({m.value})") if isinstance(m.value, _Problem) else (m, None)
    m = members.get("json")
    if m is None or isinstance(m.value, _Problem) or not isinstance(m.value, dict) or class_key not in m.value:
        return None, f"no .json with {class_key!r}"
    try:
        return _Member(m.at, m.size, m.digest, _class_number(m.value[class_key])), None
    except ValueError as e:
        return None, f"its .json's {class_key!r}: {e}"


def _finish(stage: storage.Staging, ranks: int, spec: str, caption_key: str | None, class_key: str | None) -> dict:
    """Rank 0, once every tar is indexed: the columns the set has (a caption, a class where any example has one, or
    where a key was asked for), the examples lacking them left out, each tar's final index and sha256 file, the
    manifest (published last). Reads the raw indices, never the tars."""
    folder = stage.local
    records = sorted((r for rank in range(ranks) for r in RankTars.read(stage.fetch(RankTars.file(rank))).tars),
                     key=lambda r: r.i)
    stage.discard(*(RankTars.file(rank) for rank in range(ranks)))
    captioned = caption_key is not None or any(r.examples > r.lacking.caption for r in records)
    classed = class_key is not None or any(r.examples > r.lacking.class_ for r in records)
    members = ["image", *(["txt"] if captioned else []), *(["cls"] if classed else [])]
    columns = [0, *([1] if captioned else []), *([2] if classed else [])]
    shards, left_out, num_classes = [], [], 0
    for r in records:
        i, raw = r.i, [f".raw-{r.i:06d}.{part}.npy" for part in ("idx", "sha256", "cls")]
        index, digests, classes = (np.load(stage.fetch(p), allow_pickle=False) for p in raw)
        keep = np.ones(len(index), dtype=bool)
        left_out += [e.model_dump() for e in r.left_out]
        lacks = Lacking.file(i)
        lacking = Lacking.read(stage.fetch(lacks)) \
            if captioned and r.lacking.caption or classed and r.lacking.class_ else Lacking()
        stage.discard(lacks)
        for rows, wanted in ((lacking.caption, captioned), (lacking.class_, classed)):
            for row, key, why in rows if wanted else []:
                if keep[row]:
                    left_out.append({"tar": r.tar, "key": key, "why": why})
                keep[row] = False
        if classed and keep.any():
            num_classes = max(num_classes, int(classes[keep].max()) + 1)
        np.save(folder / index_name(i), np.ascontiguousarray(index[keep][:, columns]), allow_pickle=False)
        np.save(folder / digests_name(i), np.ascontiguousarray(digests[keep][:, columns]), allow_pickle=False)
        stage.discard(*raw)
        shards.append({"tar": r.tar, "index": index_name(i), "digests": digests_name(i),
                       "examples": int(keep.sum()), "bytes": r.bytes, "mtime_ns": r.mtime_ns,
                       "index_sha256": file_sha256(folder / index_name(i)),
                       "digests_sha256": file_sha256(folder / digests_name(i)),
                       "widths": r.widths, "heights": r.heights})
        stage.publish(index_name(i), digests_name(i))
    examples = sum(s["examples"] for s in shards)
    if examples == 0:
        first = f" (the first: {left_out[0]['key']} of {left_out[0]['tar']}: {left_out[0]['why']})" if left_out else ""
        raise DataError(f"{spec}: no example with an image that decodes in {len(records)} tars; "
                        f"{len(left_out)} left out{first}")
    kept = [s for s in shards if s["examples"]]
    manifest = {"format": TARS_FORMAT, "examples": examples, "x": "image", "members": members,
                "num_classes": num_classes, "flip": True, "caption_key": caption_key if captioned else None,
                "class_key": class_key if classed else None,
                "image_sizes": {"widths": [min(s["widths"][0] for s in kept), max(s["widths"][1] for s in kept)],
                                "heights": [min(s["heights"][0] for s in kept), max(s["heights"][1] for s in kept)]},
                "left_out_count": len(left_out), "left_out": left_out, "made_from": {"tars": str(spec)},
                "shards": shards}
    TarsManifest.read(manifest, folder / MANIFEST, "indexed tars' manifest")  # what a reader will hold it to
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    stage.publish(MANIFEST)
    return manifest


# --- reading ----------------------------------------------------------------------------------------------------------

class IndexedTars(ShardSource):
    """The examples of a folder `islands index` wrote, read from the tars where they lie (`data.source: shards`
    builds it for such a folder): each image decoded and fitted to `resolution` as the folder source does, its
    caption and class from the member the manifest names. Every member read is checked against its sha256, as
    `ShardSource` does; at the start, only the tars' size and modification time are looked at."""

    remedy = "index the tars again with 'islands index' (or set data.on_error: skip)"

    def __init__(self, path, resolution=None, channels=None, background=None, on_error="stop", cache=None,
                 cache_bytes=None):
        self.root = storage.location(path)
        self.record = m = read_tars_manifest(self.root)
        if resolution is None:
            w, h = m.image_sizes.widths, m.image_sizes.heights
            raise DataError(f"indexed tars {self.root}: the images keep their own sizes ({w[0]}..{w[1]} x "
                            f"{h[0]}..{h[1]}); give data.resolution, the size a run resizes and crops them to")
        self.resolution = _check_resolution(resolution, required=True)
        self.channels = 3 if channels is None else channels
        self.background = 255 if background is None else int(background)
        self.shape = (self.channels, self.resolution, self.resolution)
        self.num_classes, self.flip, self.member, self.quantised = m.num_classes, m.flip, "image", True
        self.arrays, self.member_shape = [0], self.shape
        self.stored_captions = None
        self.holds = frozenset({X} | {field for field, there in ((LABEL, self.num_classes),
                                                                  (CAPTION, "txt" in m.members)) if there})
        self.caption_key, self.class_key = m.caption_key, m.class_key
        self.tars = [storage.location(s.tar) for s in m.shards]
        self.index_files = [self._file_named(s.index) for s in m.shards]
        self.checked_per_member = True
        self.digest_files = [self._file_named(s.digests) for s in m.shards]
        self._at(cache, cache_bytes)
        for tar, entry in zip(self.tars, m.shards, strict=True):
            _check_tar(tar, entry)
        self._ready(on_error)

    def _at(self, cache, cache_bytes) -> None:
        """Its tars may lie at URLs though the folder is local (and the other way round): each read goes where its tar
        lies, ranged where that is a URL."""
        super()._at(cache, cache_bytes)
        self.remote_tars = [storage.is_url(t) for t in self.tars]
        if any(self.remote_tars) and not self.remote:
            self.remote = True
            self.local_files = None
            self.hold_blocks(256, 2)

    def _mapped(self, listed, sha256: str):
        return listed if isinstance(listed, Path) else super()._mapped(listed, sha256)


    def _example(self, shard: int, row: int) -> str:
        return f"example {int(self.starts[shard]) + row} ({self._member_name(shard, row, 0)})"

    def _member_name(self, shard: int, row: int, column: int) -> str:
        """A member's name as its tar header gives it (read only to name it in a message)."""
        at = int(self._index(shard)[0][row, column, 0])
        try:
            header = self._bytes(shard, at - tarfile.BLOCKSIZE, at)
            return tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape").name
        except Exception:  # a damaged header: the byte offset names it
            return f"the member at byte {at}"

    def _changed(self, shard: int, row: int, column: int) -> str:
        return (f"tar {self.tars[shard]} changed since it was indexed: {self._member_name(shard, row, column)} "
                f"(the {self.record.members[column]} of example {int(self.starts[shard]) + row}) is not the "
                f"bytes {self.digest_files[shard]} records; {self.remedy}")

    def _decode(self, blob: bytes, shard: int, row: int) -> np.ndarray:
        try:
            with Image.open(io.BytesIO(blob)) as img:
                return fitted(img, self.resolution, self.channels, self.background)
        except Exception as e:  # decoders of damaged bytes raise all sorts of things
            raise BadMember(f"tar {self.tars[shard]}: {self._example(shard, row)} does not decode: {e}") from None

    def _json(self, blob: bytes, shard: int, row: int) -> dict:
        try:
            value = json.loads(blob)
        except ValueError as e:
            raise BadMember(f"tar {self.tars[shard]}: the .json of {self._example(shard, row)} does not parse: "
                            f"{e}") from None
        if not isinstance(value, dict):
            raise BadMember(f"tar {self.tars[shard]}: the .json of {self._example(shard, row)} is not an object")
        return value

    def _class_of(self, blob: bytes, shard: int, row: int) -> int:
        if self.class_key is None:
            return super()._class_of(blob.strip(), shard, row)
        value = self._json(blob, shard, row).get(self.class_key)
        try:
            if _class_number(value) < self.num_classes:
                return _class_number(value)
        except ValueError:
            pass
        raise BadMember(f"tar {self.tars[shard]}: {self._example(shard, row)} has class {str(value)[:20]!r} under "
                        f"{self.class_key!r}, not one of the manifest's 0..{self.num_classes - 1}")

    def _caption(self, shard: int, row: int, column: int) -> str:
        if self.caption_key is None:
            return super()._caption(shard, row, column).strip()
        self._check_members(shard, row)
        value = self._json(self._member(shard, row, column), shard, row).get(self.caption_key)
        if not isinstance(value, str):
            raise BadMember(f"tar {self.tars[shard]}: the .json of {self._example(shard, row)} has no text under "
                            f"{self.caption_key!r}")
        return value.strip()


def _check_tar(tar, entry: "TarEntry") -> None:
    """A listed tar is there, a regular file, at the size and modification time it was indexed at: a stat, no read (at
    a URL, one request: its size and last modification)."""
    if not isinstance(tar, Path):
        size, mtime_ns = storage.stat(tar)
        if (size, mtime_ns) != (entry.bytes, entry.mtime_ns):
            raise DataError(f"tar {tar} changed since it was indexed ({size} bytes, the index says {entry.bytes}; "
                            f"{'the same' if mtime_ns == entry.mtime_ns else 'another'} modification time); index "
                            "the tars again with 'islands index'")
        return
    try:
        stat = tar.stat()
    except FileNotFoundError:
        raise DataError(f"tar {tar} is missing (the index lists it); index the tars again with 'islands index'") \
            from None
    except OSError as e:
        raise DataError(f"tar {tar}: cannot read: {e.strerror or e}") from None
    if not tar.is_file():
        raise DataError(f"tar {tar}: not a regular file")
    if (stat.st_size, stat.st_mtime_ns) != (entry.bytes, entry.mtime_ns):
        when = "the same" if stat.st_mtime_ns == entry.mtime_ns else "another"
        raise DataError(f"tar {tar} changed since it was indexed ({stat.st_size} bytes, the index says "
                        f"{entry.bytes}; {when} modification time); index the tars again with 'islands index'")


# --- the manifest, read as untrusted ----------------------------------------------------------------------------------

class TarEntry(ManifestRecord):
    """One tar `islands index` read: where it lies (an absolute path or a URL), its size and modification time then,
    its index and member sha256 files in the folder, and its images' stored sizes."""

    tar: str
    index: str
    digests: str
    examples: Count
    bytes: Count
    mtime_ns: int
    index_sha256: str
    digests_sha256: str
    widths: Annotated[list[int], Field(min_length=2, max_length=2)]
    heights: Annotated[list[int], Field(min_length=2, max_length=2)]
    sha256: ClassVar[None] = None  # a tar is checked by its size and mtime, not hashed whole (a shard is)


class LeftOut(ManifestRecord):
    """An example `islands index` left out: its tar, its key there, and why."""

    tar: str
    key: str
    why: str


class LackingCounts(ManifestRecord):
    """How many examples of a tar lack a caption, and a class."""

    model_config = ConfigDict(populate_by_name=True)
    caption: Count
    class_: Count = Field(alias="class")


class IndexedTar(ManifestRecord):
    """What a rank of `islands index` read of one tar (its raw index, sha256 and classes wait beside it): the i-th
    tar of the set, its size and mtime, its examples and those left out, how many lack a caption or a class, and its
    images' sizes."""

    i: Count
    tar: str
    bytes: Count
    mtime_ns: int
    examples: Count
    left_out: list[LeftOut]
    lacking: LackingCounts
    widths: Annotated[list[int], Field(min_length=2, max_length=2)]
    heights: Annotated[list[int], Field(min_length=2, max_length=2)]


class RankTars(Record):
    """OUT/.rank-R.json while `islands index` runs: what rank R read of its tars, which rank 0 makes the manifest of
    (read back, and discarded, in the same command)."""

    tars: list[IndexedTar]

    @staticmethod
    def file(rank: int) -> str:
        return f".rank-{rank}.json"


class Lacking(Record):
    """OUT/.raw-I.lacking.json while `islands index` runs: which examples of tar I lack a caption or a class, and why
    (a row, its key, the reason), read only where that column is kept."""

    model_config = ConfigDict(populate_by_name=True)
    caption: list[tuple[int, str, str]] = []
    class_: list[tuple[int, str, str]] = Field(default=[], alias="class")

    @staticmethod
    def file(i: int) -> str:
        return f".raw-{i:06d}.lacking.json"


class ImageSizes(ManifestRecord):
    widths: Annotated[list[int], Field(min_length=2, max_length=2)]
    heights: Annotated[list[int], Field(min_length=2, max_length=2)]


class TarsManifest(ManifestRecord):
    """OUT/manifest.json of `islands index`; its version is `format` (islands-tars/1)."""

    format: Literal["islands-tars/1"]
    examples: Count
    x: Literal["image"]
    members: Literal[("image",), ("image", "txt"), ("image", "cls"), ("image", "txt", "cls")]
    num_classes: Annotated[int, Field(ge=0, le=MAX_CLASSES)]
    flip: bool
    caption_key: str | None = None
    class_key: str | None = None
    image_sizes: ImageSizes
    left_out_count: Count
    left_out: list[LeftOut] = []
    made_from: dict | None = None
    shards: list[TarEntry]
    latents: ClassVar[None] = None  # an indexed folder holds images as they lie, never latents

    @field_validator("members", mode="before")
    @classmethod
    def _as_tuple(cls, members):
        return tuple(members) if isinstance(members, list) else members

    @model_validator(mode="after")
    def _consistent(self):
        if ("cls" in self.members) != (self.num_classes > 0):
            raise ValueError(f"{self.num_classes} classes, but 'cls' is {'' if 'cls' in self.members else 'not '}"
                             "a member")
        for i, s in enumerate(self.shards):
            if not (storage.is_url(s.tar) or Path(s.tar).is_absolute()) or not s.tar.endswith(".tar"):
                raise ValueError(f"shards[{i}].tar {s.tar!r} is not the absolute path or URL of a .tar")
            if any(Path(name).name != name for name in (s.index, s.digests)):
                raise ValueError(f"shards[{i}]: index names must be file names inside the folder")
        if sum(s.examples for s in self.shards) != self.examples:
            raise ValueError("its tars do not add up to its count (edited by hand?)")
        return self


def read_tars_manifest(root: Path) -> TarsManifest:
    """The manifest of a folder `islands index` wrote, its structure and numbers checked; one line on trouble."""
    root = storage.location(root)
    if isinstance(root, Path) and not root.is_dir():
        raise DataError(f"indexed tars {root} does not exist; write it with 'islands index TARS {root}'")
    path = _named(root, MANIFEST)
    return TarsManifest.read(_manifest_json(path), path, "indexed tars' manifest")


# --- the whole pass, when a person asks -------------------------------------------------------------------------------

def verify(path: Path, progress: bool = False) -> tuple[int, list[str]]:
    """Every member of every example of a shard folder (`islands index`'s or `islands shard`'s) read, checked against
    its sha256 and its image decoded. -> (examples, a line for each bad one)."""
    from islands.data.shards import _format_of

    indexed = _format_of(storage.location(path)) == TARS_FORMAT
    source = ShardSource(path, resolution=1 if indexed else None)  # the decode is the check, not the size
    return len(source), source.verify(progress)
