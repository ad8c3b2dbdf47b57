"""Attacks on a folder that Islands reads, shared by the reader tests (issue 35): each turns a good folder into the
one a hostile island or a careless colleague would hand over, so that every reader meets the same attacks.

Each function changes the folder in place and returns what the test needs to assert on (the file outside, the
marker a pickle would write if it were ever unpickled)."""

import json
import os
import pickle
import shutil
from pathlib import Path


def link_out(folder: Path, name: str, outside: Path) -> Path:
    """folder/name becomes a link to a copy of itself at `outside` (a file beyond the folder): the reader must refuse
    to follow it. Returns the copy outside."""
    path = Path(folder) / name
    outside = Path(outside)
    outside.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, outside)
    path.unlink()
    path.symlink_to(outside.resolve())
    return outside


def climb_out(record: Path, key_path: list, outside_name: str = "../outside/x") -> None:
    """In the JSON file `record`, the value at `key_path` (keys and indices) becomes a relative name that climbs out
    of the folder."""
    data = json.loads(Path(record).read_text())
    node = data
    for key in key_path[:-1]:
        node = node[key]
    node[key_path[-1]] = outside_name
    Path(record).write_text(json.dumps(data))


def edit_json(record: Path, edit) -> None:
    """`edit(data)` applied to the JSON file `record` in place (a lying size, a NaN, a wrong type)."""
    data = json.loads(Path(record).read_text())
    edited = edit(data)
    Path(record).write_text(json.dumps(data if edited is None else edited))


def flip_byte_in_place(path: Path, offset: int = -1) -> None:
    """One byte of `path` changed, its size and modification time kept: what a checker keyed on (size, mtime) misses.
    A negative offset counts from the end."""
    path = Path(path)
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


class _Runs:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def pickle_bomb(path: Path, marker: Path) -> Path:
    """A pickle at `path` that creates `marker` when it is unpickled: a reader that never unpickles leaves no marker.
    Returns the marker, for the test to assert it does not exist."""
    Path(path).write_bytes(pickle.dumps(_Runs(str(marker))))
    return Path(marker)
