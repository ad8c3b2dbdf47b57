"""Decentralized Diffusion Models on an autoencoder's latents: experts and router learn the latents, the ensemble
samples them and decodes them into images, the partition clusters stored latents by their means, and the paper-shaped
config (8 DiT-XL/2 experts on SD-VAE latents) plans and trains a step at tiny width."""

import copy
import json

import numpy as np
import pytest
import torch
from conftest import tiny_unet_config, write_config
from test_encode import encode
from test_latents import saved_vae
from torch.utils.flop_counter import FlopCounterMode

from islands.cli import main
from islands.config import load_config
from islands.data import build_data
from islands.data.latents import StoredLatents
from islands.data.sources import Source
from islands.ddm.partition import Partition, partition
from islands.ddm.sampling import open_sampler
from islands.generate import generate
from islands.nets.vae_folder import load_autoencoder


def latent_ensemble_config(tmp_path, data_path, vae, **sections) -> str:
    """Two experts of the tiny U-Net on the 2x4x4 latents of test_latents' autoencoder, a tiny router."""
    cfg = tiny_unet_config(tmp_path / "ens", data_path, model={"attention_resolutions": [2]}, train={"images": 16},
                           data={"autoencoder": str(vae)}, sample={"num": 4, "steps": 2, "solver": "euler"},
                           eval={"num": 8, "metrics": ["fd"], "features": "pixels"},
                           ddm={"k": 2, "partition": {"method": "kmeans", "pca_dim": 8, "fine": 4},
                                "router": {"hidden_size": 16, "depth": 1, "num_heads": 2, "patch_size": 2,
                                           "batch_size": 8, "images": 16}})
    for name, values in sections.items():
        cfg[name] = {**cfg[name], **values}
    return write_config(tmp_path / "ens.yaml", cfg)


def test_an_ensemble_on_latents_samples_images_its_autoencoder_decodes(tmp_path, image_npz, capsys):
    vae = saved_vae(tmp_path / "vae")
    config = latent_ensemble_config(tmp_path, image_npz, vae)
    assert main(["ddm", config, "--quiet"]) == 0
    root, autoencoder = tmp_path / "ens", load_autoencoder(vae)
    # every member learnt the 2x4x4 latents of the 1x8x8 images, and recorded the weights it learnt them of
    for member in ("experts/0", "experts/1", "router"):
        assert json.loads((root / member / "model.json").read_text())["shape"] == [2, 4, 4], member
    manifest = json.loads((root / "ensemble.json").read_text())
    assert manifest["autoencoder_sha256"] == autoencoder.sha256
    # an expert's FLOPs include encoding each image (forward only), as the flop counter counts it on real weights (to
    # the attention, which the meta device's kernel and the CPU's count apart by 2.5%)
    with FlopCounterMode(display=False) as counter:
        copy.deepcopy(autoencoder).encode(torch.zeros(1, 1, 8, 8))
    flops = json.loads((root / "experts" / "0" / "flops.json").read_text())
    assert flops["encoder_flops_per_image"] == pytest.approx(counter.get_total_flops(), rel=0.03)
    # the ensemble's metrics compare decoded images with the images
    assert any("ensemble manifest=" in key for key in json.loads((root / "metrics.json").read_text()))

    # islands sample: the mixture's latents, decoded by the autoencoder, clamped only after decoding
    assert main(["sample", str(root), "--num", "4", "--out", str(tmp_path / "out"), "--quiet"]) == 0
    written = torch.from_numpy(np.load(tmp_path / "out" / "samples.npz")["x"])
    sampler = open_sampler(root)
    labels = sampler.conditions(4)
    latents = generate(sampler.denoiser, (2, 4, 4), 4, sampler.opts, sampler.cfg.seed, labels,
                       for_batch=sampler.for_batch(sampler.cfg.seed))
    assert written.shape == (4, 1, 8, 8) and latents.abs().max() > 1
    torch.testing.assert_close(written, autoencoder.decode(latents / 1.7 + 0.1).clamp(-1, 1), rtol=0, atol=1e-6)

    # a student distilled from the ensemble learns the latents too, its teacher's velocities being of latents
    assert main(["distill", str(root), "train.images=8", "train.batch_size=8", "train.accumulate=1",
                 "--quiet"]) == 0
    assert json.loads((root / "distilled" / "model.json").read_text())["shape"] == [2, 4, 4]

    # the autoencoder changed under the ensemble: sampling it is refused in one line
    saved_vae(vae, seed=1)
    capsys.readouterr()
    assert main(["sample", str(root), "--num", "4", "--out", str(tmp_path / "out2"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "changed since the run recorded it" in err[0]


def test_range_experts_on_latents_sample_images_through_their_gate(tmp_path, image_npz):
    vae = saved_vae(tmp_path / "vae")
    cfg = tiny_unet_config(tmp_path / "ranges", image_npz, model={"attention_resolutions": [2]},
                           data={"autoencoder": str(vae)}, flow={"t_ranges": [0.0, 0.5, 1.0]},
                           train={"images": 16}, sample={"num": 4, "steps": 2, "solver": "euler"})
    config = write_config(tmp_path / "ranges.yaml", cfg)
    for stage in ("tstage=0", "tstage=1"):
        assert main(["train", config, stage, "--quiet"]) == 0
    assert main(["sample", str(tmp_path / "ranges"), "--num", "4", "--out", str(tmp_path / "out"), "--quiet"]) == 0
    written = torch.from_numpy(np.load(tmp_path / "out" / "samples.npz")["x"])
    sampler = open_sampler(tmp_path / "ranges")
    latents = generate(sampler.denoiser, (2, 4, 4), 4, sampler.opts, sampler.cfg.seed, sampler.conditions(4))
    decoded = load_autoencoder(vae).decode(latents / 1.7 + 0.1).clamp(-1, 1)
    assert written.shape == (4, 1, 8, 8)
    torch.testing.assert_close(written, decoded, rtol=0, atol=1e-6)


class Means(Source):
    """The posterior means of shards of stored latents, read here by hand: what the partition should cluster."""

    def __init__(self, stored):
        x, y = stored.get(range(len(stored)))
        self.x, self.y, self.shape, self.num_classes = x[:, :2], y, (2, 4, 4), stored.num_classes
        self.holds = frozenset({"x", "label"})

    def __len__(self):
        return len(self.x)

    def read(self, indices, fields):
        return {"x": self.x[list(indices)], "label": self.y[list(indices)]}


def test_stored_latents_are_partitioned_by_their_means_without_a_decoder_pass(tmp_path, image_npz, monkeypatch):
    vae = saved_vae(tmp_path / "vae")
    assert encode(tmp_path, image_npz, vae) == 0
    shards = {"source": "shards", "path": str(tmp_path / "latents"), "flip": False}
    config = latent_ensemble_config(tmp_path, tmp_path / "latents", vae, data=shards)
    decoded, images_of = [], StoredLatents.images_of
    monkeypatch.setattr(StoredLatents, "images_of", lambda self, x: decoded.append(len(x)) or images_of(self, x))
    assert main(["partition", config, "--quiet"]) == 0
    assert decoded == [8, 8]  # the clusters' picture only (8 examples a cluster), not the k-means
    made = Partition.load(tmp_path / "ens" / "partition")
    stored = build_data(load_config(config).data, 3)
    expected = partition(Means(stored), 2, "kmeans", None, 8, 4, True, seed=3)
    assert made.features_name == expected.features_name and np.array_equal(made.cluster, expected.cluster)


def test_the_paper_shaped_ddm_config_plans_and_its_members_train_a_step_at_tiny_width(tmp_path, image_npz):
    """configs/ddm_dit_xl2_latents.yaml on tiny latent shards: the plan prices 8 DiT-XL/2 experts on the latents'
    shape; at tiny width the partition, an expert and the router each run."""
    vae = saved_vae(tmp_path / "vae")
    assert encode(tmp_path, image_npz, vae) == 0
    paths = [f"data.path={tmp_path / 'latents'}", f"data.autoencoder={vae}", "data.workers=0", "model.num_classes=4"]
    out = tmp_path / "plan"
    assert main(["plan", "configs/ddm_dit_xl2_latents.yaml", *paths, "--network", "infiniband",
                 "--out", str(out)]) == 0
    plan = json.loads(out.with_suffix(".json").read_text())
    assert plan["params"] == pytest.approx(675e6, rel=0.01) and plan["encoder_flops_per_image"] == 0  # stored
    assert any(row["strategy"] == "ddm experts" for row in plan["rows"])
    cfg = load_config("configs/ddm_dit_xl2_latents.yaml", paths)
    assert (cfg.ddm.k, cfg.train.batch_size // cfg.ddm.k) == (8, 32)
    tiny = [*paths, f"run_dir={tmp_path / 'ens'}", "model.hidden_size=32", "model.depth=1", "model.num_heads=2",
            "train.images=16", "train.batch_size=16", "train.precision=fp32", "train.activation_checkpointing=false",
            "train.checkpoint_every=8", "train.sample_every=0", "train.log_every=8", "ddm.k=2",
            "ddm.partition.fine=4", "ddm.partition.pca_dim=8", "ddm.router.hidden_size=16", "ddm.router.depth=1",
            "ddm.router.num_heads=2", "ddm.router.batch_size=8", "ddm.router.images=8", "eval.every=0"]
    ddm = "configs/ddm_dit_xl2_latents.yaml"
    assert main(["partition", ddm, *tiny, "--quiet"]) == 0
    assert main(["train", ddm, "expert=0", *tiny, "--quiet"]) == 0  # one step at batch 16 / 2
    assert main(["train", ddm, "router", *tiny, "--quiet"]) == 0
    for member in ("experts/0", "router"):
        assert json.loads((tmp_path / "ens" / member / "model.json").read_text())["shape"] == [2, 4, 4]
