"""Where shards lie: a local path, or a URL of an object store or web server (`s3://bucket/prefix`, `gs://`,
`http(s)://`) read through fsspec (s3fs for S3 and its look-alikes: MinIO, R2). The one module that talks to fsspec:
shards.py, tar_index.py and write.py ask it for bytes, sizes and listings, and hand it finished files to put.

Credentials and endpoints come from the environment, as boto and gcsfs read them (`AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL` for a MinIO-like store, `AWS_PROFILE`, `GOOGLE_APPLICATION_CREDENTIALS`),
never from a config file, which people copy and commit. Every failure of the store (no bucket, no key, wrong
credentials, an endpoint that does not answer) is a `StorageError`: one line naming the URL, never a traceback.

A local path is not a URL: it keeps the readers' own code (`os.pread` on a descriptor), byte for byte as fast as
before. An object is read with ranged requests (`read_range`, one HTTP GET with a `Range` header), written whole
(`put`: an object store makes an object appear whole or not at all, as a rename does on a disk).
"""

import hashlib
import os
import re
import tempfile
from pathlib import Path, PurePath

from islands.errors import DataError

SCHEME = re.compile(r"^([a-z][a-z0-9+.-]*)://", re.IGNORECASE)
# a URL that went through pathlib.Path, which folds `s3://b/k` into `s3:/b/k`
FOLDED = re.compile(r"^(s3|s3a|gs|gcs|r2|http|https|memory|az|abfs):/(?!/)", re.IGNORECASE)


class StorageError(DataError):
    """An object store or web server did not give what was asked (no bucket, no key, refused credentials, no answer
    at the endpoint): one line naming the URL."""


def is_url(path) -> bool:
    """A location read through fsspec: `scheme://...` other than `file://` (a local path keeps the local code)."""
    s = location(path)
    return isinstance(s, str)


def location(path):
    """A path as the readers keep it: a `Path` for a local file, the URL string for anything else (also one that
    went through `Path`, which folds its `//`)."""
    s = os.fspath(path) if isinstance(path, PurePath) else str(path)
    if FOLDED.match(s):
        s = s.replace(":/", "://", 1)
    m = SCHEME.match(s)
    if m is None:
        return Path(s)
    if m.group(1).lower() == "file":
        return Path(s[len("file://"):])
    return s


def join(root, name: str):
    """`name` in the folder `root` (a Path or a URL)."""
    return root / name if isinstance(root, Path) else f"{root.rstrip('/')}/{name}"


def name_of(loc) -> str:
    return loc.name if isinstance(loc, Path) else loc.rstrip("/").rsplit("/", 1)[-1]


def parent_of(loc):
    return loc.parent if isinstance(loc, Path) else loc.rstrip("/").rsplit("/", 1)[0]


def _fs(url: str):
    """fsspec's file system for `url` and the path within it. fsspec keeps one instance per process and thread (a
    forked loader worker gets its own), so this is cheap to call at every read."""
    try:
        import fsspec
    except ImportError as e:
        raise StorageError(f"{url}: reading a URL needs fsspec ({e}); pip install 'islands[remote]'") from None
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:  # s3fs, gcsfs, aiohttp
        raise StorageError(f"{url}: no file system for this URL ({e}); pip install 'islands[remote]'") from None
    except ValueError as e:
        raise StorageError(f"{url}: {e}") from None


def scheme_of(url: str) -> str:
    return SCHEME.match(url).group(1).lower()


# Where each store's endpoint and credentials come from (the environment, as its client reads it).
ENDPOINT = {"gs": "STORAGE_EMULATOR_HOST for an emulator", "gcs": "STORAGE_EMULATOR_HOST for an emulator"}
CREDENTIALS = {"gs": "GOOGLE_APPLICATION_CREDENTIALS or gcloud's login", "gcs": "GOOGLE_APPLICATION_CREDENTIALS "
               "or gcloud's login", "http": "none are sent", "https": "none are sent"}
WEB = ("http", "https")  # a web server: read with ranged GETs, never written


def _wrapped(e: BaseException) -> BaseException | None:
    """What fsspec's HTTP reader wrapped in the FileNotFoundError it raises for anything that went wrong, a server
    that does not answer as a missing file: the connection error, or the answer (aiohttp's, with its `status`);
    None for a FileNotFoundError of its own or another error."""
    if not isinstance(e, FileNotFoundError) or e.__cause__ is None:
        return None
    cause = e.__cause__
    while cause.__cause__ is not None:
        cause = cause.__cause__
    return None if isinstance(cause, FileNotFoundError) else cause


def _failure(url: str, what: str, e: BaseException) -> StorageError:
    """One line for whatever the store's client raised."""
    scheme = scheme_of(url) if SCHEME.match(url) else ""
    cause = _wrapped(e)
    status = getattr(cause, "status", None)  # a web server's answer
    if isinstance(status, int):
        why = "no such object" if status in (404, 410) else getattr(cause, "message", "") or "refused"
        return StorageError(f"{url}: cannot {what}: {why} (HTTP {status})")
    if isinstance(cause, OSError):  # no answer at all
        e = cause
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, FileNotFoundError):
        why = f"no such object or bucket ({text})"
    elif isinstance(e, PermissionError):
        why = (f"access refused ({text}); credentials come from the environment ("
               f"{CREDENTIALS.get(scheme, 'AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE')}), never from "
               "the config")
    else:
        why = f"{type(e).__name__}: {text}"
        if any(word in why.lower() for word in ("connect", "endpoint", "timeout", "refused")):
            why += (" (the server does not answer)" if scheme in WEB else
                    f" (the endpoint comes from the environment: {ENDPOINT.get(scheme, 'AWS_ENDPOINT_URL')})")
    return StorageError(f"{url}: cannot {what}: {why}")


def _call(url: str, what: str, action):
    try:
        return action()
    except StorageError:
        raise
    except Exception as e:  # botocore's, aiohttp's and fsspec's errors: one line naming the URL
        raise _failure(url, what, e) from None


def read_bytes(loc) -> bytes:
    """A whole (small) file or object."""
    if isinstance(loc, Path):
        return loc.read_bytes()
    fs, path = _fs(loc)
    return _call(loc, "read", lambda: fs.cat_file(path))


def read_range(url: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of an object: one ranged request."""
    fs, path = _fs(url)
    return _call(url, f"read bytes {start}..{end}", lambda: fs.cat_file(path, start=start, end=end))


def stat(url: str) -> tuple[int, int]:
    """(size, modification time in ns; 0 where the store gives none) of an object, asked afresh."""
    fs, path = _fs(url)

    def info():
        fs.invalidate_cache(path)
        return fs.info(path)

    found = _call(url, "look it up", info)
    if found.get("type") == "directory":
        raise StorageError(f"{url}: not an object (a prefix)")
    return int(found["size"]), _mtime_ns(found)


def _mtime_ns(info: dict) -> int:
    when = info.get("LastModified") or info.get("mtime") or info.get("last_modified") or info.get("updated")
    if hasattr(when, "timestamp"):
        return int(when.timestamp() * 1e9)
    try:
        return int(float(when) * 1e9)
    except (TypeError, ValueError):
        return 0


def sizes(urls: list[str]) -> dict[str, int]:
    """The size of each object in `urls` by one listing of each prefix (a request per thousand objects, not one per
    object), and by a request of its own for one the listing does not show (a web server that lists no folder); an
    object that is not there is left out."""
    found = {}
    for parent in dict.fromkeys(parent_of(u) for u in urls):
        fs, path = _fs(parent)
        try:
            fs.invalidate_cache(path)
            entries = fs.ls(path, detail=True)
        except FileNotFoundError:
            continue
        except Exception as e:
            raise _failure(parent, "list it", e) from None
        for entry in entries:  # a web server's listing is links, without sizes: those are asked one by one
            if entry.get("type") != "directory" and entry.get("size") is not None:
                found[join(parent, name_of(entry["name"]))] = int(entry["size"])
    for u in urls:
        if u not in found:
            try:
                found[u] = stat(u)[0]
            except StorageError:
                pass
    return {u: found[u] for u in urls if u in found}


def exists(loc) -> bool:
    if isinstance(loc, Path):
        return loc.exists()
    fs, path = _fs(loc)
    return _call(loc, "look it up", lambda: (fs.invalidate_cache(path), fs.exists(path))[1])


def listdir(url: str) -> list[str]:
    """The names of the objects directly under a prefix (none where there is none)."""
    fs, path = _fs(url)
    try:
        fs.invalidate_cache(path)
        return sorted(name_of(e) for e in fs.ls(path, detail=False))
    except FileNotFoundError:
        return []
    except Exception as e:
        raise _failure(url, "list it", e) from None


def glob(pattern: str) -> list[str]:
    """The objects a glob names, as URLs, sorted."""
    fs, path = _fs(pattern)
    found = _call(pattern, "list it", lambda: fs.glob(path))
    scheme = SCHEME.match(pattern).group(0)
    return sorted(f"{scheme}{p}" if not SCHEME.match(p) else p for p in found)


def check_bucket(url: str, what: str = "write") -> None:
    """The store answers and the bucket (or host) is there: one request, so that a writer stops before it writes and
    a reader names the bucket, not the object, that is missing. A web server is read-only: a writer is refused."""
    if scheme_of(url) in WEB:
        if what == "write":
            raise StorageError(f"{url}: cannot write: a web server (http, https) is read-only here; write to a "
                               "local folder or a bucket (s3://, gs://) and serve that")
        _check_server(url)
        return
    fs, path = _fs(url)
    root = path.split("/", 1)[0]
    if not _call(url, "reach its bucket", lambda: (fs.invalidate_cache(root), fs.exists(root))[1]):
        raise StorageError(f"{url}: cannot {what}: no bucket {root!r} at the endpoint"
                           f"{' (create it first)' if what == 'write' else ''}")


def _check_server(url: str) -> None:
    """A web server has no bucket: its host answers (any status: a missing file is the caller's to name), or the
    one line says it does not."""
    fs, _ = _fs(url)
    host = re.match(r"^[a-z]+://[^/]+", url, re.IGNORECASE).group(0)
    try:
        fs.info(f"{host}/")
    except Exception as e:  # any answer, a 404 too, says the server is there; a connection error that it is not
        if not isinstance(e, FileNotFoundError) or isinstance(_wrapped(e), OSError):
            raise _failure(url, "reach its server", e) from None


def put(local: Path, url: str) -> None:
    """The local file `local` as the object `url`, whole or not at all."""
    fs, path = _fs(url)
    _call(url, "write", lambda: fs.put_file(str(local), path))


def remove(url: str) -> None:
    fs, path = _fs(url)
    _call(url, "remove", lambda: fs.rm_file(path))


def download(loc, local: Path) -> Path:
    """A file or object copied to `local`, written beside it and renamed: whole or not at all, also when several
    processes fetch it at once."""
    local.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=local.parent, prefix=f".{local.name}.")
    os.close(fd)
    try:
        if isinstance(loc, Path):
            Path(tmp).write_bytes(loc.read_bytes())
        else:
            fs, path = _fs(loc)
            _call(loc, "read", lambda: fs.get_file(path, tmp))
        os.replace(tmp, local)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return local


def open_read(url: str, block_size: int = 8 << 20):
    """A seekable file object over an object, read ahead `block_size` bytes per request (a tar read front to back)."""
    fs, path = _fs(url)
    return _call(url, "open", lambda: fs.open(path, "rb", block_size=block_size, cache_type="readahead"))


def cache_key(loc) -> str:
    """A short name for a URL in a local cache folder."""
    return hashlib.sha256(str(loc).encode()).hexdigest()[:24]


class DiskCache:
    """data.cache: whole objects kept in a local folder under a byte budget, the least recently opened removed first.
    Several loader workers and ranks may share the folder: an object is downloaded beside its name and renamed into
    place, and a file removed while another process has it open stays readable by that process (POSIX), which
    opens it again (downloading it again) only if it was gone before it opened it."""

    def __init__(self, folder: Path, budget: int | None):
        self.folder, self.budget = Path(folder), budget

    def open(self, url: str, size: int, sha256: str | None = None, mtime_ns: int | None = None) -> int:
        """A read-only descriptor of the object `url`, of `size` bytes (and, where given, of that sha256: an object
        changed since its manifest was written is refused, by URL)."""
        key = sha256 or hashlib.sha256(f"{url}\n{size}\n{mtime_ns}".encode()).hexdigest()
        local = self.folder / f"{key}{Path(name_of(url)).suffix}"
        for _ in range(3):  # another process may remove it between our look and our open
            if not local.exists():
                self._fetch(url, local, size, sha256)
            try:
                fd = os.open(local, os.O_RDONLY)
            except FileNotFoundError:
                continue
            os.utime(local)  # recently used: the last to go
            return fd
        raise StorageError(f"{url}: data.cache {self.folder} removes it as fast as it is downloaded (raise "
                           "data.cache_bytes)")

    def _fetch(self, url: str, local: Path, size: int, sha256: str | None) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.budget is not None and size > self.budget:
            raise StorageError(f"{url}: {size} bytes do not fit data.cache_bytes ({self.budget})")
        self.make_room(size)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{local.name}.")
        os.close(fd)
        try:
            fs, path = _fs(url)
            _call(url, "read", lambda: fs.get_file(path, tmp))
            got = os.path.getsize(tmp)
            if got != size or sha256 is not None and _file_sha256(Path(tmp)) != sha256:
                raise StorageError(f"{url} changed since its manifest was written ({got} bytes, the manifest says "
                                   f"{size}{'' if got != size else ', and another sha256'})")
            os.replace(tmp, local)
        finally:
            Path(tmp).unlink(missing_ok=True)

    def make_room(self, incoming: int) -> None:
        """The least recently opened files removed until `incoming` more bytes fit the budget."""
        if self.budget is None:
            return
        files = []
        for p in self.folder.iterdir():
            if p.name.startswith("."):
                continue
            try:
                st = p.stat()
            except FileNotFoundError:  # another process removed it
                continue
            files.append((st.st_mtime_ns, st.st_size, p))
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files):
            if total + incoming <= self.budget:
                break
            p.unlink(missing_ok=True)
            total -= size


def _file_sha256(path: Path) -> str:
    from islands.untrusted import file_sha256

    return file_sha256(path)


# --- writing a folder: on this disk, or at a URL --------------------------------------------------------------------

OURS = re.compile(r"^(shard-\d{6}\.(tar|idx\.npy|sha256\.npy)|\.rank-\d+\.json"
                  r"|\.raw-\d{6}\.((idx|sha256|cls)\.npy|lacking\.json))$")


def refuse_written_over(out) -> None:
    """`out` must be absent or empty: on a disk, a folder (and a `.OUT.partial` beside it one Islands was building);
    at a URL, a prefix of a bucket that is there, holding no manifest and nothing but the files a killed writer of
    ours leaves (shards, indices, their parts), which the next writer removes."""
    from islands.rundir import refuse_foreign_building_folder

    out = location(out)
    if isinstance(out, Path):
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise DataError(f"{out} is not an empty folder; shards are never written over another data set")
        refuse_foreign_building_folder(out)
        return
    check_bucket(out)
    names = listdir(out)
    if any(not OURS.match(name) for name in names):
        raise DataError(f"{out} is not empty (it holds {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}); "
                        "shards are never written over another data set")


class Staging:
    """Where a writer of a folder (islands shard, encode, index) puts its files, rank by rank. On a disk, a marked
    `.OUT.partial` beside `out`, renamed to `out` once whole (rundir's building folders). At a URL, a local scratch
    folder whose files are put to the prefix one by one as they are finished (`publish`: a shard's tar, index and
    sha256 as soon as its last example is written, so the local disk holds one shard), the manifest last: a prefix
    without its manifest is no data set, and the next writer removes what a killed one left."""

    def __init__(self, out, rank: int, barrier):
        from islands.rundir import building_folder, start_building

        self.out, self.rank = location(out), rank
        self.remote = isinstance(self.out, str)
        barrier()  # every rank has looked at `out` before rank 0 clears what a killed attempt left
        if self.remote:
            if rank == 0:
                for name in listdir(self.out):
                    remove(join(self.out, name))
            self.local = Path(tempfile.mkdtemp(prefix="islands-staging-"))
        else:
            self.local = start_building(self.out) if rank == 0 else building_folder(self.out)
        barrier()

    def publish(self, *names: str) -> None:
        """Finished files of the scratch folder, put at the URL (and removed here); nothing to do on a disk."""
        if self.remote:
            for name in names:
                put(self.local / name, join(self.out, name))
                (self.local / name).unlink()

    def fetch(self, name: str) -> Path:
        """A file another rank published, here (downloaded from the URL where it is not)."""
        path = self.local / name
        if self.remote and not path.exists():
            download(join(self.out, name), path)
        return path

    def discard(self, *names: str) -> None:
        for name in names:
            (self.local / name).unlink(missing_ok=True)
            if self.remote:
                remove(join(self.out, name))

    def finish(self) -> None:
        """Rank 0, once everything is published: the folder in place."""
        from islands.rundir import finish_building

        if self.remote:
            self.close()
        else:
            finish_building(self.local, self.out)

    def close(self) -> None:
        """A rank's scratch folder removed (at a URL; on a disk the building folder is the output)."""
        if self.remote:
            import shutil

            shutil.rmtree(self.local, ignore_errors=True)
