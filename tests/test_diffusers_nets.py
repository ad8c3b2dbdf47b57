"""diffusers networks inside Islands (`model.arch: diffusers`, islands/nets/diffusers_net.py): each adapter computes
what the diffusers model computes when called by hand with its own timestep scale and conditioning, trains and
resumes bit-identically, over 2 ranks as in 1 process, and starts from a pretrained folder read as untrusted. Experts
of every class join ensembles in tests/test_export_ddm.py (`ensemble_of`), sampled there under every routing."""

import json
from pathlib import Path

import diffusers
import pytest
import torch
import yaml
from conftest import emoji_or_skip, tiny_unet_config, write_config
from safetensors.torch import save_file
from test_autoencoder import folder_digest

from islands.cli import main
from islands.conditions import network_spec
from islands.config import DIFFUSERS_CLASSES, validate
from islands.data import build_data
from islands.data.captions import caption_table
from islands.nets import build_network
from islands.nets.condition import pack_text
from islands.nets.diffusers_net import ADAPTERS, load_pretrained
from islands.nets.text_folder import bundled_text_encoder
from islands.parallel.activation_checkpointing import checkpoint_blocks
from islands.rundir import latest_checkpoint, load_weights
from islands.trainer import train

# tiny constructor arguments of each class (the data's channels and size, and the text widths, are filled in)
CONFIGS = {
    "UNet2DModel": {"block_out_channels": [8, 16], "down_block_types": ["DownBlock2D", "AttnDownBlock2D"],
                    "up_block_types": ["AttnUpBlock2D", "UpBlock2D"], "layers_per_block": 1, "norm_num_groups": 4,
                    "attention_head_dim": 4},
    "DiTTransformer2DModel": {"num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 2, "norm_num_groups": 4,
                              "out_channels": 2},  # a learned sigma, sliced off
    "UNet2DConditionModel": {"block_out_channels": [8, 16], "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
                             "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"], "layers_per_block": 1,
                             "norm_num_groups": 4, "attention_head_dim": 4},
    "SD3Transformer2DModel": {"num_layers": 2, "attention_head_dim": 8, "num_attention_heads": 2,
                              "caption_projection_dim": 16, "pos_embed_max_size": 8},
    "FluxTransformer2DModel": {"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 8,
                               "num_attention_heads": 2, "axes_dims_rope": [2, 2, 4]},
}
CLASS_LABELS = ("UNet2DModel", "DiTTransformer2DModel")
TEXT = {"text_width": 12, "text_pooled_width": 10, "text_tokens": 5}


def model_config(class_name: str, num_classes: int = 0, **keys) -> dict:
    text = TEXT if class_name not in CLASS_LABELS else {}
    return {"arch": "diffusers", "class_name": class_name, "config": CONFIGS[class_name], "num_classes": num_classes,
            **({"condition": "text", **text} if text else {}), **keys}


def randomised(net: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random: zero-initialised output layers would make every comparison trivially equal."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return net


def captions(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    states, pooled = torch.randn(n, 5, 12, generator=gen), torch.randn(n, 10, generator=gen)
    return pack_text(states, torch.arange(5)[None] < torch.tensor([[2], [5], [3]])[:n], pooled)


def by_hand(net, x, t, cond, num_classes: int) -> torch.Tensor:
    """The diffusers model itself, built from the adapter's arguments and holding its weights, called as diffusers'
    pipelines call it: each class's timestep scale, labels, caption, packing and output as its own code wants them."""
    name = net.class_name
    model = getattr(diffusers, name)(**net.diffusers_config)
    model.load_state_dict(net.diffusers_state_dict())
    model.eval()
    if name in CLASS_LABELS:
        labels = cond if num_classes else torch.full((len(x),), net.diffusers_config.get("num_embeds_ada_norm", 0))
        labels = labels if num_classes or name == "DiTTransformer2DModel" else None
        return model(x, 1000 * t, class_labels=labels).sample[:, :x.shape[1]]
    states, mask, pooled = cond[:, 1:, :12], cond[:, 1:, 12] > 0.5, cond[:, 0, :10]
    if name == "UNet2DConditionModel":
        return model(x, 1000 * t, encoder_hidden_states=states, encoder_attention_mask=mask).sample
    if name == "SD3Transformer2DModel":
        return model(x, encoder_hidden_states=states, pooled_projections=pooled, timestep=1000 * t).sample
    b, c, h, w = x.shape  # Flux: FluxPipeline's _pack_latents and _prepare_latent_image_ids
    packed = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, 4 * c)
    img_ids = torch.zeros(h // 2, w // 2, 3)
    img_ids[..., 1] += torch.arange(h // 2)[:, None]
    img_ids[..., 2] += torch.arange(w // 2)[None, :]
    out = model(packed, encoder_hidden_states=states, pooled_projections=pooled, timestep=t,
                img_ids=img_ids.reshape(-1, 3), txt_ids=torch.zeros(states.shape[1], 3)).sample
    return out.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


CASES = [("UNet2DModel", 0), ("UNet2DModel", 4), ("DiTTransformer2DModel", 0), ("DiTTransformer2DModel", 4),
         ("UNet2DConditionModel", 0), ("SD3Transformer2DModel", 0), ("FluxTransformer2DModel", 0)]


@pytest.mark.parametrize(("class_name", "num_classes"), CASES)
def test_the_adapter_computes_what_the_diffusers_model_computes_called_by_hand(class_name, num_classes):
    cfg = validate({"run_dir": ".", "model": model_config(class_name, num_classes)})
    net = randomised(build_network(network_spec(cfg.model, (2, 8, 8), num_classes))).eval()
    x, t = torch.randn(3, 2, 8, 8), torch.tensor([0.02, 0.5, 0.97])
    cond = (torch.tensor([0, 3, 4]) if num_classes else None) if class_name in CLASS_LABELS else captions(3)
    with torch.no_grad():
        torch.testing.assert_close(net(x, t, cond), by_hand(net, x, t, cond, num_classes), rtol=1e-5, atol=1e-5)
    assert len(net.blocks) == {"UNet2DModel": 5, "UNet2DConditionModel": 5}.get(class_name, 2)


def test_every_class_the_config_names_has_an_adapter():
    assert set(DIFFUSERS_CLASSES) == set(ADAPTERS)


def test_dits_own_label_dropout_never_fires():
    """DiT drops 10% of its labels from torch's global generator in train mode; Islands' dropout, drawn from each
    example's stream, must be the only one: train mode gives eval mode's output, whatever the global generator."""
    cfg = validate({"run_dir": ".", "model": model_config("DiTTransformer2DModel", 4)})
    net = randomised(build_network(network_spec(cfg.model, (2, 8, 8), 4)))
    x, t, y = torch.randn(64, 2, 8, 8), torch.rand(64), torch.arange(64) % 4
    with torch.no_grad():
        expected = net.eval()(x, t, y)
        net.train()
        for seed in range(3):
            torch.manual_seed(seed)
            assert torch.equal(net(x, t, y), expected)


@pytest.fixture
def diffusers_run(tmp_path, image_npz):
    def config(class_name: str, run_dir: str, **train_keys) -> dict:
        train_keys = {"images": 32, "checkpoint_every": 16, "sample_every": 0, "warmup_images": 16, **train_keys}
        cfg = tiny_unet_config(tmp_path / run_dir, image_npz, train=train_keys)
        cfg["model"] = model_config(class_name, 4)
        if class_name == "UNet2DModel":  # DDPM's own setting: its steps, epsilon
            cfg["flow"] = {"path": "vp_discrete", "prediction": "epsilon"}
        return cfg
    return config


@pytest.mark.parametrize("class_name", CLASS_LABELS)
def test_a_diffusers_network_trains_and_resumes_bit_identically(diffusers_run, class_name, capsys):
    torch.set_num_threads(1)
    straight = train(validate(diffusers_run(class_name, "straight")), progress=False)
    train(validate(diffusers_run(class_name, "resumed", images=16)), progress=False)
    resumed = train(validate(diffusers_run(class_name, "resumed")), progress=False)
    for name in ("model.safetensors", "ema.safetensors"):
        a, b = (load_weights(latest_checkpoint(run) / name) for run in (straight, resumed))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert main(["sample", str(straight), "--num", "4", "--out", str(straight / "drawn"), "--quiet"]) == 0


@pytest.mark.parametrize("class_name", CLASS_LABELS)
def test_activation_checkpointing_gives_the_same_gradients(class_name):
    cfg = validate({"run_dir": ".", "model": model_config(class_name, 4)})
    x, t, y = torch.randn(4, 2, 8, 8), torch.rand(4), torch.tensor([0, 1, 2, 4])

    def gradients(checkpointed: bool) -> dict:
        torch.manual_seed(0)
        net = randomised(build_network(network_spec(cfg.model, (2, 8, 8), 4)))
        if checkpointed:
            assert checkpoint_blocks(net) == len(net.blocks) == {"UNet2DModel": 5}.get(class_name, 2)
        net(x, t, y).square().mean().backward()
        return {n: p.grad for n, p in net.named_parameters()}

    plain, recomputed = gradients(False), gradients(True)
    assert plain.keys() == recomputed.keys()
    assert all(torch.equal(plain[n], recomputed[n]) for n in plain)


def saved_folder(folder, class_name="UNet2DModel", seed=1):
    """A diffusers folder as save_pretrained writes it, of random weights."""
    torch.manual_seed(seed)
    model = getattr(diffusers, class_name)(**{**CONFIGS[class_name], "in_channels": 1, "out_channels": 1,
                                              "sample_size": 8, "num_class_embeds": 5})
    model.save_pretrained(folder)
    return model


def test_a_run_starts_from_a_pretrained_folder(tmp_path, image_npz, capsys):
    model = saved_folder(tmp_path / "pretrained")
    cfg = tiny_unet_config(tmp_path / "run", image_npz, train={"images": 16, "optimizer": "sgd", "lr": 1e-9,
                                                               "warmup_images": 0, "ema_halflife_images": 0})
    cfg["model"] = {"arch": "diffusers", "pretrained": str(tmp_path / "pretrained"), "num_classes": 4}
    resolved = validate(cfg).model
    assert resolved.class_name == "UNet2DModel" and resolved.config["block_out_channels"] == [8, 16]
    net = build_network(network_spec(resolved, (1, 8, 8), 4))
    load_pretrained(net, str(tmp_path / "pretrained"))
    weights = model.state_dict()
    assert net.diffusers_state_dict().keys() == weights.keys()
    assert all(torch.equal(v, weights[k]) for k, v in net.diffusers_state_dict().items())

    assert main(["train", write_config(tmp_path / "run.yaml", cfg), "--quiet"]) == 0
    record = json.loads((tmp_path / "run" / "pretrained.json").read_text())  # what it started from, by hash
    digest = folder_digest(tmp_path / "pretrained", ["config.json", "diffusion_pytorch_model.safetensors"])
    assert record == {"pretrained": str(tmp_path / "pretrained"), "sha256": digest}
    trained = load_weights(latest_checkpoint(tmp_path / "run") / "model.safetensors")
    net.load_state_dict(trained)
    started = net.diffusers_state_dict()  # a step of 1e-9 from the folder's weights
    assert all(torch.allclose(v, weights[k], atol=1e-6) for k, v in started.items())


@pytest.mark.parametrize("damage", ["class", "pickle", "missing", "config", "weights"])
def test_a_pretrained_folder_that_is_not_a_safetensors_denoiser_is_refused_in_one_line(tmp_path, image_npz, capsys,
                                                                                       damage):
    folder = tmp_path / "pretrained"
    model = saved_folder(folder)
    weights = folder / "diffusion_pytorch_model.safetensors"
    config = json.loads((folder / "config.json").read_text())
    if damage == "class":  # an autoencoder is no denoiser, and nothing is imported because the folder names it
        (folder / "config.json").write_text(json.dumps({**config, "_class_name": "AutoencoderKL"}))
    elif damage == "pickle":
        weights.rename(folder / "diffusion_pytorch_model.bin")
    elif damage == "missing":
        weights.unlink()
    elif damage == "weights":  # weights that leave a parameter of the network uninitialised
        save_file({k: v for k, v in model.state_dict().items() if k != "conv_out.bias"}, weights)
    else:  # the run's network and the folder's differ
        (folder / "config.json").write_text(json.dumps({**config, "sample_size": 16}))
    cfg = tiny_unet_config(tmp_path / "run", image_npz)
    cfg["model"] = {"arch": "diffusers", "pretrained": str(folder), "num_classes": 4}
    if damage in ("config", "weights"):  # the config resolved before the folder changed
        cfg["model"] = {**cfg["model"], "class_name": "UNet2DModel", "config": config}
        cfg["model"]["config"] = {k: v for k, v in config.items() if not k.startswith("_")}
    assert main(["train", write_config(tmp_path / "run.yaml", cfg), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    # a config resolved before the folder changed no longer says what the folder says: refused where it is read
    where = "model.config: a pretrained network's config" if damage == "config" else "model.pretrained: diffusers"
    assert len(err.splitlines()) == 1 and where in err, err
    assert {"class": "'AutoencoderKL', not one of", "pickle": "pickled weights only", "missing": "is missing",
            "config": "is its folder's config.json", "weights": "config.json implies 45,129 parameters, more than the "
            "45,128 its weights hold"}[damage] in err


def follows_the_single_process(cfg: dict, tmp_path, *strategy: str) -> None:
    """2 ranks of 4 examples against 1 process of 2 micro-batches of 4: the same gradients, summed in another order
    (a pipeline's 2 micro-batches of 4 each)."""
    from test_parallel import final_weights, launch_ranks, relative_difference

    torch.set_num_threads(1)
    single = final_weights(train(validate(cfg), progress=False))
    cfg = {**cfg, "run_dir": str(tmp_path / "ranks"), "train": {**cfg["train"], "accumulate": 1}}
    ranks = launch_ranks(2, cfg, tmp_path, *strategy)
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    assert relative_difference(single, final_weights(cfg["run_dir"])) < 1e-5


@pytest.mark.parametrize(("class_name", "strategy"), [
    ("UNet2DModel", ["parallel.strategy=ddp"]), ("DiTTransformer2DModel", ["parallel.strategy=ddp"]),
    ("DiTTransformer2DModel", ["parallel.strategy=pipeline", "parallel.microbatches=2"]),
    ("DiTTransformer2DModel", ["parallel.strategy=fsdp"])])
def test_two_ranks_follow_the_single_process(diffusers_run, tmp_path, class_name, strategy):
    """DDP; a pipeline whose second stage gets DiT's labels and the head's conditioning in the carry; FSDP, under
    which the head's conditioning, made of block 0's weights, is computed inside block 0's call."""
    follows_the_single_process(diffusers_run(class_name, "single"), tmp_path, *strategy)


TEXT_CLASSES = ("UNet2DConditionModel", "SD3Transformer2DModel", "FluxTransformer2DModel")


@pytest.mark.parametrize("class_name", TEXT_CLASSES)
def test_a_dropped_caption_is_the_networks_none(class_name):
    """Dropped, a caption is the learned null (for SD3 and Flux, which read every row, the very same input as none);
    given, it changes the output."""
    cfg = validate({"run_dir": ".", "model": model_config(class_name)})
    net = randomised(build_network(network_spec(cfg.model, (2, 8, 8), 0))).eval()
    x, t, c = torch.randn(3, 2, 8, 8), torch.rand(3), captions(3)
    with torch.no_grad():
        none, dropped = net(x, t, None), net(x, t, net.condition.drop(c, torch.tensor([True, False, True])))
    torch.testing.assert_close(dropped[[0, 2]], none[[0, 2]], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(dropped[1], none[1], atol=1e-3)


def emoji_diffusers_run(run_dir, class_name: str, **train_keys) -> dict:
    from test_text_conditioning import emoji_run

    cfg = emoji_run(run_dir, **{"images": 32, "checkpoint_every": 16, "sample_every": 0, "batch_size": 8,
                                "accumulate": 2, **train_keys})
    cfg["model"] = {"arch": "diffusers", "class_name": class_name, "config": CONFIGS[class_name], "text_tokens": 16}
    return cfg


@pytest.mark.parametrize("class_name", TEXT_CLASSES)
def test_a_text_conditioned_diffusers_network_resumes_bit_identically_and_follows_ddp(tmp_path, class_name):
    """On the emoji's captions (their MiniLM token states and pooled vectors): resumed half way, the run that never
    stopped; on 2 DDP ranks, the single process; sampled with prompts under guidance."""
    emoji_or_skip()
    torch.set_num_threads(1)
    # captions encoded (and cached) before any run: a run that encoded them itself differed from its resumption by
    # 1e-8 (Islands' own U-Net alike), which this test is not about
    cfg = validate(emoji_diffusers_run(tmp_path / "straight", class_name))
    caption_table(build_data(cfg.data, cfg.seed), bundled_text_encoder(), cfg.model.text_tokens)
    straight = train(cfg, progress=False)
    assert validate(emoji_diffusers_run(".", class_name)).model.condition == "text"
    train(validate(emoji_diffusers_run(tmp_path / "resumed", class_name, images=16)), progress=False)
    resumed = train(validate(emoji_diffusers_run(tmp_path / "resumed", class_name)), progress=False)
    for name in ("model.safetensors", "ema.safetensors"):
        a, b = (load_weights(latest_checkpoint(run) / name) for run in (straight, resumed))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    out = tmp_path / "drawn"
    assert main(["sample", str(straight), "--num", "2", "--out", str(out), "--quiet", "--prompt", "red apple"]) == 0
    follows_the_single_process(emoji_diffusers_run(tmp_path / "single", class_name), tmp_path,
                               "parallel.strategy=ddp")


def ensemble_of(path, cfg: dict, classes: tuple[str, ...]) -> dict:
    """`islands ddm` of one expert per class: experts 1, 2, ... trained first on their own, each as its class, expert 0
    by `islands ddm` as the config's (islands need not agree on their networks); -> the manifest."""
    cfg["ddm"] = {"k": len(classes), "partition": {"method": "kmeans", "pca_dim": 8, "fine": 8},
                  "router": {"hidden_size": 16, "depth": 1, "num_heads": 2, "patch_size": 2, "batch_size": 8,
                             "images": 16}}
    cfg["model"] = {**cfg["model"], "class_name": classes[0], "config": CONFIGS[classes[0]]}
    config = write_config(path, cfg)
    assert main(["partition", config, "--quiet"]) == 0
    for i, name in enumerate(classes[1:], start=1):
        assert main(["train", config, f"expert={i}", f"model.class_name={name}",
                     f"model.config={json.dumps(CONFIGS[name])}", "--quiet"]) == 0
    assert main(["ddm", config, "--quiet"]) == 0
    root = Path(cfg["run_dir"])
    for i, name in enumerate(classes):
        expert = validate(yaml.safe_load((root / "experts" / str(i) / "config.yaml").read_text()))
        assert (expert.model.arch, expert.model.class_name) == ("diffusers", name)
    return json.loads((root / "ensemble.json").read_text())


@pytest.mark.parametrize(("change", "message"), [
    ({"config": {**CONFIGS["UNet2DModel"], "blocks": 3}}, "model: config.blocks: not an argument of UNet2DModel"),
    ({"config": {**CONFIGS["UNet2DModel"], "in_channels": 3}},
     "model: config.in_channels: 3, but the data's channels makes it 1"),
    ({"config": {**CONFIGS["UNet2DModel"], "num_class_embeds": 4}},
     "model: config.num_class_embeds: 4, but 4 classes and the null class makes it 5"),
    ({"condition": "text", "num_classes": 0}, "model.condition: 'text' for a UNet2DModel"),
    ({"flow": {"path": "vp_discrete", "prediction": "epsilon", "train_steps": 500}},
     "flow.train_steps: a diffusers network takes DDPM's timesteps 0-999"),
    ({"class_name": None}, "model.class_name: give the diffusers class"),
])
def test_a_diffusers_config_that_does_not_fit_is_refused_by_key(tmp_path, image_npz, capsys, change, message):
    cfg = tiny_unet_config(tmp_path / "run", image_npz)
    cfg["model"] = model_config("UNet2DModel", 4)
    cfg["flow"] = change.pop("flow", {})
    cfg["model"].update(change)
    assert main(["train", write_config(tmp_path / "run.yaml", cfg), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()
