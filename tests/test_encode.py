"""`islands encode`: latents precomputed into shards, and runs that train on them as on-the-fly latent runs do."""

import json

import numpy as np
import pytest
import torch
from conftest import run_ranks, tiny_unet_config, write_config
from test_latents import saved_vae

from islands.cli import main
from islands.conditions import network_spec
from islands.config import load_config, validate
from islands.data import build_data
from islands.data.latents import open_data_space
from islands.data.loader import training_batches
from islands.nets import build_network
from islands.nets.vae_folder import load_autoencoder
from islands.rundir import latest_checkpoint, load_weights
from islands.trainer import train


def encode(tmp_path, image_npz, vae, out="latents", *extra):
    config = write_config(tmp_path / "c.yaml", {"run_dir": str(tmp_path / "run"),
                                                "data": {"source": "npz", "path": str(image_npz), "flip": True}})
    return main(["encode", config, str(tmp_path / out), "--autoencoder", str(vae), "--shard-size", "10",
                 "--batch-size", "4", "--order", "given", "--quiet", *extra])


def test_islands_encode_stores_each_posterior_and_its_flips(tmp_path, image_npz):
    vae = saved_vae(tmp_path / "vae")
    assert encode(tmp_path, image_npz, vae) == 0
    manifest = json.loads((tmp_path / "latents" / "manifest.json").read_text())
    autoencoder = load_autoencoder(vae)
    assert manifest["latents"] == {"autoencoder_sha256": autoencoder.sha256, "scaling_factor": 1.7,
                                   "shift_factor": 0.1, "latent_shape": [2, 4, 4], "image_shape": [1, 8, 8],
                                   "flipped": True, "dtype": "float32"}
    assert manifest["members"] == ["mean.npy", "logvar.npy", "mean_flip.npy", "logvar_flip.npy", "cls"]
    # against the autoencoder run on the images here, one at a time (no batch shares a computation with another)
    def data(**section):
        return build_data(validate({"run_dir": str(tmp_path), "data": section}).data, 0)

    images, labels = data(source="npz", path=str(image_npz)).get(range(64))
    stored = data(source="shards", path=str(tmp_path / "latents"))
    x, y = stored.get(range(64))
    assert x.shape == (64, 8, 4, 4) and torch.equal(y, labels)
    for n in (0, 13, 63):
        q, f = autoencoder.encode(images[n:n + 1]), autoencoder.encode(images[n:n + 1].flip(-1))
        expected = torch.cat([q.mean, q.logvar, f.mean, f.logvar], dim=1)[0]
        torch.testing.assert_close(x[n], expected, rtol=1e-5, atol=1e-6)
    assert encode(tmp_path, image_npz, vae) == 2  # never over a data set already written


def test_islands_encode_on_two_ranks_writes_the_bytes_one_process_writes(tmp_path, image_npz):
    vae = saved_vae(tmp_path / "vae")
    config = write_config(tmp_path / "c.yaml", {"run_dir": str(tmp_path / "run"),
                                                "data": {"source": "npz", "path": str(image_npz), "flip": True}})
    # one process as each rank runs (one thread: a convolution's float sums follow the thread count)
    args = ["--autoencoder", str(vae), "--shard-size", "10", "--batch-size", "4", "--quiet"]
    for out, nproc in (("one", 1), ("two", 2)):
        ranks = run_ranks(["encode", config, str(tmp_path / out), *args], nproc=nproc, timeout=180)
        assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    one, two = (sorted(p.name for p in (tmp_path / out).iterdir()) for out in ("one", "two"))
    assert one == two and len(one) == 22  # 7 tars, 7 indices, 7 member sha256 files, the manifest
    for name in one:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def stored_run(run_dir, latents, vae, **train_keys):
    """test_latents' tiny latent run, reading the precomputed latents instead of the images."""
    return validate(tiny_unet_config(run_dir, latents, data={"source": "shards", "path": str(latents),
                                                               "autoencoder": str(vae)},
                                     train=train_keys, model={"attention_resolutions": [2]},
                                     sample={"num": 8, "steps": 2, "solver": "euler"}, eval={"every": 0}))


def on_the_fly_run(run_dir, image_npz, vae, **train_keys):
    return validate(tiny_unet_config(run_dir, image_npz, data={"autoencoder": str(vae)}, train=train_keys,
                                     model={"attention_resolutions": [2]},
                                     sample={"num": 8, "steps": 2, "solver": "euler"}, eval={"every": 0}))


def test_a_run_on_stored_latents_trains_as_the_on_the_fly_run_and_resumes_bit_identically(tmp_path, image_npz,
                                                                                           capsys):
    vae = saved_vae(tmp_path / "vae")
    assert encode(tmp_path, image_npz, vae) == 0
    latents = tmp_path / "latents"
    # the batches the objective sees: the same latents (the same posterior, image or flip, and noise), to the rounding
    # of a convolution whose summation order depends on its batch and thread count (islands encode runs batches of
    # 64, the loop batches of 16; bit for bit at 2 threads, not at 1); a wrong flip or noise differs by O(1)
    runs = {"fly": on_the_fly_run(tmp_path / "f", image_npz, vae), "stored": stored_run(tmp_path / "s", latents, vae)}
    seen = {}
    for name, cfg in runs.items():
        space = open_data_space(cfg, tmp_path / name)
        batch = next(training_batches(build_data(cfg.data, cfg.seed), space, 16, cfg.seed, "cpu", cfg.data.flip,
                                      start=16))
        assert batch.noise.shape == (16, 2, 4, 4) and batch.flip is None  # drawn at the latents' shape; flips applied
        seen[name] = batch.x
    assert seen["stored"].shape == (16, 2, 4, 4)
    torch.testing.assert_close(seen["stored"], seen["fly"], rtol=1e-5, atol=1e-5)
    # and so the runs, to float rounding: the encoder ran on other batches of images (and Adam's first steps, which
    # scale by the gradient's size, make a rounding difference in a near-zero gradient a step of lr: SGD here)
    fly = train(on_the_fly_run(tmp_path / "fly", image_npz, vae, optimizer="sgd"), progress=False)
    sgd = train(stored_run(tmp_path / "sgd", latents, vae, optimizer="sgd"), progress=False)
    straight = train(stored_run(tmp_path / "straight", latents, vae), progress=False)
    train(stored_run(tmp_path / "resumed", latents, vae, images=48), progress=False)
    resumed = train(stored_run(tmp_path / "resumed", latents, vae), progress=False)
    a, b = (load_weights(latest_checkpoint(run) / "model.safetensors") for run in (straight, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)  # resumed: bit for bit
    c, d = (load_weights(latest_checkpoint(run) / "model.safetensors") for run in (sgd, fly))
    for k in c:
        torch.testing.assert_close(c[k], d[k], rtol=1e-4, atol=1e-5)
    # samples are decoded images
    assert main(["sample", str(straight), "--num", "4", "--out", str(tmp_path / "out"), "--quiet"]) == 0
    assert np.load(tmp_path / "out" / "samples.npz")["x"].shape == (4, 1, 8, 8)
    # metrics compare decoded samples with the images the stored latents decode to (the posterior means): an FD of
    # those images against themselves is 0
    assert main(["eval", str(straight), "--num", "8", "--metrics", "fd", "--features", "pixels"]) == 0
    space = open_data_space(runs["stored"], tmp_path / "s")
    reference = space.reference(build_data(runs["stored"].data, 0))
    autoencoder = load_autoencoder(vae)
    images, _ = reference.get([5, 6])
    expected = autoencoder.decode(autoencoder.encode(build_data(runs["fly"].data, 0).get([5, 6])[0]).mean)
    assert images.shape == (2, 1, 8, 8)
    torch.testing.assert_close(images, expected.clamp(-1, 1), rtol=1e-4, atol=1e-5)

    # another autoencoder than the one the latents were encoded with: refused in one line
    other = saved_vae(tmp_path / "other", seed=1)
    capsys.readouterr()
    config = write_config(tmp_path / "other.yaml", tiny_unet_config(tmp_path / "o", latents, data={
        "source": "shards", "path": str(latents), "autoencoder": str(other)}))
    assert main(["train", config, "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not the autoencoder the latents" in err[0]


def test_the_dit_xl2_latents_config_plans_at_paper_size_and_trains_a_step_at_tiny_width(tmp_path, image_npz):
    """configs/dit_xl2_latents.yaml on tiny latent shards that islands encode wrote (2x4x4 latents of 1x8x8 images):
    the plan prices DiT-XL/2 on the latents' shape, not the stored posteriors' (8x4x4); one step at tiny width runs
    and its samples are decoded images."""
    vae = saved_vae(tmp_path / "vae")
    assert encode(tmp_path, image_npz, vae) == 0
    paths = [f"data.path={tmp_path / 'latents'}", f"data.autoencoder={vae}", "data.workers=0"]
    out = tmp_path / "plan"
    assert main(["plan", "configs/dit_xl2_latents.yaml", *paths, "model.num_classes=4", "--network", "infiniband",
                 "--out", str(out)]) == 0
    plan = json.loads(out.with_suffix(".json").read_text())
    assert plan["params"] == pytest.approx(675e6, rel=0.01)  # DiT-XL/2
    cfg = load_config("configs/dit_xl2_latents.yaml", [*paths, "model.num_classes=4"])
    with torch.device("meta"):  # its patch embedding and output layer are those of 2 channels
        net = build_network(network_spec(cfg.model, (2, 4, 4), 4))
        assert plan["params"] == sum(p.numel() for p in net.parameters())
    tiny = [*paths, f"run_dir={tmp_path / 'run'}", "model.num_classes=4", "model.hidden_size=32", "model.depth=1",
            "model.num_heads=2", "train.images=8", "train.batch_size=8", "train.precision=fp32",
            "train.activation_checkpointing=false", "train.checkpoint_every=8", "train.sample_every=8",
            "train.log_every=8", "sample.num=4", "sample.steps=2", "sample.solver=euler", "eval.every=0"]
    assert main(["train", "configs/dit_xl2_latents.yaml", *tiny, "--quiet"]) == 0
    assert main(["sample", str(tmp_path / "run"), "--num", "4", "--out", str(tmp_path / "out"), "--quiet"]) == 0
    assert np.load(tmp_path / "out" / "samples.npz")["x"].shape == (4, 1, 8, 8)
