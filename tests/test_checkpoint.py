"""Weights files: safetensors round trip, and no unpickling of anything we did not write."""

import json
import pickle
import pickletools

import pytest
import torch
import yaml
from conftest import rerecorded, write_config
from hostile import flip_byte_in_place

from islands.cli import main
from islands.errors import CheckpointError
from islands.rundir import (
    latest_checkpoint,
    list_checkpoints,
    load_weights,
    read_trainer,
    save_weights,
)
from islands.train.checkpoint import read_sharded, write_checkpoint
from islands.untrusted import file_sha256


def test_safetensors_round_trip_keeps_values_and_dtypes(tmp_path):
    state = {"w": torch.randn(3, 4), "b": torch.randn(4).to(torch.bfloat16), "n": torch.arange(5),
             "view": torch.randn(4, 4)[:, 1]}  # a non-contiguous view
    save_weights(state, tmp_path / "w.safetensors")
    back = load_weights(tmp_path / "w.safetensors")
    assert set(back) == set(state)
    for k in state:
        assert back[k].dtype == state[k].dtype and torch.equal(back[k], state[k]), k


class Payload:
    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(MARK),))


MARK = ""


def test_a_pickle_posing_as_weights_is_refused_without_running_it(tmp_path):
    global MARK
    MARK = str(tmp_path / "pwned")
    fake = tmp_path / "model.safetensors"
    fake.write_bytes(pickle.dumps({"w": Payload()}, protocol=2))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_weights(fake)
    assert not (tmp_path / "pwned").exists()


def test_checkpoints_are_whole_or_ignored_and_old_ones_are_pruned(tmp_path):
    for images in (10, 20, 30):
        write_checkpoint(tmp_path, images, {"model": {"w": torch.ones(2) * images}},
                         {"model.safetensors": {"w": torch.ones(2) * images}}, {"rng": torch.get_rng_state()},
                         {"progress": {"images": images}}, keep=2)
    (tmp_path / "checkpoints" / "000000000040").mkdir()  # no marker: a write that died
    assert [p.name for p in list_checkpoints(tmp_path)] == ["000000000020", "000000000030"]


def test_sharded_state_round_trips_and_a_pickle_in_its_metadata_is_refused_without_running_it(tmp_path):
    global MARK
    held = {"model": {"w": torch.randn(3, 4)},
            "optim": {"w": {"step": torch.tensor(7.0), "exp_avg": torch.randn(3, 4)}}}
    ckpt = write_checkpoint(tmp_path, 10, held, {}, {}, {"progress": {}}, keep=1)
    back = {"model": {"w": torch.zeros(3, 4)},
            "optim": {"w": {"step": torch.tensor(0.0), "exp_avg": torch.zeros(3, 4)}}}
    read_sharded(ckpt, back)
    assert torch.equal(back["model"]["w"], held["model"]["w"]) and back["optim"]["w"]["step"] == 7
    assert torch.equal(back["optim"]["w"]["exp_avg"], held["optim"]["w"]["exp_avg"])

    MARK = str(tmp_path / "pwned")
    (ckpt / "sharded" / ".metadata").write_bytes(pickle.dumps(Payload(), protocol=2))
    with pytest.raises(CheckpointError, match="metadata refers to .*getattr"):
        read_sharded(ckpt, back)
    assert not (tmp_path / "pwned").exists()


def a_run_with_one_checkpoint(tmp_path) -> tuple[str, object]:
    """A few steps of a small MLP through `islands train`: its config file and its checkpoint."""
    config = write_config(tmp_path / "c.yaml", {
        "run_dir": str(tmp_path / "run"), "seed": 0, "data": {"source": "gmm", "means": [[1.0, 0.0], [-1.0, 0.0]],
                                                              "std": 0.2, "size": 256},
        "model": {"arch": "mlp", "hidden": 16, "depth": 2, "num_classes": 2},
        "train": {"images": 64, "batch_size": 32, "checkpoint_every": 64, "sample_every": 0}})
    assert main(["train", config, "--quiet"]) == 0
    return config, latest_checkpoint(tmp_path / "run")


def calling(module: str, name: str, arg: str) -> bytes:
    """A protocol-4 pickle of `module.name(arg)`, built opcode by opcode: STACK_GLOBAL looks `name` up in `module`
    and follows its dots, as pickle does from protocol 4 on."""
    def text(s: str) -> bytes:
        return b"\x8c" + bytes([len(s.encode())]) + s.encode()  # SHORT_BINUNICODE

    payload = b"\x80\x04" + text(module) + text(name) + b"\x93" + text(arg) + b"\x85" + b"R" + b"."
    ops = [op.name for op, _, _ in pickletools.genops(payload)]
    assert ops == ["PROTO", "SHORT_BINUNICODE", "SHORT_BINUNICODE", "STACK_GLOBAL", "SHORT_BINUNICODE", "TUPLE1",
                   "REDUCE", "STOP"]
    return payload


@pytest.mark.parametrize("name,arg", [("os.system", "touch {}"), ("Path.touch", "{}")])
def test_a_dotted_global_in_sharded_metadata_is_refused_by_name_on_resume(tmp_path, capsys, name, arg):
    """DCP's own module imports os and Path: a prefix allow-list let a protocol-4 pickle reach them."""
    config, ckpt = a_run_with_one_checkpoint(tmp_path)
    marker = tmp_path / "pwned"
    module = "torch.distributed.checkpoint.filesystem"
    payload = calling(module, name, arg.format(marker))
    pickle.loads(payload)  # the payload is live: unpickled without restriction, it leaves the marker
    assert marker.exists()
    marker.unlink()

    (ckpt / "sharded" / ".metadata").write_bytes(payload)
    rerecorded(ckpt)
    code = main(["train", config, "train.images=128", "--quiet"])
    err = capsys.readouterr().err
    assert not marker.exists()
    assert code == 2 and err.count("\n") == 1, err
    assert f"refers to {module}.{name}," in err and str(ckpt / "sharded" / ".metadata") in err


def test_a_trainer_state_that_would_run_code_is_refused_by_name_on_resume(tmp_path, capsys):
    global MARK
    config, ckpt = a_run_with_one_checkpoint(tmp_path)
    MARK = str(tmp_path / "pwned")
    torch.save({"scaler": {}, "rng": Payload()}, ckpt / "trainer.pt")  # torch's own zip format, as we write it
    torch.load(ckpt / "trainer.pt", weights_only=False)  # the payload is live: unrestricted, it leaves the marker
    assert (tmp_path / "pwned").exists()
    (tmp_path / "pwned").unlink()

    with pytest.raises(CheckpointError, match="trainer.pt: Unsupported global: GLOBAL getattr"):
        read_trainer(ckpt)
    rerecorded(ckpt)
    assert main(["train", config, "train.images=128", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot read {ckpt / 'trainer.pt'}" in err, err
    assert not (tmp_path / "pwned").exists()


def test_a_checkpoint_records_every_file_and_a_swapped_older_weights_file_is_refused_when_sampled(tmp_path, capsys):
    """Issue 35.2: an older valid model.safetensors swapped in (right format, another size or the same) sampled
    silently; every file of a checkpoint now carries its sha256 in state.json."""
    config, first = a_run_with_one_checkpoint(tmp_path)
    assert main(["train", config, "train.images=128", "--quiet"]) == 0
    latest = latest_checkpoint(tmp_path / "run")
    recorded = json.loads((latest / "state.json").read_text())["files"]
    on_disk = sorted(str(p.relative_to(latest)) for p in latest.rglob("*") if p.is_file())
    assert sorted(recorded) == [n for n in on_disk if n not in ("state.json", "complete")]
    assert "sharded/.metadata" in recorded and "model.safetensors" in recorded
    assert all(recorded[n]["sha256"] == file_sha256(latest / n) for n in recorded)

    out = tmp_path / "samples"
    for weights in ("ema.safetensors", "model.safetensors"):
        if (first / weights).exists():
            (latest / weights).write_bytes((first / weights).read_bytes())  # the same size: only the hash tells
    capsys.readouterr()
    assert main(["sample", str(tmp_path / "run"), "--num", "4", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "safetensors: its sha256 is not the one" in err, err
    assert not out.exists()


def test_a_changed_checkpoint_file_stops_the_resume_unless_asked_to_fall_back(tmp_path, capsys):
    """Issue 35.9: a file whose hash fails is an attack, not a crash: one line and exit 2, the checkpoints left as
    they are; --fall-back resumes from the one before, with one warning, and ends where an undisturbed run ends."""
    config, first = a_run_with_one_checkpoint(tmp_path)
    assert main(["train", config, "train.images=128", "train.keep_checkpoints=3", "--quiet"]) == 0
    latest = latest_checkpoint(tmp_path / "run")
    flip_byte_in_place(latest / "model.safetensors")
    capsys.readouterr()
    assert main(["train", config, "train.images=192", "train.keep_checkpoints=3", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.safetensors: its sha256 is not the one" in err and "--fall-back" in err
    assert list_checkpoints(tmp_path / "run") == [first, latest]

    assert main(["train", config, "train.images=192", "train.keep_checkpoints=3", "--fall-back", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert err.count("islands: warning:") == 1 and f"resumed from {first}" in err, err
    fell_back = load_weights(latest_checkpoint(tmp_path / "run") / "model.safetensors")

    undisturbed = write_config(tmp_path / "u.yaml", {**yaml.safe_load(open(config)), "run_dir": str(tmp_path / "u")})
    assert main(["train", undisturbed, "train.images=192", "--quiet"]) == 0
    straight = load_weights(latest_checkpoint(tmp_path / "u") / "model.safetensors")
    assert all(torch.equal(fell_back[k], straight[k]) for k in straight)


def _edited_metadata(ckpt, edit) -> None:
    """The checkpoint's DCP metadata, unpickled, edited and pickled again (with its record rewritten to match)."""
    path = ckpt / "sharded" / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    path.write_bytes(pickle.dumps(edit(metadata)))
    rerecorded(ckpt)


def test_sharded_metadata_of_the_wrong_shape_is_one_line_on_resume(tmp_path, capsys):
    """Issue 35.4: a REDUCE that builds Metadata("x") passed the unpickler's allow-list, then raised AttributeError."""
    from torch.distributed.checkpoint.metadata import Metadata

    config, ckpt = a_run_with_one_checkpoint(tmp_path)
    _edited_metadata(ckpt, lambda _: Metadata("x"))
    capsys.readouterr()
    assert main(["train", config, "train.images=128", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not checkpoint metadata" in err, err


def test_a_shard_named_outside_the_checkpoint_is_not_read(tmp_path, capsys):
    """Issue 35.7: a storage entry's relative_path of ../../outside_ck/x.distcp was followed out of the checkpoint."""
    config, ckpt = a_run_with_one_checkpoint(tmp_path)
    outside = tmp_path / "outside_ck" / "x.distcp"
    outside.parent.mkdir()
    shard = next((ckpt / "sharded").glob("*.distcp"))
    outside.write_bytes(shard.read_bytes())  # what it would read is a good copy: only the rule refuses it

    def lead_out(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = f"../../../outside_ck/{outside.name}"
        return metadata

    _edited_metadata(ckpt, lead_out)
    shard.unlink()
    rerecorded(ckpt)
    capsys.readouterr()
    assert main(["train", config, "train.images=128", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "leads out of the folder" in err, err


_WRITE_ON_TWO_NODES = """
import sys, torch
from islands.parallel.launch import close_world, init_world
from islands.train.checkpoint import write_checkpoint
world = init_world(60)
torch.manual_seed(world.rank)
write_checkpoint(f"{sys.argv[1]}/node{world.rank}", 10, {f"rank{world.rank}": torch.randn(1000)}, {},
                 {"rng": torch.get_rng_state()}, {"progress": {"images": 10}}, keep=1, main=world.is_main,
                 barrier=world.barrier)
close_world()
"""


def test_each_rank_hashes_its_own_shards_and_rank_0_records_all_of_them_without_a_shared_filesystem(tmp_path):
    """Issue 39.3: rank 0 hashed every shard by reading it, so a shard on another node's disk went unrecorded. Each
    rank (here each with a run directory of its own, as two machines without a shared filesystem have) hashes what
    it wrote, and rank 0's state.json records both ranks' shards with the bytes each rank holds."""
    import sys

    from islands.parallel.launch import run_local_ranks

    done = run_local_ranks([sys.executable, "-c", _WRITE_ON_TWO_NODES, str(tmp_path)], 2, 120)
    assert all(d.returncode == 0 for d in done), [d.stderr[-2000:] for d in done]
    ckpt = latest_checkpoint(tmp_path / "node0")
    files = json.loads((ckpt / "state.json").read_text())["files"]
    other = next((tmp_path / "node1" / "checkpoints").glob("*/sharded/__1_0.distcp"))  # never on node 0's disk
    assert not (ckpt / "sharded" / "__1_0.distcp").exists()
    assert files["sharded/__1_0.distcp"] == {"bytes": other.stat().st_size, "sha256": file_sha256(other)}
    own = ckpt / "sharded" / "__0_0.distcp"
    assert files["sharded/__0_0.distcp"] == {"bytes": own.stat().st_size, "sha256": file_sha256(own)}
    assert {"sharded/.metadata", "trainer.pt"} <= files.keys()


def test_a_shard_changed_or_cut_short_is_caught_by_the_rank_that_reads_it(tmp_path):
    """Issue 39.3, on two ranks under FSDP, each of which reads its own shard file: rank 1's shard with one byte
    changed stops the resume on both ranks with one line naming the file (TamperedCheckpoint), --fall-back resumes
    from the checkpoint before with one warning naming it; the same shard cut short is passed over without asking,
    with one warning naming it, as a truncated copy of any other file is."""
    from conftest import run_ranks

    config, first = a_run_with_one_checkpoint(tmp_path)  # one process: a resume reshards it onto two ranks
    fsdp = ("parallel.strategy=fsdp", "train.keep_checkpoints=3", "--quiet")

    def train(images: int, *more: str) -> list:
        return run_ranks(["train", config, f"train.images={images}", *fsdp, *more])

    assert all(r.returncode == 0 for r in train(128))
    latest = latest_checkpoint(tmp_path / "run")
    assert latest != first and (latest / "sharded" / "__1_0.distcp").exists()
    flip_byte_in_place(latest / "sharded" / "__1_0.distcp", offset=-3)
    done = train(192)
    assert [r.returncode for r in done] == [2, 2], [r.stderr[-2000:] for r in done]
    said = done[0].stderr
    assert said.count("\n") == 1 and "__1_0.distcp: its sha256 is not the one" in said and "--fall-back" in said, said
    assert list_checkpoints(tmp_path / "run") == [first, latest]

    done = train(192, "--fall-back")
    assert [r.returncode for r in done] == [0, 0], [r.stderr[-2000:] for r in done]
    said = done[0].stderr
    assert said.count("islands: warning:") == 1 and "__1_0.distcp" in said and f"resumed from {first}" in said, said

    latest = latest_checkpoint(tmp_path / "run")
    shard = latest / "sharded" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])  # a copy that did not finish
    done = train(256)
    assert [r.returncode for r in done] == [0, 0], [r.stderr[-2000:] for r in done]
    said = done[0].stderr
    assert said.count("islands: warning:") == 1 and "__1_0.distcp" in said and "cut short" in said, said
    assert int(latest_checkpoint(tmp_path / "run").name) == 256
