"""The trainer's seams: the replicas' hook after each step, config errors from the layers that know no config, the
warning where bf16 is emulated, and keys of another kind refused by the config's variants."""

import warnings

import pytest
import yaml
from conftest import tiny_unet, tiny_unet_config, write_config

from islands.cli import main
from islands.config import ConfigError, to_dict, validate
from islands.errors import IslandsWarning
from islands.parallel import launch
from islands.parallel.replicas import Replicas
from islands.rundir import prepare_run_dir
from islands.trainer import train


def test_the_replicas_are_called_after_every_optimizer_step_with_the_image_count(tmp_path, image_npz, monkeypatch):
    seen = []
    monkeypatch.setattr(Replicas, "after_step", lambda self, images, last: seen.append(images))
    train(tiny_unet(tmp_path / "run", image_npz), progress=False)
    assert seen == list(range(8, 97, 8))  # 96 images in global batches of 8


def test_a_network_that_does_not_fit_its_sizes_is_a_config_error_naming_the_key(tmp_path, capsys, image_npz):
    # the attention block's 16 channels cannot be split among 3 heads: the U-Net raises ValueError, the trainer names
    # the section
    config = write_config(tmp_path / "c.yaml", tiny_unet_config(tmp_path / "run", image_npz))
    assert main(["train", config, "model.num_heads=3", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == "islands: config error: model: channels (16) must be divisible by num_heads (3)\n"


def test_a_first_mistake_does_not_lock_the_run_folder_but_a_trained_run_keeps_its_config(tmp_path, capsys, image_npz):
    config = write_config(tmp_path / "c.yaml", tiny_unet_config(tmp_path / "run", image_npz, train={"images": 16}))
    assert main(["train", config, "model.num_heads=3", "--quiet"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert not (tmp_path / "run" / "config.yaml").exists()  # a config that does not build never lands
    # a folder where an earlier start left its config but no checkpoint (an interrupted first run) takes another
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(to_dict(validate(
        tiny_unet_config(tmp_path / "run", image_npz, model={"num_classes": 5})))))
    assert main(["train", config, "--quiet"]) == 0
    capsys.readouterr()
    # once it holds a checkpoint, the run's config binds
    assert main(["train", config, "train.lr=0.1", "--quiet"]) == 2
    assert capsys.readouterr().err == (f"islands: config error: {tmp_path / 'run'} holds a run with another config "
                                       "(train.lr: 0.001 -> 0.1); use a new run_dir\n")


DILOCO = {"strategy": "diloco", "sync_every": 10, "compression": "bf16"}


@pytest.mark.parametrize("began,change,refused", [
    (DILOCO, {"outer_lr": 0.5}, "parallel.outer_lr: 0.7 -> 0.5"),
    (DILOCO, {"sync_every": 20}, "parallel.sync_every: 10 -> 20"),
    (DILOCO, {"compression": "none"}, "parallel.compression: 'bf16' -> 'none'"),
    (DILOCO, {"fragments": 2}, "parallel.fragments: 1 -> 2"),
    (DILOCO, {"worker_batch": [4, 4]}, "parallel.worker_batch: None -> [4, 4]"),
    (DILOCO, {"strategy": "local_sgd"}, "parallel.strategy: 'diloco' -> 'local_sgd'"),
    ({"strategy": "ddp"}, {"strategy": "diloco"}, "parallel.strategy: 'ddp' -> 'diloco'"),
    (DILOCO, {"timeout_s": 60.0, "quorum_timeout_s": 60.0, "min_replicas": 2}, None),
    ({"strategy": "fsdp"}, {"strategy": "pipeline", "stages": 2, "microbatches": 2}, None),
    ({"strategy": "zero1"}, {"strategy": "none"}, None),
])
def test_a_resume_refuses_what_changes_the_trajectory_and_takes_another_layout(tmp_path, image_npz, began, change,
                                                                               refused):
    """The comparison every rank makes with a run folder that holds a complete checkpoint."""
    run = tmp_path / "run"
    before = tiny_unet_config(run, image_npz, parallel=began)
    (run / "checkpoints" / "000000000016").mkdir(parents=True)
    (run / "checkpoints" / "000000000016" / "complete").touch()
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(validate(before))))
    resumed = validate(tiny_unet_config(run, image_npz, parallel={**began, **change}))
    if refused is None:
        prepare_run_dir(resumed)
        assert yaml.safe_load((run / "config.yaml").read_text()) == to_dict(resumed)
        return
    with pytest.raises(ConfigError) as err:
        prepare_run_dir(resumed)
    assert str(err.value) == f"{run} holds a run with another config ({refused}); use a new run_dir"
    assert yaml.safe_load((run / "config.yaml").read_text()) == to_dict(validate(before))  # the record stays


@pytest.mark.parametrize("native", [True, False])
def test_bf16_on_a_cpu_that_emulates_it_is_named_with_its_fix(tmp_path, image_npz, monkeypatch, native):
    monkeypatch.setattr(launch, "bf16_is_native", lambda device: native)
    cfg = tiny_unet(tmp_path / "run", image_npz, train={"precision": "bf16", "images": 16})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(cfg, progress=False)
    said = [str(w.message) for w in caught if issubclass(w.category, IslandsWarning)]
    assert said == ([] if native else
                    ["train.precision: bf16 is emulated on this CPU (no AVX512-BF16 or AMX), about 10x slower than "
                     "fp32; set train.precision=fp32"])


@pytest.mark.parametrize("raw,message", [
    ({"data": {"source": "npz", "path": "x.npz", "means": [[0.0]]}}, "data.means: not used when source is 'npz'"),
    ({"data": {"source": "folder", "resolution": 8}}, "data.path: required key is missing"),
    ({"model": {"arch": "mlp", "patch_size": 2}}, "model.patch_size: not used when arch is 'mlp'"),
    ({"model": {"arch": "vit"}},
     "model.arch: must be one of 'unet', 'dit', 'mlp', 'router', 'autoencoder_kl', 'diffusers' (got 'vit')"),
    ({"model": {"channel": 8}}, "model.channel: unknown key"),
])
def test_a_key_of_another_kind_is_refused_by_the_schema(raw, message):
    with pytest.raises(ConfigError) as err:
        validate({"run_dir": ".", **raw})
    assert str(err.value) == message


def test_a_gpu_checkpoint_keeps_the_devices_generator_for_dropout(monkeypatch, tmp_path):
    """Dropout on CUDA tensors draws from the device's generator, not the CPU's: a checkpoint written on a GPU holds
    both, and a resume sets both (torch.cuda's two functions stand in for a GPU here)."""
    import torch

    from islands.rundir import read_trainer
    from islands.trainer.parts import rng_state, set_rng_state

    device_generator = {"state": torch.tensor([7, 8, 9], dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: device_generator["state"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: device_generator.update(state=state))
    gpu = torch.device("cuda", 0)
    (tmp_path / "ckpt").mkdir()
    torch.save(rng_state(gpu), tmp_path / "ckpt" / "trainer.pt")
    device_generator["state"] = torch.tensor([1, 2, 3], dtype=torch.uint8)  # the generator moved on
    cpu_before = torch.get_rng_state()
    torch.rand(3)
    set_rng_state(read_trainer(tmp_path / "ckpt"), gpu)
    assert device_generator["state"].tolist() == [7, 8, 9]
    assert torch.equal(torch.get_rng_state(), cpu_before)
    assert set(rng_state(torch.device("cpu"))) == {"rng"}  # a CPU run's checkpoints stay as they were
