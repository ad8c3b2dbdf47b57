"""Text-conditioned networks (`model.condition: text`): a caption's packed embedding, its dropout to a learned null,
cross-attention that reads real tokens only, training on the emoji's captions that resumes bit-identically, and
`islands sample --prompt`."""

import json

import numpy as np
import pytest
import torch
import yaml
from conftest import emoji_or_skip, write_config

from islands.cli import main
from islands.conditions import SampleRequest, network_spec
from islands.config import validate
from islands.nets import build_network
from islands.nets.condition import TextCondition, TextWidths, pack_text
from islands.rundir import latest_checkpoint, load_weights
from islands.trainer import train


def randomised(net: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random: the zero-initialised branches (adaLN-Zero, cross-attention's output) would hide what
    the test looks for."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return net.eval()


def caption(tokens: int, real: int, seed: int = 0, width: int = 12) -> torch.Tensor:
    """One caption of `real` tokens, padded to `tokens`, packed; its pad states random (what an encoder gives pads)."""
    gen = torch.Generator().manual_seed(seed)
    states, pooled = torch.randn(1, tokens, width, generator=gen), torch.randn(1, width, generator=gen)
    return pack_text(states, torch.arange(tokens)[None] < real, pooled)


NETWORKS = {"dit": {"arch": "dit", "hidden_size": 16, "depth": 2, "num_heads": 2},
            "unet": {"arch": "unet", "channels": 8, "channel_mult": [1, 2], "num_res_blocks": 1,
                     "attention_resolutions": [4], "num_heads": 2}}  # the 8x8 level without attention


@pytest.mark.parametrize("arch", NETWORKS)
def test_a_dropped_caption_is_the_learned_null_and_padding_is_never_read(arch):
    cfg = validate({"run_dir": ".", "model": {**NETWORKS[arch], "condition": "text", "text_width": 12,
                                              "text_pooled_width": 12, "text_tokens": 6}})
    net = randomised(build_network(network_spec(cfg.model, (3, 8, 8), 0)))
    x, t = torch.randn(2, 3, 8, 8), torch.rand(2)
    c = torch.cat([caption(6, 3, seed=1), caption(6, 6, seed=2)])
    # dropping a caption gives the network's own "none", whatever the caption was
    dropped = net.condition.drop(c, torch.tensor([True, False]))
    none = net(x, t, None)
    out = net(x, t, dropped)
    torch.testing.assert_close(out[0], none[0], rtol=1e-5, atol=1e-5)  # its masked pads aside, the same context
    assert not torch.allclose(out[1], none[1])
    # the first caption's three real tokens, padded to 6 or to 4 (other pad states): the same output
    short = caption(6, 3, seed=1)
    repadded = pack_text(torch.cat([short[:, 1:4, :12], torch.randn(1, 1, 12)], 1),
                         torch.tensor([[True, True, True, False]]), short[:, 0, :12])
    torch.testing.assert_close(net(x[:1], t[:1], short), net(x[:1], t[:1], repadded), rtol=1e-5, atol=1e-6)
    # and the tokens are read: another caption with the same pooled vector changes the output
    other = short.clone()
    other[:, 1:4, :12] += 1.0
    assert not torch.allclose(net(x[:1], t[:1], short), net(x[:1], t[:1], other))


def test_pack_text_keeps_each_part_where_the_condition_module_reads_it():
    widths = TextWidths(width=4, pooled_width=6, tokens=3)
    module = TextCondition(widths, hidden_size=8)
    states, pooled = torch.randn(2, 3, 4), torch.randn(2, 6)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    packed = pack_text(states, mask, pooled)
    assert packed.shape == (2, 4, 7) and torch.equal(packed[:, 0, 6], torch.ones(2))
    torch.testing.assert_close(module.embed(packed, 2, "cpu"), module.pooled(pooled))
    tokens, read = module.context(packed, 2, "cpu")
    assert torch.equal(read, mask)
    torch.testing.assert_close(tokens, module.tokens(states))
    assert module.placeholder(5, "cpu").shape == (5, 4, 7)


def emoji_run(run_dir, **train_keys) -> dict:
    return {"run_dir": str(run_dir), "seed": 1,
            "data": {"source": "emoji", "limit": 32, "resolution": 8},
            "model": {"arch": "dit", "hidden_size": 32, "depth": 2, "num_heads": 2, "patch_size": 2,
                      "text_tokens": 16},
            "train": {"images": 96, "batch_size": 16, "lr": 1e-3, "checkpoint_every": 48, "sample_every": 96,
                      "log_every": 16, "label_dropout": 0.2, "ema_halflife_images": 32, **train_keys},
            "sample": {"num": 4, "steps": 2, "solver": "euler", "guidance": 2.0},
            "eval": {"every": 0}}


def test_a_run_on_captions_is_text_conditioned_resumes_bit_identically_and_samples_prompts(tmp_path, capsys):
    emoji_or_skip()
    straight = train(validate(emoji_run(tmp_path / "straight")), progress=False)
    cfg = validate(emoji_run(tmp_path / "resumed", images=48))
    assert (cfg.model.condition, cfg.model.text_width) == ("text", 384)  # the emoji have captions: no other key
    train(cfg, progress=False)
    resumed = train(validate(emoji_run(tmp_path / "resumed")), progress=False)
    for name in ("model.safetensors", "ema.safetensors"):  # caption dropout, too, drawn from each example's stream
        a, b = (load_weights(latest_checkpoint(run) / name) for run in (straight, resumed))
        assert all(torch.equal(a[k], b[k]) for k in a), name

    # islands sample --prompt: sample i for prompt i mod 2, from noise i; the condition reaches the network
    apple, face = "red apple, food and drink, food fruit", "grinning face, smileys and emotion, face smiling"
    for out, second in (("aa", apple), ("af", face)):
        args = ["sample", str(straight), "--num", "2", "--out", str(tmp_path / out), "--quiet"]
        assert main([*args, "--prompt", apple, "--prompt", second]) == 0
    same, other = (np.load(tmp_path / out / "samples.npz")["x"] for out in ("aa", "af"))
    assert np.array_equal(same[0], other[0]) and not np.allclose(same[1], other[1])
    assert (tmp_path / "af" / "prompts.txt").read_text() == f"{apple}\n{face}\n"
    assert np.load(tmp_path / "af" / "samples.npz")["prompt"].tolist() == [apple, face]  # no pickle needed
    capsys.readouterr()
    assert main(["sample", str(straight), "--num", "2", "--out", str(tmp_path / "c"), "--class", "1",
                 "--prompt", apple, "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == f"islands: config error: --class: {straight} is not conditioned on a " \
                                              "class (model.condition: text)"  # its kind reads --prompt only


@pytest.mark.parametrize("change,message", [
    ({"model": {"arch": "mlp", "condition": "text"}}, "model.condition: text is read by dit, unet, router networks, "
                                                      "not 'mlp'"),
    ({"model": {"condition": "text", "num_classes": 4}}, "model.condition: 'text' with model.num_classes=4"),
])
def test_a_text_condition_a_network_cannot_take_is_refused_by_key(tmp_path, capsys, change, message):
    raw = {"run_dir": str(tmp_path / "r"), "data": {"source": "emoji", "limit": 8, "resolution": 8},
           "model": {"arch": "dit", "hidden_size": 16, "depth": 1, "num_heads": 2}}
    for section, values in change.items():
        raw[section] = values if values.get("arch") == "mlp" else {**raw[section], **values}
    assert main(["train", write_config(tmp_path / "c.yaml", raw), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_text_on_data_without_captions_and_a_prompt_to_a_class_run_are_refused(tmp_path, image_npz, capsys):
    from conftest import tiny_unet_config

    raw = tiny_unet_config(tmp_path / "r", image_npz, model={"arch": "dit", "hidden_size": 16, "depth": 1,
                                                             "num_heads": 2, "num_classes": 0, "condition": "text"})
    raw["model"] = {k: v for k, v in raw["model"].items() if k in ("arch", "hidden_size", "depth", "num_heads",
                                                                   "num_classes", "condition")}
    assert main(["train", write_config(tmp_path / "c.yaml", raw), "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == "islands: model.condition: text, but the data (npz) has no captions"
    run = tiny_unet_config(tmp_path / "class", image_npz, train={"images": 16})
    assert main(["train", write_config(tmp_path / "k.yaml", run), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["sample", str(tmp_path / "class"), "--num", "2", "--out", str(tmp_path / "o"), "--prompt", "a",
                 "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("islands: config error: --prompt:") and "is not conditioned on text" in err


def test_caption_embeddings_stored_by_islands_encode_train_without_the_text_encoder(tmp_path, capsys, monkeypatch):
    emoji_or_skip()
    config = write_config(tmp_path / "c.yaml", emoji_run(tmp_path / "run"))
    assert main(["encode", config, str(tmp_path / "sh"), "--text-encoder", "minilm", "--text-tokens", "16",
                 "--shard-size", "10", "--order", "given", "--quiet"]) == 0
    # what islands encode stored is what a run on the emoji encodes when it starts, caption by caption
    from islands.data import build_data
    from islands.data.captions import encode_captions
    from islands.nets.text_folder import bundled_text_encoder

    stored = build_data(validate(emoji_run(tmp_path / "r")).data, 1)
    shards = build_data(validate({**emoji_run(tmp_path / "r"), "data": {"source": "shards",
                                                                         "path": str(tmp_path / "sh")}}).data, 1)
    fresh = encode_captions(bundled_text_encoder(), stored.captions(range(32)), 16)
    stored_embeddings = shards.read(range(32), ("caption_embedding",))["caption_embedding"]
    torch.testing.assert_close(stored_embeddings, fresh, rtol=1e-5, atol=1e-5)
    # a run on the shards is text-conditioned by them and never opens the text encoder
    monkeypatch.setattr("islands.data.captions.open_text_encoder", lambda *a, **k: pytest.fail("encoder opened"))
    run = {**emoji_run(tmp_path / "on-shards", images=16), "data": {"source": "shards", "path": str(tmp_path / "sh")}}
    assert main(["train", write_config(tmp_path / "s.yaml", run), "--quiet"]) == 0
    assert (tmp_path / "on-shards" / "text_encoder.json").exists()
    # embeddings of another token count than the network reads: refused in one line
    run["model"] = {**run["model"], "text_tokens": 8}
    run["run_dir"] = str(tmp_path / "other")
    capsys.readouterr()
    assert main(["train", write_config(tmp_path / "o.yaml", run), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds caption embeddings of 16 tokens" in err[0]


@pytest.mark.parametrize("routing", ["ancestral", "full", "topk:1"])
def test_an_ensemble_of_text_conditioned_experts_samples_prompts_under_every_policy(text_ensemble, tmp_path, routing):
    root, manifest = text_ensemble
    assert manifest["condition_router"]["clusters"] == 2  # ancestral's p(cluster | text), verified at every open
    calibration = json.loads((root / "condition_router" / "condition_router.json").read_text())["calibration"]
    assert calibration["held_out"] == 7 and len(calibration["shares_predicted"]) == 2
    from islands.ddm.sampling import open_sampler

    assert open_sampler(root, routing="ancestral").assignment.keywords["condition_prior"] is not None
    assert manifest["text_encoder_sha256"] == json.loads((root / "experts" / "0" / "text_encoder.json").read_text())[
        "sha256"]
    apple, face = "red apple, food and drink, food fruit", "grinning face, smileys and emotion, face smiling"
    for out, second in (("aa", apple), ("af", face)):
        assert main(["sample", str(root), "--num", "2", "--out", str(tmp_path / out), "--routing", routing,
                     "--prompt", apple, "--prompt", second, "--quiet"]) == 0
    same, other = (np.load(tmp_path / out / "samples.npz")["x"] for out in ("aa", "af"))
    # sample 0 is the same (to the rounding of the expert batches it shares with sample 1), sample 1 follows its prompt
    np.testing.assert_allclose(same[0], other[0], rtol=0, atol=1e-5)
    assert not np.allclose(same[1], other[1])


def test_the_router_of_text_conditioned_experts_reads_the_caption(text_ensemble):
    """p(cluster | x_t, t, caption): the ensemble's router is text-conditioned, and its pooled caption joins t in
    adaLN (random weights: a router trained two steps has barely moved its zero-initialised modulation), so two
    captions route the same x_t apart, and no caption (guidance's unconditional branch) routes too."""
    from islands.config import load_config

    root, manifest = text_ensemble
    cfg = load_config(root / "router" / "config.yaml")
    assert cfg.model.condition == "text"
    assert manifest["router"]["text_encoder_sha256"] == manifest["text_encoder_sha256"]
    router = randomised(build_network(network_spec(cfg.model, (3, 8, 8), 0)))
    assert not hasattr(router.condition, "tokens")  # the pooled vector only: no parameter it never uses
    x, t = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([0.3])
    apple, face = caption(16, 5, seed=1, width=384), caption(16, 5, seed=2, width=384)
    assert not torch.allclose(router(x, t, apple), router(x, t, face))
    assert router(x, t, None).shape == router(x, t, apple).shape == (1, 2)


def test_a_text_ensemble_partitions_its_captions_unless_told_and_its_config_records_it(text_ensemble):
    """The fixture names no partition features: on a text run they resolve to text, the ensemble's resolved config
    says so, and the same config validated again compares equal to it (a rerun is not refused)."""
    from islands.config import load_config, to_dict, trajectory_changes

    root, _ = text_ensemble
    written = yaml.safe_load((root / "config.yaml").read_text())
    assert written["ddm"]["partition"]["features"] == "text"
    assert json.loads((root / "partition" / "partition.json").read_text())["features_name"] == "text+pca8"
    assert trajectory_changes(written, to_dict(load_config(root.parent / "ddm.yaml"))) == []


def test_experts_over_two_ranks_draw_a_prompts_expert_from_the_condition_router(text_ensemble, tmp_path, capsys):
    """`islands sample ENSEMBLE --prompt ... --distributed` on 2 ranks: each prompt's ancestral expert drawn from the
    condition router, as one process draws it, so the samples (and the prompts written beside them) are one
    process's."""
    from conftest import run_ranks

    from islands.ddm.ensemble import ancestral_clusters, load_condition_prior
    from islands.ddm.sampling import open_sampler

    root, manifest = text_ensemble
    apple, face = "red apple, food and drink, food fruit", "grinning face, smileys and emotion, face smiling"
    sampler = open_sampler(root, routing="ancestral")
    labels = sampler.conditions(6, SampleRequest(prompts=tuple([apple, face])))
    # the premise: for these prompts the router and the cluster sizes send some sample to different experts
    by_router = ancestral_clusters(manifest, sampler.cfg.seed, 0, 6, labels,
                                   condition_prior=load_condition_prior(root, manifest))
    assert not torch.equal(by_router, ancestral_clusters(manifest, sampler.cfg.seed, 0, 6, labels))
    args = ["sample", str(root), "--num", "6", "--routing", "ancestral", "--prompt", apple, "--prompt", face, "--quiet"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    capsys.readouterr()
    ranks = run_ranks([*args, "--distributed", "--out", str(tmp_path / "two")])
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-2000:] for r in ranks]
    one, two = (np.load(tmp_path / name / "samples.npz") for name in ("one", "two"))
    assert one["x"].shape == two["x"].shape == (6, 3, 8, 8)
    np.testing.assert_allclose(one["x"], two["x"], rtol=0, atol=1e-5)
    assert two["prompt"].tolist() == [apple, face] * 3 and "y" not in two
    assert (tmp_path / "two" / "prompts.txt").read_text() == (tmp_path / "one" / "prompts.txt").read_text()
    assert "2 ranks:" in ranks[0].stdout


def test_the_condition_router_learns_each_captions_cluster_shares():
    """Three captions, each seen 40 times, split over 2 clusters 32:8, 0:40 and 20:20: the maximum-likelihood
    p(cluster | caption) is that hand-built table, and the held-out calibration is reported."""
    from islands.ddm.condition_router import fit_condition_router

    gen = torch.Generator().manual_seed(0)
    captions = torch.randn(3, 16, generator=gen)
    table = torch.tensor([[32, 8], [0, 40], [20, 20]])
    pooled = captions.repeat_interleave(40, dim=0)
    clusters = torch.cat([torch.tensor([0] * a + [1] * b) for a, b in table.tolist()])
    router, report = fit_condition_router(pooled, clusters, 2, seed=0, held_out=0.0, steps=800)
    expected = table.double() / 40
    torch.testing.assert_close(router(captions).softmax(1).double(), expected, rtol=0, atol=0.03)
    _, held = fit_condition_router(pooled, clusters, 2, seed=0, held_out=0.25, steps=800)
    assert held["held_out"] == 30 and held["log_loss"] < held["prior_log_loss"]
    assert sum(held["shares_predicted"]) == pytest.approx(1.0)


def test_ancestral_routing_draws_a_prompts_expert_from_the_condition_router():
    from islands.ddm.ensemble import ancestral_clusters

    manifest = {"prior": [0.5, 0.5], "prior_by_class": [[1.0, 0.0]]}
    prompts = caption(4, 2).expand(200, -1, -1)
    certain = ancestral_clusters(manifest, 0, 0, 200, prompts, condition_prior=lambda labels: torch.tensor(
        [[0.0, 1.0]], dtype=torch.float64).expand(len(labels), -1))
    assert certain.tolist() == [1] * 200  # the router's p(cluster | text), not the class table nor the sizes
    sizes = ancestral_clusters(manifest, 0, 0, 200, prompts)
    assert 60 < int(sizes.sum()) < 140  # no condition router: the sizes


@pytest.fixture(scope="module")
def text_ensemble(tmp_path_factory):
    """K = 2 text-conditioned DiT experts on the first 64 emoji, a router, through `islands ddm`."""
    emoji_or_skip()
    where = tmp_path_factory.mktemp("text-ddm")
    raw = emoji_run(where / "ens")
    raw["data"]["limit"] = 64
    raw["train"] = {**raw["train"], "images": 64, "checkpoint_every": 32, "sample_every": 0}
    raw["eval"] = {"num": 16, "metrics": ["fd"], "features": "pixels"}
    raw["ddm"] = {"k": 2, "partition": {"method": "kmeans", "pca_dim": 8, "fine": 8},
                  "router": {"hidden_size": 16, "depth": 1, "num_heads": 2, "patch_size": 2, "batch_size": 8,
                             "images": 16}}
    assert main(["ddm", write_config(where / "ddm.yaml", raw), "--quiet"]) == 0
    return where / "ens", json.loads((where / "ens" / "ensemble.json").read_text())


def test_a_partition_by_text_clusters_the_captions_pooled_embeddings(tmp_path):
    emoji_or_skip()
    from islands.config import load_config
    from islands.data import build_data
    from islands.data.captions import encode_captions
    from islands.data.sources import _ArraySource
    from islands.ddm.partition import Partition, partition
    from islands.nets.text_folder import bundled_text_encoder

    raw = emoji_run(tmp_path / "ens")
    raw["data"]["limit"] = 64
    raw["ddm"] = {"k": 2, "partition": {"method": "kmeans", "features": "text", "pca_dim": 8, "fine": 8}}
    config = write_config(tmp_path / "c.yaml", raw)
    assert main(["partition", config, "--quiet"]) == 0
    made = Partition.load(tmp_path / "ens" / "partition")
    # by hand: MiniLM's pooled vector of each caption, clustered as any vectors are
    source = build_data(load_config(config).data, 1)
    pooled = encode_captions(bundled_text_encoder(), source.captions(range(64)), 16)[:, 0, :384]
    expected = partition(source, 2, "kmeans", None, 8, 8, True, seed=1, seen=_ArraySource(pooled, None, 0))
    assert made.features_name == "text+pca8" and np.array_equal(made.cluster, expected.cluster)
    pixels = partition(source, 2, "kmeans", None, 8, 8, True, seed=1)
    assert not np.array_equal(made.cluster, pixels.cluster)  # not what the images alone give


def standardised(block: torch.Tensor, dim: int) -> torch.Tensor:
    """By hand: a block centred, onto its `dim` leading principal axes (an SVD; where it is no wider, as it is), and
    scaled to unit total variance."""
    centred = block.double() - block.double().mean(0)
    if block.shape[1] > dim:
        centred = centred @ torch.linalg.svd(centred, full_matrices=False).Vh[:dim].T
    return (centred / centred.pow(2).sum(1).mean().sqrt()).float()


def test_a_partition_on_pixels_and_text_weighs_both_blocks_alike():
    """64 examples whose pixels (48 wide, loud) split them by a and whose captions (4 wide, quiet) by b: clustered
    together, each block standardised, the 4 clusters are the 4 (a, b) pairs, exactly k-means on the concatenation
    standardised by hand; joined raw, the pixels' noise drowns the captions' split."""
    from islands.data.sources import _ArraySource
    from islands.ddm.partition import partition

    gen = torch.Generator().manual_seed(0)
    a, b = torch.arange(64) % 2, torch.arange(64) // 2 % 2
    pixels = torch.randn(64, 48, generator=gen)
    pixels[:, 0] += 3.0 * (2 * a - 1)
    captions = 0.01 * torch.randn(64, 4, generator=gen)
    captions[:, 0] += 0.1 * (2 * b - 1)
    source = _ArraySource(torch.cat([pixels, captions], 1), None, 0)
    both = partition(source, 4, "kmeans", None, 8, 16, True, seed=3, blocks=(48, 4))
    pair = (2 * a + b).numpy()
    assert all(len(set(pair[both.cluster == c])) == 1 for c in range(4))  # each cluster one (a, b) pair
    assert both.features_name == "pixels+pca8+standardised" and both.sizes == [16] * 4
    by_hand = _ArraySource(torch.cat([standardised(pixels, 8), standardised(captions, 8)], 1), None, 0)
    expected = partition(by_hand, 4, "kmeans", None, None, 16, True, seed=3)
    assert np.array_equal(both.cluster, expected.cluster)
    raw = partition(source, 4, "kmeans", None, None, 16, True, seed=3)
    assert not all(len(set(pair[raw.cluster == c])) == 1 for c in range(4))


def test_features_both_clusters_pixels_beside_captions_and_text_runs_default_to_text(tmp_path):
    """`ddm.partition.features: both` through `islands partition`: the emoji's pixels and their captions' pooled
    MiniLM embeddings, each PCA-reduced and standardised by hand, clustered together; a text run that names no
    features resolves them to text (and says so in its resolved config), an explicit choice stays."""
    emoji_or_skip()
    from islands.config import load_config
    from islands.data import build_data
    from islands.data.captions import encode_captions
    from islands.data.sources import _ArraySource
    from islands.ddm.partition import Partition, partition
    from islands.nets.text_folder import bundled_text_encoder

    raw = emoji_run(tmp_path / "ens")
    raw["data"]["limit"] = 64
    raw["ddm"] = {"k": 2, "partition": {"method": "kmeans", "pca_dim": 8, "fine": 8}}
    assert validate(raw).ddm.partition.features == "text"  # unset on a text run: what the captions say
    raw["ddm"]["partition"]["features"] = "pixels"
    assert validate(raw).ddm.partition.features == "pixels"
    raw["ddm"]["partition"]["features"] = "both"
    config = write_config(tmp_path / "c.yaml", raw)
    assert main(["partition", config, "--quiet"]) == 0
    made = Partition.load(tmp_path / "ens" / "partition")
    source = build_data(load_config(config).data, 1)
    pixels = source.get(np.arange(64))[0].flatten(1)
    pooled = encode_captions(bundled_text_encoder(), source.captions(range(64)), 16)[:, 0, :384]
    by_hand = _ArraySource(torch.cat([standardised(pixels, 8), standardised(pooled, 8)], 1), None, 0)
    expected = partition(source, 2, "kmeans", None, None, 8, True, seed=1, seen=by_hand)
    assert np.array_equal(made.cluster, expected.cluster)
    assert made.features_name == "pixels+text+pca8+standardised"


def test_features_of_captions_on_a_run_without_text_are_refused(tmp_path, image_npz, capsys):
    from conftest import tiny_unet_config

    cfg = tiny_unet_config(tmp_path / "ens", image_npz, ddm={"k": 2, "partition": {"features": "both"}})
    assert validate(cfg).model.condition == "class"
    assert main(["partition", write_config(tmp_path / "c.yaml", cfg), "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == ("islands: config error: ddm.partition.features: both clusters "
                                               "captions; model.condition is 'class', not text")
    cfg["ddm"]["partition"].pop("features")
    assert validate(cfg).ddm.partition.features == "pixels"  # no captions: the default stays pixels
    assert not (tmp_path / "ens" / "partition" / "partition.json").exists()


def colour_squares():
    """64 red squares captioned "a red square" and 64 blue ones "a blue square", 3x8x8, a little noise on each."""
    from islands.data.sources import CAPTION, _ArraySource

    class Captioned(_ArraySource):
        def read(self, indices, fields):
            got = super().read(indices, fields)
            if CAPTION in fields:
                got[CAPTION] = ["a red square" if int(i) < 64 else "a blue square" for i in indices]
            return got

    gen = torch.Generator().manual_seed(0)
    red, blue = torch.tensor([0.9, -0.9, -0.9]), torch.tensor([-0.9, -0.9, 0.9])
    colours = torch.stack([red] * 64 + [blue] * 64).reshape(128, 3, 1, 1).expand(128, 3, 8, 8)
    x = (colours + 0.05 * torch.randn(128, 3, 8, 8, generator=gen)).clamp(-1, 1)
    squares = Captioned(x.contiguous(), None, 0)
    squares.holds = squares.holds | {CAPTION}
    return squares


def test_guidance_moves_samples_toward_their_prompt(tmp_path, monkeypatch):
    """A tiny text DiT trained briefly on red and blue squares draws red for "a red square" and blue for "a blue
    square", and guidance 3 more so than none (Ho & Salimans 2022: the conditional direction, amplified; measured
    here 2.07 / -1.87 red minus blue without guidance, 3.05 / -2.74 with it)."""
    emoji_or_skip()  # its config names the emoji (captioned data); the data itself is the squares
    from islands.generate import open_run

    monkeypatch.setattr("islands.trainer.parts.build_data", lambda *args, **kwargs: colour_squares())
    raw = emoji_run(tmp_path / "run", images=384, batch_size=32, lr=3e-3, label_dropout=0.2, checkpoint_every=384,
                    sample_every=0, log_every=512)
    run = train(validate(raw), progress=False)

    def redness(prompt: str, guidance: float) -> float:
        sampler = open_run(run, {"guidance": guidance, "steps": 8, "solver": "heun"})
        x = sampler.generate(16, sampler.conditions(16, SampleRequest(prompts=tuple([prompt]))))
        return float((x[:, 0] - x[:, 2]).mean())  # red minus blue

    red1, blue1 = redness("a red square", 1.0), redness("a blue square", 1.0)
    red3, blue3 = redness("a red square", 3.0), redness("a blue square", 3.0)
    assert red1 > 0.2 and blue1 < -0.2, (red1, blue1)  # the prompt decides the colour
    assert red3 - blue3 > red1 - blue1, (red3, blue3, red1, blue1)  # guidance pushes each further its way


@pytest.mark.parametrize("strategy", [["parallel.strategy=pipeline", "parallel.microbatches=4"],
                                      ["parallel.strategy=fsdp"]], ids=["pipeline", "fsdp"])
def test_a_text_run_over_two_ranks_follows_the_single_process(tmp_path, strategy):
    """Pipelined (the caption's tokens and mask travel in the carry between the 2 stages) or sharded (the caption's
    projections sharded with the rest), the single process's weights (measured: relative differences 7.5e-10 and
    2.6e-10)."""
    emoji_or_skip()
    from test_parallel import launch_ranks
    from test_pipeline import final_weights, relative_difference

    cfg = emoji_run(tmp_path / "single", images=32, sample_every=0, checkpoint_every=32)
    torch.set_num_threads(1)
    single = final_weights(train(validate(cfg), progress=False))
    cfg = {**cfg, "run_dir": str(tmp_path / "pipe")}
    ranks = launch_ranks(2, cfg, tmp_path, *strategy)
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    assert relative_difference(single, final_weights(cfg["run_dir"])) < 1e-5
