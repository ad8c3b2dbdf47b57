"""
data.source hf: a Hugging Face `datasets` dataset as it lies on disk, read in place.

Two layouts: a folder that `Dataset.save_to_disk` wrote (Arrow files, memory-mapped by `datasets.load_from_disk`; a
`DatasetDict`'s folder with `data.split`), or parquet files (`data.path` a folder, searched recursively, or a glob),
read with pyarrow through a memory map one row group at a time. Nothing is copied (no cache of Arrow files is built:
`Dataset.from_parquet` would write one, so parquet is read by pyarrow itself) and nothing is decoded before a batch
asks for it: get() takes its rows by index and decodes their images then, in the loader's workers. So get(indices) is
a function of the indices and the files alone, and the stream resumes exactly at any image on any number of ranks and
workers, as every other source does.

Columns: `image_key` (an `Image` feature, or encoded bytes, or {"bytes", "path"} dicts), `caption_key` (a string
column: the source is captioned), `label_key` (a `ClassLabel`, or an integer column whose classes are 0..max). Left
at None, a key means its usual column ("image", "text", "label") where the dataset has one; a key given that the
dataset lacks is refused by name. Images are decoded as the folder source decodes them (sources.fitted).

Offline only: a path that names no local folder or file (a hub id such as "user/dataset") is refused, and no dataset
script is ever run. A folder that holds a loading script (`*.py`) beside its data files is read from the data files,
the script ignored; one that holds only a script is refused.
"""

import glob
import io
import json
import os
import re
from collections import OrderedDict

import numpy as np
import torch
from PIL import Image

from islands.data.sources import CAPTION, LABEL, Source, X, _check_resolution, _to_unit, fitted
from islands.errors import DataError

ROW_GROUPS = 8  # parquet row groups' columns kept decompressed per process (a batch's rows spread over a few)
DEFAULTS = {"image_key": "image", "caption_key": "text", "label_key": "label"}
# Hugging Face's names for split files: data/train-00000-of-00004.parquet
SPLIT_FILE = re.compile(r"^(\w+?)-\d+-of-\d+$")


def _datasets():
    try:
        import datasets
    except ImportError:
        raise DataError("data.source hf needs the `datasets` package: pip install 'islands[hf]'") from None
    return datasets


def locate(path: str, split: str | None) -> tuple[str, str | list[str]]:
    """-> ("arrow", the folder of one saved Dataset) or ("parquet", its files, sorted), from `path` and `split`;
    refused in one line when `path` is no local dataset (a hub id: this library works offline)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        matches = sorted(glob.glob(path, recursive=True)) if glob.has_magic(path) else []
        if not matches:
            raise DataError(f"hf data {path}: no such folder or files; a hub id is not fetched (this library works "
                            "offline): give a folder that save_to_disk wrote, or parquet files")
        wrong = [m for m in matches if not (os.path.isfile(m) and m.endswith(".parquet"))]
        if wrong:
            raise DataError(f"hf data {path}: the glob matches {wrong[0]}, not a parquet file")
        return "parquet", _of_split(path, matches, split)
    if os.path.isfile(path):
        if not path.endswith(".parquet"):
            raise DataError(f"hf data {path}: a file that is not parquet; give a parquet file or a dataset's folder")
        return "parquet", _of_split(path, [path], split)
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):  # a DatasetDict: one folder per split
        splits = _json(os.path.join(path, "dataset_dict.json")).get("splits")
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise DataError(f"hf data {path}: dataset_dict.json lists no splits")
        if split is None:
            split = splits[0] if len(splits) == 1 else "train" if "train" in splits else None
            if split is None:
                raise DataError(f"hf data {path}: holds the splits {', '.join(splits)}; say which (data.split)")
        if split not in splits:
            raise DataError(f"hf data {path}: has no split {split!r} (it holds {', '.join(splits)})")
        return "arrow", _saved(os.path.join(path, split), None)
    if os.path.isfile(os.path.join(path, "state.json")):
        return "arrow", _saved(path, split)
    files = sorted(glob.glob(os.path.join(glob.escape(path), "**", "*.parquet"), recursive=True))
    if files:
        return "parquet", _of_split(path, files, split)
    scripts = sorted(glob.glob(os.path.join(glob.escape(path), "*.py")))
    if scripts:
        raise DataError(f"hf data {path}: holds a loading script ({os.path.basename(scripts[0])}) and no data files; "
                        "dataset scripts are never run: save the dataset with save_to_disk, or give its parquet files")
    raise DataError(f"hf data {path}: neither a folder that save_to_disk wrote (state.json) nor one with parquet files")


def _saved(folder: str, split: str | None) -> str:
    """A folder of one saved Dataset; a split asked of it must be the one it records."""
    state = _json(os.path.join(folder, "state.json"))
    if split is not None and state.get("_split") != split:
        raise DataError(f"hf data {folder}: holds one dataset (split {state.get('_split')!r}), not a DatasetDict "
                        f"with a split {split!r}; leave data.split out")
    return folder


def _of_split(path: str, files: list[str], split: str | None) -> list[str]:
    """The parquet files of `split`, known by Hugging Face's names (`train-00000-of-00002.parquet`, or a folder
    `train/`). Without a split: every file, unless they are of several splits (then train's, if any)."""
    root = path if os.path.isdir(path) else os.path.dirname(path)
    named = {f: _split_name(os.path.relpath(f, root)) for f in files}
    found = sorted({s for s in named.values() if s is not None})
    if split is None:
        if len(found) < 2:
            return files
        if "train" not in found:
            raise DataError(f"hf data {path}: holds the splits {', '.join(found)}; say which (data.split)")
        split = "train"
    chosen = [f for f in files if named[f] == split]
    if not chosen:
        raise DataError(f"hf data {path}: has no parquet files of split {split!r}"
                        + (f" (it holds {', '.join(found)})" if found else " (its files name no split)"))
    return chosen


def _split_name(relative: str) -> str | None:
    parts = relative.split(os.sep)
    match = SPLIT_FILE.match(os.path.splitext(parts[-1])[0])
    if match:
        return match.group(1)
    return parts[-2] if len(parts) > 1 and parts[-2] != "data" else None


def _json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"hf data file {path}: cannot read as JSON: {e}") from None
    if not isinstance(found, dict):
        raise DataError(f"hf data file {path}: not a JSON object")
    return found


def features_of(path: str, split: str | None = None) -> dict:
    """{column: its feature as a dict ({"_type": "Image"}, {"_type": "Value", "dtype": "string"}, ...)} from the
    dataset's schema alone (dataset_info.json, or the first parquet file's footer): no row read, no `datasets`."""
    kind, where = locate(path, split)
    if kind == "arrow":
        features = _json(os.path.join(where, "dataset_info.json")).get("features")
        if isinstance(features, dict):
            return features
        raise DataError(f"hf data {where}: dataset_info.json names no features")
    import pyarrow.parquet as pq

    schema = pq.read_schema(where[0])
    meta = (schema.metadata or {}).get(b"huggingface")
    if meta:
        features = json.loads(meta).get("info", {}).get("features")
        if isinstance(features, dict):
            return features
    return {field.name: {"_type": "Value", "dtype": str(field.type)} for field in schema}


def has_captions(path: str, caption_key: str | None = None, split: str | None = None) -> bool:
    """Whether the dataset has a caption column (a string one), read from its schema only: what a config's default
    condition is decided by."""
    feature = features_of(path, split).get(caption_key or DEFAULTS["caption_key"])
    return isinstance(feature, dict) and feature.get("_type") == "Value" \
        and feature.get("dtype") in ("string", "large_string")


class HfSource(Source):
    """The rows of a local Hugging Face dataset (see the module's notes). Labelled by a ClassLabel or integer column,
    captioned by a string column, flipped and quantised as photographs are."""

    def __init__(self, path, resolution, image_key=None, caption_key=None, label_key=None, split=None, channels=3,
                 background=None):
        self.resolution = _check_resolution(resolution, required=True)
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {channels!r}")
        self.channels = channels
        self.background = 255 if background is None else int(background)
        self.path, self.split = os.fspath(path), split
        self.kind, self.where = locate(self.path, split)
        self.name = self.path if split is None else f"{self.path} (split {split})"
        self._pid, self._ds, self._groups = None, None, OrderedDict()
        if self.kind == "arrow":
            ds = self._dataset()
            features, self.rows = ds.features, len(ds)
            self.read_from = tuple(sorted(f["filename"] for f in ds.cache_files))
        else:
            features = self._parquet_layout()
            self.read_from = tuple(self.where)
        self.image_key = self._column(features, image_key, "image_key", required=True)
        self.caption_key = self._column(features, caption_key, "caption_key")
        self.label_key = self._column(features, label_key, "label_key")
        self._check_image_column(features[self.image_key])
        self.holds = frozenset({X} | {field for field, key in ((CAPTION, self.caption_key), (LABEL, self.label_key))
                                      if key is not None})
        if self.captioned and not _is_string(features[self.caption_key]):
            raise DataError(f"hf data {self.name}: column {self.caption_key!r} holds {features[self.caption_key]}, "
                            "not text (data.caption_key names the caption column)")
        self.classes = self._classes(features)
        self.num_classes = len(self.classes)
        self.shape = (channels, self.resolution, self.resolution)
        self.flip, self.quantised = True, True

    # --- layout

    def _column(self, features, given, key, required=False):
        name = given or DEFAULTS[key]
        if name in features:
            return name
        if given is not None or required:
            raise DataError(f"hf data {self.name}: has no column {name!r} (data.{key}; its columns: "
                            f"{', '.join(features)})")
        return None

    def _check_image_column(self, feature):
        datasets = _datasets()
        if isinstance(feature, datasets.Image) or isinstance(feature, datasets.Value) \
                and feature.dtype in ("binary", "large_binary") \
                or isinstance(feature, dict) and "bytes" in feature:
            return
        raise DataError(f"hf data {self.name}: column {self.image_key!r} holds {feature}, not images (an Image "
                        "feature or encoded image bytes; data.image_key names the column)")

    def _classes(self, features) -> list:
        """The class names (a ClassLabel's, else 0..max of an integer column); every row's label checked in range,
        reading the label column only."""
        if self.label_key is None:
            return []
        datasets, feature = _datasets(), features[self.label_key]
        if isinstance(feature, datasets.ClassLabel):
            names = list(feature.names)
        elif isinstance(feature, datasets.Value) and feature.dtype.startswith(("int", "uint")):
            names = None
        else:
            raise DataError(f"hf data {self.name}: column {self.label_key!r} holds {feature}, not classes (a "
                            "ClassLabel or integers; data.label_key names the column)")
        limit = len(names) if names is not None else None
        start, top = 0, -1
        for chunk in self._label_chunks():
            if chunk.null_count:
                row = start + int(np.flatnonzero(chunk.is_null().to_numpy(zero_copy_only=False))[0])
                raise DataError(f"hf data {self.name}: row {row}: column {self.label_key!r} holds no label")
            values = chunk.to_numpy(zero_copy_only=False).astype(np.int64)
            bad = np.flatnonzero((values < 0) | (values >= limit if limit is not None else False))
            if len(bad):
                raise DataError(f"hf data {self.name}: row {start + int(bad[0])}: column {self.label_key!r} holds "
                                f"{values[bad[0]]}, outside "
                                f"{f'0..{limit - 1} (its ClassLabel names)' if limit is not None else '0 or more'}")
            top = max(top, int(values.max())) if len(values) else top
            start += len(values)
        return names if names is not None else list(range(top + 1))

    def _label_chunks(self):
        """The label column, chunk by chunk, as stored (memory-mapped Arrow, or each parquet row group's)."""
        if self.kind == "arrow":
            yield from self._dataset().select_columns([self.label_key])[self.label_key].chunks
            return
        for f, g in self.groups:
            yield from self._row_group(f, g, self.label_key).chunks

    def _parquet_layout(self):
        """Each parquet file's rows and row groups, from their footers; the features of the first, which every file
        must share."""
        datasets = _datasets()
        files, starts, schema = self._files(), [0], None
        for path, file in zip(self.where, files, strict=True):
            if schema is None:
                schema = file.schema_arrow
            elif not file.schema_arrow.remove_metadata().equals(schema.remove_metadata()):
                raise DataError(f"hf data {self.name}: {path} has other columns than {self.where[0]}")
            for g in range(file.num_row_groups):
                starts.append(starts[-1] + file.metadata.row_group(g).num_rows)
        # row groups in order across the files: (file, group) of each
        self.groups = [(f, g) for f, file in enumerate(files) for g in range(file.num_row_groups)]
        self.starts = np.asarray(starts, dtype=np.int64)
        self.rows = int(self.starts[-1])
        return datasets.Features.from_arrow_schema(schema)

    # --- this process's open files (a loader worker, forked or spawned, opens its own)

    def __getstate__(self):
        return {**self.__dict__, "_pid": None, "_ds": None, "_groups": OrderedDict()}

    def _mine(self):
        if self._pid != os.getpid():
            self._pid, self._ds, self._groups = os.getpid(), None, OrderedDict()

    def _dataset(self):
        self._mine()
        if self._ds is None:
            try:
                # rows taken by index from the memory map as Arrow tables, nothing decoded
                self._ds = _datasets().load_from_disk(self.where, keep_in_memory=False).with_format("arrow")
            except DataError:
                raise
            except Exception as e:
                raise DataError(f"hf data {self.where}: cannot load: {e}") from None
        return self._ds

    def _files(self):
        self._mine()
        if self._ds is None:
            import pyarrow.parquet as pq

            opened = []
            for path in self.where:
                try:
                    opened.append(pq.ParquetFile(path, memory_map=True))
                except Exception as e:
                    raise DataError(f"hf data file {path}: cannot read as parquet: {e}") from None
            self._ds = opened
        return self._ds

    def _row_group(self, f: int, g: int, column: str):
        """One column of one row group of a parquet file (only that column's pages read), kept for the next batch."""
        self._mine()
        key = (f, g, column)
        if key in self._groups:
            self._groups.move_to_end(key)
            return self._groups[key]
        try:
            values = self._files()[f].read_row_group(g, columns=[column]).column(column)
        except Exception as e:
            raise DataError(f"hf data file {self.where[f]}: row group {g} cannot be read: {e}") from None
        self._groups[key] = values
        if len(self._groups) > ROW_GROUPS:
            self._groups.popitem(last=False)
        return values

    # --- rows

    def __len__(self) -> int:
        return self.rows

    def _take(self, indices, column: str) -> list:
        """The values of `column` in the rows `indices`, in their order, as Python objects (nothing decoded)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(idx) and (idx.min() < 0 or idx.max() >= self.rows):
            raise IndexError(f"example indices outside 0..{self.rows - 1}")
        if self.kind == "arrow":
            return self._dataset()[idx.tolist()].column(column).to_pylist() if len(idx) else []
        group = np.searchsorted(self.starts, idx, side="right") - 1
        values = [None] * len(idx)
        for g in np.unique(group):  # each row group read once, in file order
            which = np.flatnonzero(group == g)
            table = self._row_group(*self.groups[g], column)
            for i, v in zip(which, table.take(idx[which] - self.starts[g]).to_pylist(), strict=True):
                values[i] = v
        return values

    def _decode(self, value, row: int) -> np.ndarray:
        blob = value.get("bytes") if isinstance(value, dict) else value
        if blob is None and isinstance(value, dict) and value.get("path"):
            file = value["path"] if os.path.isabs(value["path"]) else os.path.join(self._root(), value["path"])
            try:
                with open(file, "rb") as f:
                    blob = f.read()
            except OSError as e:
                raise DataError(f"hf data {self.name}: row {row}: column {self.image_key!r} holds no bytes and its "
                                f"file {file} cannot be read: {e.strerror or e}") from None
        if not isinstance(blob, bytes | bytearray | memoryview) or not len(blob):
            raise DataError(f"hf data {self.name}: row {row}: column {self.image_key!r} holds no image")
        try:
            with Image.open(io.BytesIO(blob)) as img:
                return fitted(img, self.resolution, self.channels, self.background)
        except Exception as e:  # decoders of damaged bytes raise all sorts of things
            raise DataError(f"hf data {self.name}: row {row}: column {self.image_key!r} does not decode as an image: "
                            f"{str(e) or type(e).__name__}") from None

    def _root(self) -> str:
        return self.where if self.kind == "arrow" else os.path.dirname(self.where[0])

    def read(self, indices, fields) -> dict:
        idx, got = np.asarray(indices, dtype=np.int64).reshape(-1), {}
        if X in fields:
            images = self._take(idx, self.image_key)
            x = np.stack([self._decode(v, int(i)) for v, i in zip(images, idx, strict=True)]) if len(idx) else \
                np.zeros((0, *self.shape), dtype=np.uint8)
            got[X] = _to_unit(torch.from_numpy(x))
        if LABEL in fields and self.label_key is not None:  # checked in range when the source was built
            got[LABEL] = torch.tensor(self._take(idx, self.label_key), dtype=torch.int64).reshape(-1)
        if CAPTION in fields and self.captioned:
            found = self._take(idx, self.caption_key)
            for i, text in zip(idx, found, strict=True):
                if not isinstance(text, str):
                    raise DataError(f"hf data {self.name}: row {int(i)}: column {self.caption_key!r} holds no "
                                    "caption")
            got[CAPTION] = [text.strip() for text in found]
        return got

    def check(self):
        """Every image decoded as training will decode it, and every caption present, so that a bad row stops a run
        before its first step (remembered per state of the files, data/fingerprint.py)."""
        for lo in range(0, self.rows, 256):
            chunk = np.arange(lo, min(lo + 256, self.rows))
            self.read(chunk, (X, CAPTION))


def _is_string(feature) -> bool:
    datasets = _datasets()
    return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")
