"""Latent diffusion (`data.autoencoder`): batches encoded before the objective, samples decoded before pictures,
samples.npz and metrics; the autoencoder's weights bound to the run by their hash."""

import json

import numpy as np
import pytest
import torch
from conftest import tiny_unet, tiny_unet_config, write_config
from PIL import Image
from torch.utils.flop_counter import FlopCounterMode

from islands.cli import main
from islands.conditions import network_spec
from islands.config import load_config
from islands.data.latents import LatentStage
from islands.errors import DataError
from islands.generate import generate, load_denoiser, open_run
from islands.nets import build_network
from islands.nets.autoencoder import autoencoder_kl
from islands.nets.vae_folder import load_autoencoder
from islands.rundir import latest_checkpoint, load_weights
from islands.train.logbook import read_metrics
from islands.trainer import train


def latent_run(run_dir, data, vae, evaluate=False, **train_keys):
    """The tiny U-Net of conftest on the 2x4x4 latents of a tiny AutoencoderKL of its 1x8x8 images; with `evaluate`,
    the validation loss and a pixel FD at the end (evaluation may change on a resume)."""
    return tiny_unet(run_dir, data, data={"autoencoder": str(vae)}, train=train_keys,
                     model={"attention_resolutions": [2]}, sample={"num": 8, "steps": 2, "solver": "euler"},
                     eval={"every": 96 if evaluate else 0, "num": 8, "metrics": ["fd"], "features": "pixels",
                           "val_size": 8, "val_times": 2})


def saved_vae(folder, seed=0):
    torch.manual_seed(seed)
    vae = autoencoder_kl(1, (8, 16), 2, 1, 8, True, 8)
    vae.register_to_config(scaling_factor=1.7, shift_factor=0.1)  # latents not in [-1, 1]: nothing may clamp them
    vae.save_pretrained(folder)
    return folder


def test_a_latent_run_resumes_bit_identically_and_samples_decoded_images(tmp_path, image_npz, capsys):
    vae = saved_vae(tmp_path / "vae")
    straight = train(latent_run(tmp_path / "straight", image_npz, vae, evaluate=True), progress=False)
    train(latent_run(tmp_path / "resumed", image_npz, vae, images=48), progress=False)
    resumed = train(latent_run(tmp_path / "resumed", image_npz, vae), progress=False)
    for name in ("model.safetensors", "ema.safetensors"):
        a, b = (load_weights(latest_checkpoint(run) / name) for run in (straight, resumed))
        assert all(torch.equal(a[k], b[k]) for k in a), name
    # the network learnt latents: it takes 2x4x4, and the grid shows 1x8x8 images (8 samples, 3 columns of 8x scale)
    denoiser, cfg, info = load_denoiser(straight)
    assert info.shape == (2, 4, 4)
    grid = Image.open(sorted((straight / "samples").glob("*.png"))[-1])
    assert grid.size == (3 * (8 + 2) * 8 + 2 * 8, 3 * (8 + 2) * 8 + 2 * 8)
    # the trainer's evaluation: the loss on the probe's latents, the FD on decoded samples against the images
    evaluation = read_metrics(straight, "eval")[-1]
    assert len(evaluation["val_loss_by_t"]) == 2 and evaluation["fd"] > 0

    # islands sample writes decoded images: the run's latents through the autoencoder, clamped only after decoding
    assert main(["sample", str(straight), "--num", "4", "--out", str(tmp_path / "out"), "--quiet"]) == 0
    written = torch.from_numpy(np.load(tmp_path / "out" / "samples.npz")["x"])
    latents = generate(denoiser, (2, 4, 4), 4, cfg.sample, cfg.seed, torch.arange(4) % 4)
    autoencoder = load_autoencoder(tmp_path / "vae")
    assert latents.abs().max() > 1  # a latent run whose samples were clamped as images would lose this
    assert torch.equal(written, autoencoder.decode(latents / 1.7 + 0.1).clamp(-1, 1))
    sampler = open_run(straight)  # in Python too: the latent stage is the run's data space
    assert isinstance(sampler.space, LatentStage) and torch.equal(sampler.generate(4, torch.arange(4) % 4), written)
    assert main(["eval", str(straight), "--num", "8", "--metrics", "fd", "--features", "pixels"]) == 0

    # the autoencoder changed under the run: sampling it is refused in one line
    saved_vae(tmp_path / "vae", seed=1)
    capsys.readouterr()
    assert main(["sample", str(straight), "--num", "4", "--out", str(tmp_path / "out2"), "--quiet"]) == 2
    assert "changed since the run recorded it" in capsys.readouterr().err
    with pytest.raises(DataError, match="changed since the run recorded it"):  # and so is resuming it
        train(latent_run(tmp_path / "straight", image_npz, vae, images=192), progress=False)


def test_the_plan_of_a_latent_run_prices_its_network_on_latents_and_the_encoder_on_images(tmp_path, image_npz):
    vae = saved_vae(tmp_path / "vae")
    config = write_config(tmp_path / "c.yaml", tiny_unet_config(tmp_path / "run", image_npz, data={
        "autoencoder": str(vae)}, model={"attention_resolutions": [2]}))
    assert main(["plan", config, "--network", "infiniband", "--out", str(tmp_path / "plan")]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    with torch.device("meta"):  # the network of 2-channel latents, not of 1-channel images
        net = build_network(network_spec(load_config(config).model, (2, 4, 4), 4))
    assert plan["params"] == sum(p.numel() for p in net.parameters())
    with FlopCounterMode(display=False) as counter:  # the encoder's forward on one image, on real weights
        load_autoencoder(vae).encode(torch.zeros(1, 1, 8, 8))
    assert plan["encoder_flops_per_image"] == pytest.approx(counter.get_total_flops(), rel=0.03)
