"""The identity of a data set: sha256 of every example and label, in order, as its source gives them. A partition
records the one it was made of and checks the data of every run that reads it against it; a feature classifier and
the reference statistics are cached under it.

Hashing decodes every example: 0.5 s for Fashion-MNIST's 60,000 images, a full decoding pass for a folder of
images, at every start of every expert. So the digest of a source read from files is kept in the cache folder, under
everything the source was built with and the sha256 of each file it is read from (`Source.read_from`): a file whose
bytes changed is hashed again, whatever its size and modification time say. The check a run makes of its data
before its first step (`Source.check`) is remembered the same way.

Keying on content costs one read of those files at every start (sha256 streams at about 1.5 GB/s a core: 0.02 s
for Fashion-MNIST's 30 MB), far less than decoding them. Shards read from terabytes (`islands shard`'s, or tars that
`islands index` indexed where they lie) name only their manifest: it lists the sha256 of their indices and per-member
sha256 files, checked when the source is built, and every member is checked against its sha256 as it is read, so
their tars need not be hashed to be trusted, and a start reads none of their bytes.
"""

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from islands.data.sources import Source
from islands.untrusted import file_sha256


def cache_dir() -> Path:
    """Where trained classifiers, reference statistics and data fingerprints are kept: $ISLANDS_CACHE or
    ~/.cache/islands."""
    return Path(os.environ.get("ISLANDS_CACHE", Path.home() / ".cache" / "islands"))


def data_fingerprint(source: Source) -> str:
    """sha256 of every example and label of `source`, in order; remembered for sources read from files."""
    return remembered(source, "fingerprint", lambda: _digest(source))


def remembered(source: Source, what: str, compute: Callable[[], str]) -> str:
    """compute(), or what it gave for `what` of this source when it was built alike from files of the same bytes;
    computed each time for a source not read from files or not built by `build_source`."""
    files = _files_state(source)
    if not files or source.options is None:
        return compute()
    key = repr((what, source.options, len(source), tuple(source.shape), files))
    path = cache_dir() / "sources" / hashlib.sha256(key.encode()).hexdigest()
    try:
        return path.read_text()
    except OSError:
        pass
    found = compute()
    try:  # whole or not at all, also when experts started at once write it together: a temporary name of its own
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(found)
        os.replace(tmp, path)
    except OSError:  # a cache we cannot write costs time, not correctness
        pass
    return found


def _files_state(source: Source) -> list:
    """The sha256 of every file the source is read from, and the size and mtime of those it checks byte by byte as it
    reads them (`checked_when_read`, a shard folder's tars): a change there that keeps both is caught by the read, so
    they serve only to find an honest change at the start. Empty when a file is gone since the source read it."""
    try:
        content = [(os.path.abspath(p), file_sha256(p)) for p in source.read_from]
        states = [(os.path.abspath(p), s.st_size, s.st_mtime_ns)
                  for p in getattr(source, "checked_when_read", ()) for s in [os.stat(p)]]
    except OSError:
        return []
    return [*content, *states] if content else []


def _digest(source: Source) -> str:
    digest = hashlib.sha256(f"{len(source)}:{tuple(source.shape)}".encode())
    for lo in range(0, len(source), 4096):
        x, y = source.get(list(range(lo, min(len(source), lo + 4096))))
        digest.update(x.float().contiguous().numpy().tobytes())
        if y is not None:
            digest.update(y.long().contiguous().numpy().tobytes())
    return digest.hexdigest()
