"""The run directory: its layout, the one way to write a file into it, and safe readers for what it holds.

RUN_DIR/
  config.yaml           the resolved config (every key the run uses)
  model.json            what the network was built for: {"shape": [...], "num_classes": n}
  flops.json            training FLOPs (islands/train/flops.py)
  metrics.jsonl, eval.jsonl, tensorboard/, samples/, router_accuracy.json
  checkpoints/<images, 12 digits>/
      sharded/          each rank's tensors through torch.distributed.checkpoint: what a resume reads
      model.safetensors the whole weights         ema.safetensors   the averaged weights (if any)
      trainer.pt        loss-scaler and RNG state (read with weights_only=True)
      state.json        counters                  complete          the marker, written last

A checkpoint without its marker does not exist. Every file is written whole into a temporary sibling and renamed
over its name, so a reader sees the old file or the new one, never half of one. Nothing here unpickles: weights
are safetensors, arrays come from .npz archives read with allow_pickle=False.
"""

import contextlib
import io
import os
import pickle
import zipfile
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from islands.config import Config, to_dict, trajectory_changes, validate
from islands.errors import CheckpointError, ConfigError, TamperedCheckpoint
from islands.untrusted import file_sha256, inside

CONFIG, MODEL, MARKER = "config.yaml", "model.json", "complete"


def atomic_write(path: Path, write: Callable[[io.BufferedWriter], None]) -> Path:
    """write(file) into a temporary sibling, flushed to disk, then renamed over `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def atomic_write_text(path: Path, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text.encode()))


def save_weights(state_dict: dict, path: Path, metadata: dict | None = None) -> Path:
    """A safetensors file of contiguous CPU copies, so views and shared storage serialise cleanly."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    payload = safetensors_bytes(tensors, metadata={k: str(v) for k, v in (metadata or {}).items()})
    return atomic_write(path, lambda f: f.write(payload))


def load_weights(path: Path) -> dict:
    """Read a safetensors file; anything else (a pickle, a truncated file) is refused by name."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"cannot read weights file {path}: not a valid safetensors file ({err})") from None


def read_npz(path: Path, names: Iterable[str] | None = None, required: Iterable[str] = (),
             bare: bool = False) -> dict[str, np.ndarray]:
    """The arrays of an .npz archive (those of `names` that it holds; all of them without `names`), read whole and
    never unpickled: object arrays are refused. With `bare`, a plain .npy array comes back under the name "".
    Anything else raises ValueError with the reason ("cannot load: ..." or "no key ..."), for the caller to name
    the file in its own error."""
    try:
        loaded = np.load(path, allow_pickle=False)
        if isinstance(loaded, np.ndarray):
            if bare:
                return {"": loaded}
            raise ValueError("a bare array, not an .npz archive")
        with loaded as archive:
            for name in required:
                if name not in archive.files:
                    raise KeyError(f"no key '{name}'; available keys: {', '.join(archive.files) or '(none)'}")
            wanted = archive.files if names is None else [n for n in names if n in archive.files]
            return {name: archive[name] for name in wanted}
    except KeyError as err:
        raise ValueError(err.args[0]) from None
    except (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error) as err:
        raise ValueError(f"cannot load: {type(err).__name__}: {err}") from None


# --- checkpoints ---------------------------------------------------------------------------------------------------

def checkpoint_dir(run_dir: Path, images: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{images:012d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first; folders without the marker do not count."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.isdigit() and (p / MARKER).exists())


def recorded_weights(run_dir: Path, record: type["WeightsRecord"]) -> str | None:
    """The sha256 of the weights a run recorded in RUN/<record.FILE> when it started (its autoencoder's, its text
    encoder's), which every later open checks; None where the run has no such record."""
    path = Path(run_dir) / record.FILE
    return record.read(path).sha256 if path.exists() else None


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def weights_file(ckpt: Path, use_ema: bool = True) -> Path:
    """The averaged weights when there are some and they are asked for, else the raw ones."""
    ema = Path(ckpt) / "ema.safetensors"
    return ema if use_ema and ema.exists() else Path(ckpt) / "model.safetensors"


def checkpoint_files(ckpt: Path, recorded: dict | None = None) -> dict:
    """{name: {"bytes", "sha256"}} of every file of a checkpoint folder being written (its shards included), for its
    state.json: what every later read of the checkpoint checks. `recorded`: files already hashed by the ranks that
    wrote them (each rank its own shards, which another node's rank 0 may not even see), taken as they are."""
    ckpt, recorded = Path(ckpt), dict(recorded or {})
    found = {str(p.relative_to(ckpt)): p for p in sorted(ckpt.rglob("*"))
             if p.is_file() and p.name not in ("state.json", MARKER)}
    return dict(sorted({**{name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
                              for name, p in found.items() if name not in recorded}, **recorded}.items()))


SHARDED = "sharded"  # the folder of a checkpoint's DCP files


def is_shard(name: str) -> bool:
    """Whether a checkpoint file (by its name in the checkpoint) is a rank's DCP shard, which only the ranks whose
    slices it holds read (and check); `.metadata` is read by every rank."""
    return name.startswith(f"{SHARDED}/") and name != f"{SHARDED}/.metadata"


# --- the records Islands writes into a run and reads back: typed, versioned, validated on read ----------------------

def where(loc: tuple) -> str:
    """A pydantic error's location as a key path: `shards[0].tar`."""
    found = ""
    for part in loc:
        found += f"[{part}]" if isinstance(part, int) else (f".{part}" if found else str(part))
    return found


def one_line(err: ValidationError, path) -> str:
    """The first thing wrong with a record: `path: key: what` (every record's error, whichever model read it)."""
    first = err.errors()[0]
    message = first["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ").splitlines()[0]
    key = where(first["loc"])
    return f"{path}: {key}: {message}" if key else f"{path}: {message}"


class Record(BaseModel):
    """A JSON file Islands writes and reads back. `version` says which layout wrote it (files without one are 1); a
    layout newer than this Islands reads (`VERSION`) is refused by name, not half read."""

    model_config = ConfigDict(extra="forbid")
    VERSION: ClassVar[int] = 1
    version: int = 1

    @field_validator("version")
    @classmethod
    def _known(cls, version: int) -> int:
        if not 1 <= version <= cls.VERSION:
            raise ValueError(f"{version} is not a version this Islands reads (1 to {cls.VERSION})")
        return version

    @classmethod
    def read(cls, path: Path, why: str = ""):
        """The record in `path`, or one line naming the file and the key that is wrong (`why` adds what it means)."""
        try:
            data = Path(path).read_bytes()
        except OSError as err:
            raise CheckpointError(f"cannot read {path}: {err.strerror or err}") from None
        return cls.parse(data, path, why)

    @classmethod
    def parse(cls, data: bytes, path, why: str = ""):
        """The record in `data`, the bytes of `path` (read already, as a verified folder reads them)."""
        try:
            return cls.model_validate_json(data)
        except ValidationError as err:
            raise CheckpointError(f"{one_line(err, path)}{why}") from None

    def write(self, path: Path) -> Path:
        return atomic_write_text(path, self.model_dump_json(indent=1, by_alias=True))


class RunDescription(Record):
    """RUN/model.json: what the run's network was built for."""

    shape: tuple[int, ...]
    num_classes: int = Field(ge=0)


class WeightsRecord(Record):
    """The digest of the files a run read weights from when it started (RUN/autoencoder.json, RUN/text_encoder.json:
    a subclass names its file and where the weights came from)."""

    FILE: ClassVar[str] = ""
    sha256: str = Field(pattern="^[0-9a-f]{64}$")


class FileRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern="^[0-9a-f]{64}$")


class CheckpointState(Record):
    """CHECKPOINT/state.json: the run's counters, and the size and sha256 of each of the checkpoint's files, which
    every read of them checks."""

    progress: dict[str, int]
    files: dict[str, FileRecord]


class LogLine(Record):
    """One line of RUN/metrics.jsonl or RUN/eval.jsonl (train/logbook.py): the images trained when it was written,
    and whatever was logged then (`values`: a loss, a rate, an evaluation, each under its own name)."""

    model_config = ConfigDict(extra="allow")
    images: int = Field(ge=0)
    images_per_s: float | None = None  # metrics.jsonl's, where the line closes a window of training

    @property
    def values(self) -> dict:
        """Every value of the line by its name, `images` among them."""
        return {key: value for key, value in self.model_dump(exclude_unset=True).items() if key != "version"}


def read_log(run_dir: Path, name: str = "metrics") -> list[LogLine]:
    """RUN/<name>.jsonl as its lines, each checked; a line that is not a log line is refused in one line naming the
    file and the line's number."""
    path = Path(run_dir) / f"{name}.jsonl"
    try:
        text = path.read_text()
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err.strerror or err}") from None
    return [LogLine.parse(line, f"{path}, line {n}") for n, line in enumerate(text.splitlines(), 1) if line.strip()]


def read_state(ckpt: Path) -> CheckpointState:
    """The checkpoint's state.json, its record of files checked for shape (a state written by hand is refused)."""
    return CheckpointState.read(Path(ckpt) / "state.json", " (a state written by hand, or by an Islands before 0.1 "
                                                           "hashed its checkpoints, cannot be trusted)")


def verified(ckpt: Path, name: str, state: CheckpointState | None = None) -> Path:
    """ckpt/name, checked against the size and sha256 its state.json recorded: a file cut short (a crash, a copy
    that did not finish) is a CheckpointError, one of the right size with other bytes a TamperedCheckpoint."""
    ckpt = Path(ckpt)
    entry = (state or read_state(ckpt)).files.get(name)
    path = inside(ckpt, name, "checkpoint")
    if entry is None:
        raise CheckpointError(f"{path}: not among the files {ckpt / 'state.json'} records")
    try:
        size = path.stat().st_size
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read: {err.strerror or err}") from None
    if size != entry.bytes:
        raise CheckpointError(f"{path}: {size} bytes, the checkpoint recorded {entry.bytes} (cut short?)")
    if file_sha256(path) != entry.sha256:
        raise TamperedCheckpoint(f"{path}: its sha256 is not the one {ckpt / 'state.json'} recorded: the file was "
                                 "changed after it was written")
    return path


def verify_checkpoint(ckpt: Path) -> CheckpointState:
    """Every file state.json records, checked as `verified` checks one; returns the state."""
    state = read_state(ckpt)
    for name in state.files:
        verified(ckpt, name, state)
    return state


def checkpoint_weights(ckpt: Path, use_ema: bool = True) -> dict:
    """The checkpoint's averaged (else raw) weights, checked against its record before they are read."""
    return load_weights(verified(ckpt, weights_file(ckpt, use_ema).name))


def read_trainer(ckpt: Path) -> dict:
    """The loss scaler's and the RNG's state; weights_only, so a foreign pickle cannot run code."""
    path = Path(ckpt) / "trainer.pt"
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError) as err:
        raise CheckpointError(f"cannot read {path}: {_first_reason(err)}") from None


def _first_reason(err: Exception) -> str:
    """The sentence of torch.load's many-line message that says what was wrong ("Unsupported global: ..."); a bare
    error (a truncated file's EOFError) by its type."""
    lines = str(err).split("WeightsUnpickler error: ", 1)[-1].strip().splitlines()
    return lines[0].split(". ")[0].rstrip(".") if lines else type(err).__name__


# --- the run's description -----------------------------------------------------------------------------------------

def prepare_run_dir(cfg: Config, write: bool = True, holds: str = "a run", may_change: tuple[str, ...] = (),
                    bound: bool | None = None) -> Path:
    """Create the run directory, or check that the one there holds this same run (every rank checks); keys in
    `may_change` may differ too. The config there binds only once something was trained on it (`bound`; by default,
    whether the folder holds a complete checkpoint): before that a corrected config replaces one that failed, so a
    first mistake never locks the folder. Then (with `write`) write the resolved config."""
    run_dir = Path(cfg.run_dir)
    config_file = run_dir / CONFIG
    if bound is None:
        bound = latest_checkpoint(run_dir) is not None
    if bound and config_file.exists():
        changes = [c for c in trajectory_changes(yaml.safe_load(config_file.read_text()), to_dict(cfg))
                   if c.split(":")[0] not in may_change]
        if changes:
            raise ConfigError(f"{run_dir} holds {holds} with another config ({changes[0]}); use a new run_dir")
    if write:
        write_config(cfg)
    return run_dir


def write_config(cfg: Config) -> None:
    """The resolved config, in its run directory (created if need be)."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / CONFIG, yaml.safe_dump(to_dict(cfg), sort_keys=False))


def trained_below(folder: Path) -> bool:
    """Whether any run in `folder` or below it holds a complete checkpoint (an ensemble's members, say)."""
    return any(p.parent.name.isdigit() for p in Path(folder).glob(f"**/checkpoints/*/{MARKER}"))


def write_model_description(run_dir: Path, shape: tuple, num_classes: int) -> None:
    RunDescription(shape=tuple(shape), num_classes=num_classes).write(Path(run_dir) / MODEL)


def describe_run(run_dir: Path) -> tuple[Config, RunDescription]:
    """The run's resolved config and what its network was built for (shape, num_classes)."""
    run_dir = Path(run_dir)
    for name in (CONFIG, MODEL):
        if not (run_dir / name).is_file():
            raise CheckpointError(f"{run_dir} is not a run directory: {name} is missing")
    cfg = validate(yaml.safe_load((run_dir / CONFIG).read_text()))
    return cfg, RunDescription.read(run_dir / MODEL)


def is_run_dir(path: Path) -> bool:
    return (Path(path) / CONFIG).is_file() and (Path(path) / MODEL).is_file()


def run_summary(run_dir: Path) -> str:
    """Where a finished run put things, for people."""
    run_dir = Path(run_dir)
    grids = sorted((run_dir / "samples").glob("*.png"))
    return "\n".join([f"run directory:   {run_dir}",
                      f"checkpoint:      {latest_checkpoint(run_dir)}",
                      f"samples:         {grids[-1] if grids else 'none'}",
                      f"metrics:         {run_dir / 'metrics.jsonl'}",
                      f"tensorboard:     tensorboard --logdir {run_dir / 'tensorboard'}"])


# --- folders built beside their place --------------------------------------------------------------------------------

BUILDING_MARKER = ".islands-building"  # in a folder Islands is building: the one kind of folder it ever removes


def building_folder(out: Path) -> Path:
    """`.OUT.partial` beside `out`: where `out` is built whole before it is renamed into place."""
    out = Path(out)
    return out.with_name(f".{out.name}.partial")


def refuse_foreign_building_folder(out: Path) -> None:
    """A `.OUT.partial` without Islands' marker is a person's (or a link to one): refused, never removed."""
    building = building_folder(out)
    if not (building.exists() or building.is_symlink()):
        return
    if building.is_symlink() or not building.is_dir() or not (building / BUILDING_MARKER).is_file():
        raise ConfigError(f"{building} exists and is not a folder Islands was building (it has no {BUILDING_MARKER}); "
                          "move it away or choose another output")


def start_building(out: Path) -> Path:
    """A fresh, marked `.OUT.partial` to build `out` in; one a killed attempt left (it carries the marker) is removed,
    any other refused (`refuse_foreign_building_folder`)."""
    import shutil  # only the writers of whole folders need it

    refuse_foreign_building_folder(out)
    building = building_folder(out)
    if building.exists():
        shutil.rmtree(building)
    try:
        building.mkdir(parents=True)
    except OSError as err:  # a parent that is a file, a filesystem that takes no folders (/proc), no permission
        raise ConfigError(f"{out}: cannot be written: {err.strerror or err} ({building})") from None
    (building / BUILDING_MARKER).write_text("Islands is building this folder; it is renamed into place when whole\n")
    return building


def finish_building(building: Path, out: Path, replace: bool = False) -> Path:
    """The built folder, its marker taken out, renamed to `out` (which must be absent or an empty folder; with
    `replace`, a full one is moved aside to `.OUT.old` first and removed once the new one is in place)."""
    import shutil

    (Path(building) / BUILDING_MARKER).unlink()
    out = Path(out)
    old = out.with_name(f".{out.name}.old") if replace and out.exists() else None
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    elif out.exists():
        out.rmdir()
    Path(building).rename(out)
    if old is not None:
        shutil.rmtree(old)
    return out


@contextlib.contextmanager
def built_beside(out: Path, replace: bool = False):
    """The one way Islands writes a whole folder: built in a fresh, marked `.OUT.partial` (yielded), renamed to
    `out` when the block ends (`finish_building`), removed when it raises, so `out` is never seen half written."""
    import shutil

    building = start_building(out)
    try:
        yield building
        finish_building(building, out, replace)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
