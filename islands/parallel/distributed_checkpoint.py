"""Sharded checkpoints through torch.distributed.checkpoint (DCP), readable at any world size.

Every rank writes the shards it holds (DTensor shards under FSDP, its optimizer partition under
ZeRO-1; replicated tensors are written once) and reads back whatever slices its new layout needs,
so a run saved by N ranks resumes on M. Without a process group DCP runs as one process.

Only tensors go in: DCP stores other objects as pickles and loads them with weights_only=False.
Its `.metadata` file is itself a pickle, so it is read here with an unpickler that builds only DCP's
own metadata classes and torch's dtypes; anything else in it is refused.

Each rank hashes the shard files it wrote itself (nodes need not share a filesystem for it) and the records of all
ranks are gathered to every rank, for the checkpoint's manifest; a load hands every shard file it is about to read
to a check (the manifest's), once per file, before DCP reads a byte of it.
"""

import contextlib
import io
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from islands.errors import CheckpointError, DataError
from islands.untrusted import file_sha256, inside

# Exactly what DCP's Metadata pickles hold (listed from the checkpoints the test suite writes under every strategy);
# names, not module prefixes: a protocol-4 pickle resolves a dotted name through a module's own imports, so
# ("torch.distributed.checkpoint.filesystem", "os.system") would reach os.system.
_ALLOWED_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}
_TORCH_ENUMS = (torch.dtype, torch.layout, torch.memory_format)


class UnsafeCheckpoint(ValueError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if "." not in name:
            if (module, name) in _ALLOWED_GLOBALS:
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_ENUMS):
                return getattr(torch, name)
        raise UnsafeCheckpoint(f"checkpoint metadata refers to {module}.{name}, which a checkpoint never holds")


class _SafeReader(FileSystemReader):
    def __init__(self, path: str, check: Callable[[str], None] | None = None):
        super().__init__(path)
        self.check, self.checked = check, set()

    def read_data(self, plan, planner):
        """Every file this rank's plan reads, checked (`check`, by its name in the folder) before any is read."""
        if self.check is not None:
            for name in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
                if name not in self.checked:
                    self.check(name)
                    self.checked.add(name)
        return super().read_data(plan, planner)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except UnsafeCheckpoint as err:
            raise UnsafeCheckpoint(f"{path}: {err}") from None
        except Exception as err:  # a damaged file can fail anywhere in the unpickler, and means the same each time
            raise UnsafeCheckpoint(f"cannot read checkpoint metadata {path}: {type(err).__name__}: {err}") from None
        _check_metadata(metadata, path)
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_metadata(metadata, path: Path) -> None:
    """What the unpickler built is DCP's metadata of tensors only, whose storage entries name files inside the
    checkpoint folder at non-negative offsets; anything else is refused before DCP reads a byte by it."""
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data, dict):
        raise UnsafeCheckpoint(f"{path} is not checkpoint metadata")
    kinds = {type(m) for m in metadata.state_dict_metadata.values()}
    if kinds - {TensorStorageMetadata}:  # non-tensor entries would be unpickled without restriction
        raise UnsafeCheckpoint(f"{path} lists entries that are not tensors")
    for info in metadata.storage_data.values():
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str) or not all(
                isinstance(n, int) and n >= 0 for n in (info.offset, info.length)):
            raise UnsafeCheckpoint(f"{path}: a storage entry that is not a file's offset and length ({info!r:.80})")
        try:
            inside(path.parent, info.relative_path, "checkpoint")
        except DataError as err:
            raise UnsafeCheckpoint(str(err)) from None


@contextlib.contextmanager
def _single_process_is_intended():
    """One process without a process group is a supported layout, not something to warn about."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


class _RecordingWriter(FileSystemWriter):
    """DCP's writer, remembering the names of the files this rank wrote."""

    written: tuple[str, ...] = ()

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)  # written by the time it returns; the future is already set
        self.written = tuple(sorted({result.storage_data.relative_path for result in future.wait()}))
        return future


def save_sharded(state: dict, path: Path, group=None) -> dict[str, dict]:
    """Collective under a process group (`group`; None: the whole job's): every rank calls it with its own part of
    `state`. -> {file name in `path`: {"bytes", "sha256"}} of the shard files of every rank, each hashed by the rank
    that wrote it and gathered to all (`.metadata`, the coordinator's, is not among them). A rank's failed write (a
    full disk, say) comes back as that rank's OSError on every rank, not as DCP's wrapper of it, which is not even an
    Exception."""
    writer = _RecordingWriter(str(path))
    try:
        with _single_process_is_intended():
            dcp.save(state, storage_writer=writer, process_group=group)
    except CheckpointException as err:
        failed = next((e for e, _ in err.failures.values() if isinstance(e, OSError)), None)
        if failed is None:
            raise
        raise failed from None
    own = {name: {"bytes": (Path(path) / name).stat().st_size, "sha256": file_sha256(Path(path) / name)}
           for name in writer.written}
    if not dist.is_initialized():
        return own
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, own, group=group)  # a dict of strings: the object collective's pickle is our own
    return {name: record for records in every for name, record in records.items()}


def load_sharded(state: dict, path: Path, group=None, check: Callable[[str], None] | None = None) -> None:
    """Fill the tensors of `state` in place (each rank its own slices) from the checkpoint at `path`, each shard file
    given to `check` (by its name in `path`) before it is read. A file that cannot be read (truncated, say) raises
    UnsafeCheckpoint on every rank, and one `check` refuses its CheckpointError (the lowest rank's), whichever rank
    read it; some tensors may have been filled by then."""
    reader = _SafeReader(str(path), check)
    reader.read_metadata()  # fails here with a plain message; inside dcp.load it would come wrapped
    try:
        with _single_process_is_intended():
            dcp.load(state, storage_reader=reader, process_group=group)
    except CheckpointException as err:  # every rank's failures, gathered by DCP (not even an Exception)
        rank, (failure, _) = min(err.failures.items(), key=lambda item: item[0])
        if isinstance(failure, CheckpointError):  # a check's verdict (a changed file is not a cut one): kept whole
            raise failure from None
        said = (str(failure).strip().splitlines() or [""])[0]
        why = f"{type(failure).__name__}: {said}" if said else type(failure).__name__
        raise UnsafeCheckpoint(f"cannot read {path} (rank {rank}: {why})") from None
