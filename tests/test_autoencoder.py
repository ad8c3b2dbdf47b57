"""Autoencoders: diffusers' AutoencoderKL read from a folder as untrusted input, and trained by `islands train`."""

import hashlib
import json

import numpy as np
import pytest
import torch
from conftest import random_images

from islands.cli import main
from islands.conditions import network_spec
from islands.config import validate
from islands.errors import ConfigError, DataError
from islands.nets.autoencoder import autoencoder_kl
from islands.nets.vae_folder import WEIGHTS, load_autoencoder
from islands.rundir import latest_checkpoint, load_weights
from islands.train.autoencoder import autoencoder_loss, sobel
from islands.train.logbook import read_metrics
from islands.trainer import train


def tiny_vae(seed: int = 0):
    """A randomly initialised AutoencoderKL for 1x8x8 images: two blocks, 4x4x2 latents."""
    torch.manual_seed(seed)
    return autoencoder_kl(1, (8, 16), 2, 1, 8, True, 8).eval()


def saved_vae(folder, seed: int = 0, **config):
    vae = tiny_vae(seed)
    vae.register_to_config(**config)
    vae.save_pretrained(folder)
    return vae


def folder_digest(folder, names) -> str:
    """What a run records of a folder it reads, by hand: the sha256 of the list of [name, sha256 of the file]."""
    listing = [[name, hashlib.sha256((folder / name).read_bytes()).hexdigest()] for name in sorted(names)]
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()


def test_a_saved_autoencoder_reloads_offline_with_the_same_encoder_and_decoder(tmp_path):
    vae = saved_vae(tmp_path / "vae", scaling_factor=1.5, shift_factor=0.25)
    loaded = load_autoencoder(tmp_path / "vae")
    assert loaded.sha256 == folder_digest(tmp_path / "vae", ["config.json", WEIGHTS])
    x = torch.rand(3, 1, 8, 8) * 2 - 1
    q = loaded.encode(x)
    with torch.no_grad():
        truth = vae.encode(x).latent_dist
        assert torch.equal(q.mean, truth.mean) and torch.equal(q.logvar, truth.logvar)
        assert torch.equal(loaded.decode(q.mean), vae.decode(truth.mean).sample)
    assert loaded.latent_shape((1, 8, 8)) == tuple(q.mean.shape[1:]) == (2, 4, 4)
    with pytest.raises(ValueError, match="images of 3 channels do not fit this autoencoder's 1"):
        loaded.latent_shape((3, 8, 8))
    # SD3's convention, z = (latent - shift) * scale, and back through the decoder
    assert (loaded.scaling_factor, loaded.shift_factor) == (1.5, 0.25)
    assert torch.allclose(loaded.to_diffusion(q.mean), (q.mean - 0.25) * 1.5)
    assert torch.allclose(loaded.from_diffusion(loaded.to_diffusion(q.mean)), loaded.decode(q.mean), atol=1e-6)
    noise = torch.randn_like(q.mean)  # the caller's noise, keyed by its example
    assert torch.equal(q.sample(noise), q.mean + torch.exp(0.5 * q.logvar) * noise)


def test_an_autoencoder_whose_weights_changed_since_the_run_recorded_them_is_refused(tmp_path):
    saved_vae(tmp_path / "vae")
    recorded = load_autoencoder(tmp_path / "vae").sha256
    assert load_autoencoder(tmp_path / "vae", sha256=recorded).sha256 == recorded
    saved_vae(tmp_path / "vae", seed=1)  # other weights of the same shapes, as a retrained VAE
    with pytest.raises(DataError, match=f"changed since the run recorded it: its config.json and {WEIGHTS} hash to"
                       ) as err:
        load_autoencoder(tmp_path / "vae", sha256=recorded)
    assert "\n" not in str(err.value)


def test_folders_that_are_not_a_safe_autoencoder_are_refused_in_one_line(tmp_path):
    saved_vae(tmp_path / "vae")
    (tmp_path / "vae" / WEIGHTS).rename(tmp_path / "vae" / "diffusion_pytorch_model.bin")
    with pytest.raises(DataError, match="holds pickled weights only .diffusion_pytorch_model.bin.; Islands reads "
                                        "safetensors only"):
        load_autoencoder(tmp_path / "vae")
    # a link that leads out of the folder
    saved_vae(tmp_path / "elsewhere")
    (tmp_path / "vae" / WEIGHTS).symlink_to(tmp_path / "elsewhere" / WEIGHTS)
    with pytest.raises(DataError, match="leads out of the folder"):
        load_autoencoder(tmp_path / "vae")
    # weights that would leave a parameter at its random initialisation
    autoencoder_kl(1, (8, 16), 2, 2, 8, True, 8).save_pretrained(tmp_path / "other")  # two layers per block
    (tmp_path / "other" / "config.json").write_text((tmp_path / "elsewhere" / "config.json").read_text())
    with pytest.raises(DataError, match="does not fit its config.json .unexpected keys"):
        load_autoencoder(tmp_path / "other")
    config = json.loads((tmp_path / "elsewhere" / "config.json").read_text())
    (tmp_path / "elsewhere" / "config.json").write_text(json.dumps({**config, "_class_name": "UNet2DModel"}))
    with pytest.raises(DataError, match="describes 'UNet2DModel', not an AutoencoderKL"):
        load_autoencoder(tmp_path / "elsewhere")
    with pytest.raises(DataError, match="does not exist"):
        load_autoencoder(tmp_path / "nowhere")


def test_the_sobel_term_sees_a_shifted_edge_and_the_loss_is_its_closed_form():
    x = -torch.ones(1, 1, 8, 8)
    x[..., 4:] = 1  # a vertical edge: the horizontal response is (1 - -1) * 4 / 8 = 1 beside it, 0 elsewhere
    assert torch.equal(sobel(x)[0, 0, 0], torch.tensor([0.0, 0, 0, 1, 1, 0, 0, 0]))
    assert sobel(x)[0, 1].abs().max() == 0
    mean, logvar = torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 4)
    mean[0, 0, 0, 0] = 2.0  # KL = 0.5 * 2^2 = 2, over 64 pixels
    blurred = x.clone()
    blurred[..., 4] = 0  # the edge smeared by a pixel: L1 = 8 / 64
    loss = autoencoder_loss(x, blurred, mean, logvar, "l1", sobel_weight=0.5, kl_weight=0.1)
    edge_error = (sobel(blurred) - sobel(x)).abs().mean()
    assert edge_error > 0
    assert torch.allclose(loss, torch.tensor([8 / 64 + 0.5 * edge_error + 0.1 * 2 / 64]))


def ae_config(run_dir, data, **train) -> dict:
    return {"run_dir": str(run_dir), "seed": 3, "data": {"source": "npz", "path": str(data), "flip": True},
            "model": {"arch": "autoencoder_kl", "block_out_channels": [8, 16], "latent_channels": 2,
                      "norm_num_groups": 8},
            "train": {"objective": "autoencoder", "images": 96, "batch_size": 8, "accumulate": 2, "lr": 2e-3,
                      "ema_halflife_images": 40, "checkpoint_every": 48, "log_every": 16, **train}}


def squares(folder):
    """64 black 1x8x8 images, each with a white 3x3 square somewhere: structure an autoencoder learns in seconds."""
    rng, x = np.random.default_rng(0), np.zeros((64, 1, 8, 8), np.uint8)
    for image, (row, col) in zip(x, rng.integers(0, 6, (64, 2)), strict=True):
        image[0, row:row + 3, col:col + 3] = 255
    np.savez(folder / "squares.npz", x=x, y=np.zeros(64, np.int64))
    return folder / "squares.npz"


def test_training_an_autoencoder_lowers_its_loss_and_exports_a_folder_the_loader_reads(tmp_path, capsys):
    data = squares(tmp_path)
    run_dir = train(validate(ae_config(tmp_path / "ae", data, images=160, lr=5e-3, ema_halflife_images=0,
                                       checkpoint_every=160)), progress=False)
    losses = [r["loss"] for r in read_metrics(run_dir)]
    assert losses[-1] < 0.6 * losses[0], losses  # 1.04 -> 0.43
    # the export is the last checkpoint's weights, read back by the loader of a user's VAE
    loaded = load_autoencoder(run_dir / "autoencoder")
    weights = load_weights(latest_checkpoint(run_dir) / "model.safetensors")
    for name, tensor in loaded.vae.state_dict().items():
        assert torch.equal(tensor, weights[f"vae.{name}"]), name
    # it reconstructs the data better than the same network did before training
    x = torch.tensor(np.load(data)["x"][:32], dtype=torch.float32) / 127.5 - 1
    untrained = tiny_vae()
    untrained.load_state_dict(_initial_weights(tmp_path, data))
    with torch.no_grad():
        before = (untrained.decode(untrained.encode(x).latent_dist.mean).sample - x).abs().mean()
    after = (loaded.decode(loaded.encode(x).mean).clamp(-1, 1) - x).abs().mean()
    assert after < 0.7 * before, (after, before)
    # its latents measured to unit variance around 0 after (z - shift) * scale
    record = json.loads((run_dir / "autoencoder" / "reconstruction.json").read_text())
    assert (loaded.scaling_factor, loaded.shift_factor) == (record["scaling_factor"], record["shift_factor"])
    assert (run_dir / "samples" / "000000000160.png").is_file()
    # an autoencoder draws no samples: islands sample says where its weights are instead of sampling nonsense
    assert main(["sample", str(run_dir), "--num", "2", "--out", str(tmp_path / "out")]) == 2
    assert f"trained an autoencoder, which draws no samples; its weights are in {run_dir / 'autoencoder'}" in \
        capsys.readouterr().err


def _initial_weights(tmp_path, data) -> dict:
    """The run's network as its seed initialised it (trainer/parts.build_parts seeds, then builds)."""
    from islands.nets import build_network

    cfg = validate(ae_config(tmp_path / "unused", data))
    torch.manual_seed(cfg.seed)
    return build_network(network_spec(cfg.model, (1, 8, 8), 0)).vae.state_dict()


def test_an_interrupted_autoencoder_run_resumes_bit_identically(tmp_path):
    data = random_images(tmp_path)
    short = {"images": 48, "checkpoint_every": 24}  # three steps of two micro-batches, then three more
    straight = train(validate(ae_config(tmp_path / "straight", data, **short)), progress=False)
    train(validate(ae_config(tmp_path / "resumed", data, **{**short, "images": 24})), progress=False)
    resumed = train(validate(ae_config(tmp_path / "resumed", data, **short)), progress=False)
    for name in ("model.safetensors", "ema.safetensors"):
        a, b = (load_weights(latest_checkpoint(run) / name) for run in (straight, resumed))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    exported = [(run / "autoencoder" / WEIGHTS).read_bytes() for run in (straight, resumed)]
    assert exported[0] == exported[1]


@pytest.mark.parametrize(("change", "message"), [
    ({"train": {"objective": "diffusion"}}, "train.objective: 'diffusion' does not train model.arch 'autoencoder_kl'"),
    ({"model": {"num_classes": 4}}, "model.num_classes: an autoencoder is not conditioned on a class"),
    ({"data": {"autoencoder": "vae"}}, "data.autoencoder: latents are for diffusion models of images and their "
                                       "routers .train.objective 'autoencoder'"),
])
def test_an_autoencoder_config_that_cannot_train_is_refused_by_key(tmp_path, change, message):
    cfg = ae_config(tmp_path / "ae", tmp_path / "x.npz")
    for section, values in change.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    if cfg["model"]["arch"] == "unet":
        cfg["model"] = {"arch": "unet"}
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_islands_plan_prices_an_autoencoder_without_a_pipeline_which_it_cannot_train(tmp_path):
    """A pipeline trains denoisers only (trainer/parts refuses it for other objectives); the planner priced one for
    the autoencoder's blocks and failed on the network's missing class count."""
    from islands.plan.network import Network
    from islands.plan.predict import Planner

    cfg = validate(ae_config(tmp_path / "ae", tmp_path / "x.npz"))
    planner = Planner(cfg, Network(name="node", gpus_per_node=8, gpu_tflops=100.0,
                                   node={"gbit_s": 100, "latency_us": 5}), (1, 8, 8), 0)
    rows = {r.strategy for r in planner.rows((10,))}
    assert {"ddp", "fsdp", "local_sgd H=10"} <= rows and "pipeline" not in rows
