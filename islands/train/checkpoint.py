"""Checkpoints that are either complete or ignored, and nothing that needs unpickling foreign data.

Layout of one checkpoint, `RUN_DIR/checkpoints/<images, 12 digits>/`:
  model.safetensors   the raw weights          ema.safetensors   the averaged weights (if any)
  trainer.pt          our own optimizer, loss-scaler and RNG state (loaded with weights_only=True)
  state.json          counters                 complete          the marker written last
It is written into a temporary folder that is renamed into place only when whole.
"""

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

MARKER = "complete"


class CheckpointError(ValueError):
    pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_weights(state_dict: dict, path: Path, metadata: dict | None = None) -> None:
    """Contiguous CPU copies, so views and shared storage serialise cleanly."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    save_file(tensors, str(path), metadata={k: str(v) for k, v in (metadata or {}).items()})


def load_weights(path: Path) -> dict:
    """Read a safetensors file; anything else (a pickle, a truncated file) is refused by name."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"cannot read weights file {path}: not a valid safetensors file ({err})") from None


def checkpoint_dir(run_dir: Path, images: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{images:012d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first; folders without the marker do not count."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.isdigit() and (p / MARKER).exists())


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def write_checkpoint(run_dir: Path, images: int, files: dict, state: dict, keep: int) -> Path:
    """files maps a file name to ('weights', state_dict) or ('torch', object); state goes to state.json."""
    final = checkpoint_dir(run_dir, images)
    tmp = final.parent / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, (kind, obj) in files.items():
        if kind == "weights":
            save_weights(obj, tmp / name)
        else:
            torch.save(obj, tmp / name)
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    (tmp / MARKER).write_text("")
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():  # a rerun reaching the same image count replaces it whole
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old)
    return final


def read_state(ckpt: Path) -> dict:
    return json.loads((ckpt / "state.json").read_text())


def read_trainer(ckpt: Path, name: str = "trainer.pt") -> dict:
    return torch.load(ckpt / name, map_location="cpu", weights_only=True)
