"""Weights files: safetensors round trip, and no unpickling of anything we did not write."""

import pickle

import pytest
import torch

from islands.errors import CheckpointError
from islands.rundir import list_checkpoints, load_weights, save_weights
from islands.train.checkpoint import read_sharded, write_checkpoint


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
    # torch.load in our code is only ever used with weights_only=True, which refuses it too
    posing_as_state = tmp_path / "trainer.pt"
    posing_as_state.write_bytes(fake.read_bytes())
    with pytest.raises(pickle.UnpicklingError):
        torch.load(posing_as_state, weights_only=True)
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
    ckpt = write_checkpoint(tmp_path, 10, held, {}, {}, {}, keep=1)
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
