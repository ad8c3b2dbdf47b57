"""Checkpoints that are either complete or ignored (their layout: islands/rundir.py).

Every rank writes its shards (torch.distributed.checkpoint) into a temporary folder and hashes them; rank 0 fills it
with the whole weights, the trainer's state, the counters and the manifest of every file (the shards' records
gathered from their ranks), marks it complete and renames it into place only when whole.
"""

import os
import shutil
from pathlib import Path

import torch

from islands.errors import CheckpointError, TrainingStopped
from islands.parallel.distributed_checkpoint import UnsafeCheckpoint, load_sharded, save_sharded
from islands.rundir import (
    MARKER,
    SHARDED,
    CheckpointState,
    checkpoint_dir,
    checkpoint_files,
    latest_checkpoint,
    list_checkpoints,
    read_state,
    save_weights,
    verified,
)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(run_dir: Path, images: int, sharded: dict, exports: dict, trainer: dict, state: dict,
                     keep: int, main: bool = True, barrier=lambda: None, group=None) -> Path:
    """Every rank (of `group`, if the run trains on a group of the job's ranks) calls this with its `sharded`
    tensors; rank 0 (`main`) also writes `exports` (file name to whole state dict), `trainer` (torch.save) and
    `state` (state.json), then publishes the folder. A write that fails (a full disk, say) stops the run with
    `TrainingStopped` naming the checkpoint; the partial folder is removed and the earlier checkpoints stay."""
    final = checkpoint_dir(run_dir, images)
    tmp = final.parent / f".tmp-{final.name}"
    try:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        if not main:  # on a node that shares no filesystem with rank 0 its folder is not there
            tmp.mkdir(parents=True, exist_ok=True)
        shards = save_sharded(sharded, tmp / SHARDED, group)  # DCP fsyncs its own files
        if not main:
            return final
        for name, weights in exports.items():
            save_weights(weights, tmp / name)
        torch.save(trainer, tmp / "trainer.pt")
        # every file's size and sha256, the shards' as their ranks hashed them, which every read of them checks
        recorded = {f"{SHARDED}/{name}": record for name, record in shards.items()}
        CheckpointState(**state, files=checkpoint_files(tmp, recorded)).write(tmp / "state.json")
        (tmp / MARKER).write_text("")
        for f in tmp.iterdir():
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        if final.exists():  # a rerun reaching the same image count replaces it whole
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(final.parent)
    except OSError as err:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise TrainingStopped(f"cannot write checkpoint {final}: {err.strerror or err}; the partial folder was "
                              f"removed, last complete checkpoint: {latest_checkpoint(run_dir) or 'none'}") from None
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old)
    return final


def adam_state(opt: torch.optim.Optimizer, net: torch.nn.Module) -> dict:
    """The optimizer's tensors keyed by parameter name, which stays valid across world sizes and
    strategies (a parameter's index in the optimizer does not). Empty state is created first, as AdamW
    would on its first step, so a resume has tensors to load into. Hyper-parameters are not saved:
    they come from the config, which a resume may not change."""
    names = {p: name for name, p in net.named_parameters()}
    held = {}
    if isinstance(opt, torch.optim.SGD):  # train.optimizer=sgd, without momentum: nothing to keep
        return held
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p]
            if not state:
                state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            held[names[p]] = state
    return held


def read_sharded(ckpt: Path, state: dict, group=None, record: CheckpointState | None = None) -> None:
    """Fill `state`'s tensors in place with this rank's slices of the checkpoint's sharded state, each shard file it
    reads checked first against the checkpoint's record (`record`, else its state.json): cut short, a CheckpointError;
    changed, a TamperedCheckpoint, on every rank."""
    record = record or read_state(ckpt)
    try:
        load_sharded(state, ckpt / SHARDED, group, lambda name: verified(ckpt, f"{SHARDED}/{name}", record))
    except UnsafeCheckpoint as err:
        raise CheckpointError(str(err)) from None
