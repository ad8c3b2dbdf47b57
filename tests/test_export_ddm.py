"""An ensemble in the open DDM layout (`islands export ENSEMBLE OUT/`, islands/export/ensemble.py): its pipeline.py
samples it with plain diffusers in a process where Islands cannot be imported, and the same noise gives the samples
`islands sample ENSEMBLE` gives, under every routing policy; the router shipped for it computes what Islands' router
computes; a changed file is refused."""

import json
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import emoji_or_skip, random_images, tiny_unet_config
from hostile import edit_json, link_out
from test_diffusers_nets import CLASS_LABELS, ensemble_of, model_config, randomised
from test_export import WITHOUT_ISLANDS, run_without_islands

from islands.cli import main
from islands.conditions import SampleRequest, network_spec
from islands.data import streams
from islands.data.shards import file_sha256
from islands.ddm.ensemble import ancestral_clusters, read_manifest
from islands.ddm.sampling import open_sampler
from islands.errors import ConfigError
from islands.export import diffusers_pipeline
from islands.export.records import ExportedIndex
from islands.nets.condition import TextWidths, pack_text
from islands.nets.router import TransformerRouter

ROUTINGS = ("ancestral", "top1", "topk:2", "full", "nucleus:0.6", "sample", "ancestral_then:topk:1@0.5")
STEPS, GUIDANCE, NUM = 4, 2.0, 6

# the shipped pipeline, loaded from the folder as its user loads it, under every policy
SAMPLE_EVERY_ROUTING = WITHOUT_ISLANDS + textwrap.dedent("""
    import importlib.util, json
    sys.dont_write_bytecode = True  # the folder is read, not written to
    spec = importlib.util.spec_from_file_location("ddm_pipeline", f"{out}/pipeline.py")
    ddm_pipeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ddm_pipeline)
    pipe = ddm_pipeline.DDMPipeline.from_folder(out)
    noise, labels = torch.from_numpy(np.load(f"{work}/noise.npy")), torch.from_numpy(np.load(f"{work}/labels.npy"))
    clusters = torch.from_numpy(np.load(f"{work}/clusters.npy"))
    for routing in json.loads(sys.argv[3]):
        x = pipe(len(noise), class_labels=labels, routing=routing, num_inference_steps=int(sys.argv[4]),
                 guidance_scale=float(sys.argv[5]), latents=noise, clusters=clusters, routing_seed=int(sys.argv[6]))
        np.save(f"{work}/{routing.replace(':', '_')}.npy", x.numpy())
    assert not any(m == "islands" or m.startswith("islands.") for m in sys.modules)
""")


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory):
    """A DiT and a DDPM U-Net, class-conditional, rectified flow, with Islands' router, exported."""
    folder = tmp_path_factory.mktemp("ddm")
    cfg = tiny_unet_config(folder / "ens", random_images(folder), train={
        "images": 32, "checkpoint_every": 32, "sample_every": 0, "warmup_images": 16})
    cfg["model"] = model_config("DiTTransformer2DModel", 4)
    cfg["sample"] = {"num": 4, "steps": STEPS, "solver": "euler", "guidance": GUIDANCE, "time_shift": 2.0}
    cfg["eval"] = {"num": 8, "metrics": ["fd"], "features": "pixels"}
    ensemble_of(folder / "ddm.yaml", cfg, CLASS_LABELS[::-1])
    assert main(["export", str(folder / "ens"), str(folder / "out")]) == 0
    return folder


def test_the_exported_pipeline_samples_as_islands_samples_under_every_routing(ensemble):
    torch.set_num_threads(1)
    root, out = ensemble / "ens", ensemble / "out"
    sampler = open_sampler(root, {"steps": STEPS, "solver": "euler", "guidance": GUIDANCE}, routing="ancestral")
    labels = sampler.conditions(NUM)
    seed = sampler.cfg.seed
    noise = streams.normal(seed, list(range(NUM)), sampler.shape, "sample")  # as islands/generate.py draws it
    clusters = ancestral_clusters(sampler.manifest, seed, 0, NUM, labels)
    for name, value in (("noise", noise), ("labels", labels), ("clusters", clusters)):
        np.save(ensemble / f"{name}.npy", value.numpy())
    run_without_islands(SAMPLE_EVERY_ROUTING, out, ensemble, json.dumps(ROUTINGS), STEPS, GUIDANCE, seed)
    for routing in ROUTINGS:
        drawn = open_sampler(root, {"steps": STEPS, "solver": "euler", "guidance": GUIDANCE},
                             routing=routing).generate(NUM, labels)
        shipped = np.load(ensemble / f"{routing.replace(':', '_')}.npy")
        assert (np.abs(shipped) < 1).mean() > 0.5, routing  # most values are not clamped: the comparison sees them
        np.testing.assert_allclose(shipped, drawn.numpy(), atol=1e-4, err_msg=routing)
    # the policies differ, so that agreeing under each is not agreeing under one
    full, top1 = (np.load(ensemble / f"{r}.npy") for r in ("full", "top1"))
    assert np.abs(full - top1).max() > 1e-3


def test_the_folder_is_the_open_ddm_layout_every_file_hashed(ensemble):
    out = ensemble / "out"
    index = ExportedIndex.load(out / "ddm.json")
    manifest = read_manifest(ensemble / "ens")
    assert [e.class_name for e in index.experts] == list(CLASS_LABELS[::-1])
    for k, expert in enumerate(index.experts):
        assert (out / f"expert_{k}" / "config.json").is_file()
        assert json.loads((out / f"expert_{k}" / "config.json").read_text())["_class_name"] == expert.class_name
        assert expert.source_sha256 == manifest.experts[k].sha256
    assert index.prior == manifest.prior and index.prior_by_class[:-1] == manifest.prior_by_class
    assert index.dumps() == (out / "ddm.json").read_text()  # written as its model dumps it, nothing lost
    assert json.loads((out / "scheduler" / "scheduler_config.json").read_text())["shift"] == 2.0
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} - {"ddm.json"}
    assert set(index.files) == on_disk
    assert {"partition/partition.json", "partition/assignments.npz", "pipeline.py",
            "router/diffusion_pytorch_model.safetensors"} <= on_disk


def test_a_changed_file_is_refused_by_the_pipeline(ensemble, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(ensemble / "out", copy)
    weights = copy / "expert_1" / "diffusion_pytorch_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="expert_1/diffusion_pytorch_model.safetensors: sha256 does not match"):
        diffusers_pipeline.DDMPipeline.from_folder(copy)
    index = json.loads((copy / "ddm.json").read_text())
    index["files"]["../outside/config.json"] = index["files"].pop("expert_1/config.json")
    index["experts"][1]["folder"] = "../outside"
    (copy / "ddm.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="lies outside"):
        diffusers_pipeline.DDMPipeline.from_folder(copy)


@pytest.mark.parametrize("condition", ["none", "class", "text"])
def test_the_shipped_router_computes_what_islands_router_computes(condition):
    text = TextWidths(6, 5, 3) if condition == "text" else None
    classes = 3 if condition == "class" else 0
    islands_router = randomised(TransformerRouter(8, 2, 4, patch_size=2, hidden_size=16, depth=2, num_heads=2,
                                                  num_classes=classes, text=text)).eval()
    shipped = diffusers_pipeline.DDMRouter(sample_size=8, in_channels=2, num_experts=4, patch_size=2, hidden_size=16,
                                           depth=2, num_heads=2, num_classes=classes,
                                           pooled_width=5 if text else 0).eval()
    shipped.load_state_dict(islands_router.state_dict())  # strict: the same names
    gen = torch.Generator().manual_seed(1)
    x, t = torch.randn(3, 2, 8, 8, generator=gen), torch.tensor([0.9, 0.5, 0.1])
    if condition == "class":
        cond, given = torch.tensor([0, 2, 3]), {"class_labels": torch.tensor([0, 2, 3])}
    elif condition == "text":
        pooled = torch.randn(3, 5, generator=gen)
        cond = pack_text(torch.randn(3, 3, 6, generator=gen), torch.ones(3, 3, dtype=torch.bool), pooled)
        given = {"pooled": pooled}
    else:
        cond, given = None, {}
    with torch.no_grad():
        torch.testing.assert_close(shipped(x, t, **given), islands_router(x, t, cond), rtol=0, atol=1e-5)
        if condition != "none":  # and without the condition: the null class, or the learned null caption
            torch.testing.assert_close(shipped(x, t), islands_router(x, t, None), rtol=0, atol=1e-5)


def test_an_ensemble_of_islands_own_u_nets_exports_samples_in_plain_diffusers_and_reads_back(tmp_path, capsys):
    """Islands' own networks export as IslandsUNet with their code beside them (islands_networks/), which the
    pipeline imports from the folder once its files are checked; Islands reads the folder back without it."""
    import shutil

    from conftest import write_config

    cfg = tiny_unet_config(tmp_path / "ens", random_images(tmp_path), train={
        "images": 32, "checkpoint_every": 32, "sample_every": 0, "warmup_images": 16})
    cfg["sample"] = {"steps": STEPS, "solver": "euler", "guidance": GUIDANCE}
    cfg["eval"] = {"num": 8, "metrics": ["fd"], "features": "pixels"}
    cfg["ddm"] = {"k": 2, "partition": {"method": "kmeans", "pca_dim": 8, "fine": 8},
                  "router": {"hidden_size": 16, "depth": 1, "num_heads": 2, "patch_size": 2, "batch_size": 8,
                             "images": 16}}
    assert main(["ddm", write_config(tmp_path / "ddm.yaml", cfg), "--quiet"]) == 0
    root, out = tmp_path / "ens", tmp_path / "out"
    assert main(["export", str(root), str(out)]) == 0
    index = ExportedIndex.load(out / "ddm.json")
    assert [e.class_name for e in index.experts] == ["IslandsUNet", "IslandsUNet"]
    assert "islands_networks/unet.py" in index.files

    routings, opts = ("ancestral", "top1", "full"), {"steps": STEPS, "solver": "euler", "guidance": GUIDANCE}
    sampler = open_sampler(root, opts, routing="ancestral")
    labels, seed = sampler.conditions(NUM), sampler.cfg.seed
    noise = streams.normal(seed, list(range(NUM)), sampler.shape, "sample")
    for name, value in (("noise", noise), ("labels", labels),
                        ("clusters", ancestral_clusters(sampler.manifest, seed, 0, NUM, labels))):
        np.save(tmp_path / f"{name}.npy", value.numpy())
    run_without_islands(SAMPLE_EVERY_ROUTING, out, tmp_path, json.dumps(routings), STEPS, GUIDANCE, seed)
    for routing in routings:
        drawn = open_sampler(root, opts, routing=routing).generate(NUM, labels)
        shipped = np.load(tmp_path / f"{routing}.npy")
        assert np.abs(drawn.numpy()).max() > 0.1, routing  # the experts are not still at their zero output layers
        np.testing.assert_allclose(shipped, drawn.numpy(), atol=1e-4, err_msg=routing)
    assert np.abs(np.load(tmp_path / "full.npy") - np.load(tmp_path / "top1.npy")).max() > 1e-3

    assert main(["import", str(out), str(tmp_path / "imported")]) == 0
    again = open_sampler(tmp_path / "imported", opts, routing="top1").generate(NUM, labels)
    assert torch.equal(again, open_sampler(root, opts, routing="top1").generate(NUM, labels))

    copy = tmp_path / "vectors"  # an expert of a kind diffusers has nothing for: refused by name, nothing written
    shutil.copytree(root, copy)
    manifest = json.loads((copy / "ensemble.json").read_text())
    manifest["experts"][0]["model"]["arch"] = "mlp"
    (copy / "ensemble.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main(["export", str(copy), str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.arch: expert0 is a 'mlp', which has no diffusers counterpart" in err
    assert not (tmp_path / "refused").exists() and not (tmp_path / ".refused.partial").exists()


# --- read back: `islands import` ----------------------------------------------------------------------------------

def test_an_imported_ensemble_samples_evaluates_and_distills_as_the_one_exported(ensemble, tmp_path, capsys):
    imported = tmp_path / "imported"
    assert main(["import", str(ensemble / "out"), str(imported)]) == 0
    for routing in ("ancestral", "top1"):  # the same weights, bit for bit, under Islands' names again
        original, again = (open_sampler(root, {"steps": STEPS}, routing=routing).generate(NUM, torch.arange(NUM) % 4)
                           for root in (ensemble / "ens", imported))
        assert torch.equal(original, again), routing
    assert main(["eval", str(imported), "--num", "8", "--features", "pixels", "--metrics", "fd", "--quiet"]) == 0
    assert "fd" in json.loads((imported / "metrics.json").read_text()).popitem()[1]
    assert main(["distill", str(imported), "train.images=16", "train.checkpoint_every=16", "--teacher", "full",
                 "--quiet"]) == 0
    assert (imported / "distilled" / "checkpoints").is_dir()
    assert main(["report", str(imported), "--out", str(tmp_path / "report.html")]) == 0
    assert "expert1" in (tmp_path / "report.html").read_text()


def test_a_run_trained_here_joins_an_imported_ensemble_as_one_more_expert(ensemble, tmp_path, capsys):
    """Its samples, where ancestral routing sends them to it, are the run's own; its data is a cluster of its own in
    the prior; the router, trained for two clusters, routes by the sizes until a new one is trained."""
    rng = np.random.default_rng(1)  # another island's data: 32 examples, 8 of each class
    np.savez(tmp_path / "theirs.npz", x=rng.integers(0, 256, size=(32, 1, 8, 8), dtype=np.uint8), y=np.arange(32) % 4)
    cfg = tiny_unet_config(tmp_path / "run", tmp_path / "theirs.npz", train={
        "images": 16, "checkpoint_every": 16, "sample_every": 0, "warmup_images": 0})
    # the new island starts from a published expert (a diffusers folder), as a fine-tune on its own data
    cfg["model"] = {**model_config("DiTTransformer2DModel", 4, pretrained=str(ensemble / "out" / "expert_0")),
                    "config": {}}  # the folder's config.json says it (model.config beside pretrained must agree)
    from conftest import write_config

    assert main(["train", write_config(tmp_path / "run.yaml", cfg), "--quiet"]) == 0
    joined = tmp_path / "joined"
    assert main(["import", str(ensemble / "out"), str(joined), "--expert", str(tmp_path / "run")]) == 0
    manifest = read_manifest(joined)
    sizes = [e.size for e in read_manifest(ensemble / "ens").experts] + [32]
    assert manifest.k == 3 and manifest.prior == pytest.approx([s / sum(sizes) for s in sizes])
    assert manifest.prior_by_class[0][2] == pytest.approx(8 / (8 + 16))  # 64 examples, 16 of class 0, before

    labels = torch.arange(32) % 4
    opts = {"steps": STEPS, "guidance": GUIDANCE, "time_shift": 2.0}  # the ensemble's, for the run too
    ensemble_sampler = open_sampler(joined, opts, routing="ancestral")
    drawn = ensemble_sampler.generate(32, labels)
    clusters = ancestral_clusters(manifest, ensemble_sampler.cfg.seed, 0, 32, labels)
    assert (clusters == 2).any()
    own = open_sampler(tmp_path / "run", opts).generate(32, labels, seed=ensemble_sampler.cfg.seed)
    torch.testing.assert_close(drawn[clusters == 2], own[clusters == 2], rtol=0, atol=1e-5)
    with pytest.warns(UserWarning, match="router was trained for 2 clusters, not the 3"):
        open_sampler(joined, opts, routing="top1").generate(4, labels[:4])


@pytest.mark.parametrize(("change", "message"), [
    ("flip", "expert_0/diffusion_pytorch_model.safetensors: sha256 does not match ddm.json"),
    ("unlisted", "evil.py is not a file of the open DDM layout"),
    ("class", "is not one of UNet2DModel"),
    ("no prior", "prior: None is not a list of 2 shares, one per cluster"),
])
def test_a_folder_that_is_not_what_its_index_says_is_refused_in_one_line(ensemble, tmp_path, capsys, change,
                                                                           message):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(ensemble / "out", copy)
    index = json.loads((copy / "ddm.json").read_text())
    if change == "flip":
        weights = copy / "expert_0" / "diffusion_pytorch_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    elif change == "unlisted":
        (copy / "evil.py").write_text("raise SystemExit('imported')")
        index["files"]["evil.py"] = file_sha256(copy / "evil.py")
    elif change == "no prior":
        del index["prior"]
    else:  # a class that is not an adapter's, hashed as if it were published so
        config = json.loads((copy / "expert_1" / "config.json").read_text())
        (copy / "expert_1" / "config.json").write_text(json.dumps({**config, "_class_name": "ControlNetModel"}))
        index["files"]["expert_1/config.json"] = file_sha256(copy / "expert_1" / "config.json")
    (copy / "ddm.json").write_text(json.dumps(index))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("mine")
    assert main(["import", str(copy), str(tmp_path / "mine")]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert main(["import", str(copy), str(tmp_path / "imported")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "imported").exists() and not (tmp_path / ".imported.partial").exists()
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["keep.txt"]


# --- issue 35: a published folder as a hostile island would hand it over -------------------------------------------

def published_copy(ensemble, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(ensemble / "out", copy)
    return copy


def set_at(data, key_path: list, value) -> None:
    for key in key_path[:-1]:
        data = data[key]
    data[key_path[-1]] = value


def rehashed(copy, name: str) -> None:
    """The index's sha256 of `name` made to match its changed bytes, as a publisher who meant it would."""
    edit_json(copy / "ddm.json", lambda index: set_at(index, ["files", name], file_sha256(copy / name)))


def import_refused(copy, tmp_path, capsys) -> str:
    """`islands import` of `copy` fails in one line and leaves nothing behind; the line."""
    capsys.readouterr()
    assert main(["import", str(copy), str(tmp_path / "imported")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("islands: "), err
    assert not (tmp_path / "imported").exists() and not (tmp_path / ".imported.partial").exists()
    return err


@pytest.mark.parametrize(("key_path", "value", "message"), [
    (["prior"], [-1, 2], "prior: [-1, 2] holds a share that is not a finite number of at least 0"),
    (["prior"], [float("nan")] * 2, "prior: [nan, nan] holds a share that is not a finite number"),
    (["prior"], [1.0], "prior: [1.0] is not a list of 2 shares"),
    (["prior"], [0.5, 0.6], "prior: [0.5, 0.6] does not sum to 1"),
    (["prior_by_class", 0], [-0.5, 1.5], "prior_by_class[0]: [-0.5, 1.5] holds a share that is not a finite"),
    (["prior_by_class"], [[0.5, 0.5]], "prior_by_class: not a list of at least 5 rows"),
    (["experts", 0, "size"], -3, "experts[0].size: -3 is not a whole number of at least 0"),
    (["experts", 0, "size"], "9", "experts[0].size: '9' is not a whole number"),
    (["islands_config"], None, "islands_config: None is not a config"),
    (["shape"], [1, -8, 8], "shape[1]: -8 is not a whole number of at least 1"),
], ids=lambda v: None if isinstance(v, str) else json.dumps(v))
def test_an_index_value_import_would_use_wrongly_is_refused_in_one_line(ensemble, tmp_path, capsys, key_path, value,
                                                                         message):
    copy = published_copy(ensemble, tmp_path)
    edit_json(copy / "ddm.json", lambda index: set_at(index, key_path, value))
    assert f"ddm.json: {message}" in import_refused(copy, tmp_path, capsys)


@pytest.mark.parametrize(("key_path", "value", "message"), [
    (["prior"], [-1, 2], "prior: [-1, 2] holds a share that is not a finite number of at least 0"),
    (["prior"], [1.0], "prior: [1.0] is not a list of 2 shares"),
    (["prior_by_class", 0], [-0.5, 1.5], "prior_by_class[0]: [-0.5, 1.5] holds a share"),
    (["experts", 1, "size"], -3, "experts[1].size: -3 is not a whole number"),
    (["k"], 3, "k: 3 but 2 experts are listed"),
], ids=lambda v: None if isinstance(v, str) else json.dumps(v))
def test_an_ensemble_manifest_value_sampling_would_use_wrongly_is_refused_in_one_line(ensemble, tmp_path, capsys,
                                                                                       key_path, value, message):
    """The same gaps in ensemble.json, which may have come from another island with its folder."""
    import shutil

    copy = tmp_path / "ens"
    shutil.copytree(ensemble / "ens", copy)
    edit_json(copy / "ensemble.json", lambda manifest: set_at(manifest, key_path, value))
    assert main(["sample", str(copy), "--num", "2", "--steps", "1", "--routing", "ancestral", "--out",
                 str(tmp_path / "samples"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"ensemble.json: {message}" in err, err


def test_an_ensemble_manifest_that_links_out_of_its_folder_is_not_read(ensemble, tmp_path, capsys):
    import shutil

    copy = tmp_path / "ens"
    shutil.copytree(ensemble / "ens", copy)
    link_out(copy, "ensemble.json", tmp_path / "outside" / "ensemble.json")
    assert main(["sample", str(copy), "--num", "2", "--steps", "1", "--out", str(tmp_path / "samples"),
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ensemble.json leads out of the folder" in err, err


@pytest.mark.parametrize(("key", "value", "message"), [
    ("num_classes", None, "router/config.json: num_classes: None is not a whole number of at least 0"),
    ("depth", 0, "router/config.json: depth: 0 is not a whole number of at least 1"),
    ("num_experts", 3, "router/config.json: num_experts: 3 but the ensemble has 2 experts"),
])
def test_a_router_config_import_would_build_wrongly_is_refused_in_one_line(ensemble, tmp_path, capsys, key, value,
                                                                           message):
    """router/config.json, rehashed as its publisher would: the sizes Islands' router is built from, typed."""
    copy = published_copy(ensemble, tmp_path)
    edit_json(copy / "router" / "config.json", lambda config: set_at(config, [key], value))
    rehashed(copy, "router/config.json")
    assert message in import_refused(copy, tmp_path, capsys)


@pytest.mark.parametrize("name", ["ddm.json", "expert_0/diffusion_pytorch_model.safetensors", "expert_1/config.json",
                                  "router/config.json", "partition/partition.json"])
def test_a_file_of_the_folder_that_links_out_of_it_is_not_read(ensemble, tmp_path, capsys, name):
    """The same bytes outside (their sha256 holds): only where the file lies refuses it."""
    copy = published_copy(ensemble, tmp_path)
    link_out(copy, name, tmp_path / "outside" / name.replace("/", "_"))
    assert f"{name} leads out of the folder" in import_refused(copy, tmp_path, capsys)


@pytest.mark.parametrize("network", ["IslandsUNet", "DiTTransformer2DModel"])
def test_a_config_larger_than_its_weights_is_refused_before_it_is_built(ensemble, tmp_path, capsys, network):
    """An IslandsUNet of 20000 channels (6.4 GB) or a DiT of 10000 layers beside weights of a few thousand numbers:
    refused in one line, nothing allocated."""
    from islands.config import validate
    from islands.nets import OWN_NETWORK_ARGUMENTS

    copy = published_copy(ensemble, tmp_path)
    index = json.loads((copy / "ddm.json").read_text())
    config = json.loads((copy / "expert_0" / "config.json").read_text())
    if network == "IslandsUNet":  # expert 0 claims to be Islands' own U-Net, its config.json and index agreeing
        model = {**tiny_unet_config(".", ".")["model"], "channels": 20000}
        arguments = OWN_NETWORK_ARGUMENTS["unet"](network_spec(validate({"run_dir": ".", "model": model}).model,
                                                  tuple(index["shape"]), index["num_classes"]))
        config = {"_class_name": "IslandsUNet", **json.loads(json.dumps({**arguments, "text": None}))}
        edit_json(copy / "ddm.json", lambda index: set_at(index, ["experts", 0, "islands_model"], model))
    else:
        config["num_layers"] = 10000
    (copy / "expert_0" / "config.json").write_text(json.dumps(config))
    rehashed(copy, "expert_0/config.json")
    err = import_refused(copy, tmp_path, capsys)
    assert "expert_0/config.json implies more than the" in err and "refused before it is built" in err, err


def test_import_drops_code_an_islands_config_names_with_a_warning(ensemble, tmp_path, capsys, monkeypatch):
    """Retraining an imported expert (islands train IMPORTED/config.yaml expert=0) must not import the module the
    publisher's config named; and were it named again, the feature loader refuses a module this machine never
    trusted."""
    import yaml

    from islands.config import load_config
    from islands.eval.evaluate import refuse_untrusted_features

    copy = published_copy(ensemble, tmp_path)
    torch_features = {"features": "torch", "feature_net": "this:x", "feature_weights": "/x.safetensors",
                      "feature_size": 32}
    edit_json(copy / "ddm.json", lambda index: index["islands_config"]["eval"].update(torch_features))
    assert main(["import", str(copy), str(tmp_path / "imported")]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith("islands: warning:")]
    assert len(warned) == 1 and "eval.feature_net 'this:x' names code to import" in warned[0], warned
    written = yaml.safe_load((tmp_path / "imported" / "config.yaml").read_text())["eval"]
    assert not set(torch_features) & set(written) and written["metrics"] == ["fd"]  # the rest of eval kept
    monkeypatch.delenv("ISLANDS_TRUSTED_MODULES", raising=False)
    monkeypatch.delitem(sys.modules, "this", raising=False)
    named_again = load_config(tmp_path / "imported" / "config.yaml", [f"eval.{k}={v}" for k, v in
                                                                       torch_features.items()])
    with pytest.raises(ConfigError, match="set ISLANDS_TRUSTED_MODULES=this"):
        refuse_untrusted_features(named_again.eval)
    assert "this" not in sys.modules


def test_a_condition_router_whose_sizes_its_weights_do_not_have_is_refused_unbuilt():
    """Its sizes come from ddm.json or ensemble.json: a trillion hidden units beside weights of 8 are never built."""
    from islands.ddm.condition_router import ConditionRouter
    from islands.ddm.ensemble import condition_router_of
    from islands.errors import CheckpointError

    weights = ConditionRouter(6, 2, 8).state_dict()
    assert condition_router_of({"width": 6, "clusters": 2, "hidden": 8}, weights, "cr").hidden == 8
    with pytest.raises(CheckpointError, match="cr: its weights are not those of a condition router of width 6, "
                                              "1000000000000 hidden"):
        condition_router_of({"width": 6, "clusters": 2, "hidden": 10**12}, weights, "cr")


def test_import_and_export_remove_only_a_partial_folder_islands_marked(ensemble, tmp_path, capsys):
    """A `.OUT.partial` of a person's is refused and kept; one a killed import left (marked) is replaced."""
    from islands.rundir import BUILDING_MARKER

    for command, source in (("import", ensemble / "out"), ("export", ensemble / "ens")):
        partial = tmp_path / f".{command}ed.partial"
        partial.mkdir()
        (partial / "thesis.tex").write_text("mine")
        capsys.readouterr()
        assert main([command, str(source), str(tmp_path / f"{command}ed")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{partial} exists and is not a folder Islands was building" in err, err
        assert (partial / "thesis.tex").read_text() == "mine" and not (tmp_path / f"{command}ed").exists()
    killed = tmp_path / ".again.partial"
    killed.mkdir()
    (killed / BUILDING_MARKER).write_text("")
    (killed / "stale.safetensors").write_text("left by the killed import")
    assert main(["import", str(ensemble / "out"), str(tmp_path / "again")]) == 0
    assert not killed.exists() and not (tmp_path / "again" / BUILDING_MARKER).exists()
    assert not (tmp_path / "again" / "stale.safetensors").exists()


# --- on text: SD3, Flux and an SD U-Net on the emoji's captions ---------------------------------------------------

SAMPLE_PROMPTS = WITHOUT_ISLANDS + textwrap.dedent("""
    import importlib.util, json
    sys.dont_write_bytecode = True
    spec = importlib.util.spec_from_file_location("ddm_pipeline", f"{out}/pipeline.py")
    ddm_pipeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ddm_pipeline)
    pipe = ddm_pipeline.DDMPipeline.from_folder(out)
    caption = ddm_pipeline.Caption(*(torch.from_numpy(np.load(f"{work}/{name}.npy"))
                                     for name in ("states", "mask", "pooled")))
    noise, clusters = torch.from_numpy(np.load(f"{work}/noise.npy")), torch.from_numpy(np.load(f"{work}/clusters.npy"))
    for routing in json.loads(sys.argv[3]):
        x = pipe(len(noise), caption=caption, routing=routing, num_inference_steps=int(sys.argv[4]),
                 guidance_scale=float(sys.argv[5]), latents=noise, clusters=clusters)
        np.save(f"{work}/{routing.replace(':', '_')}.npy", x.numpy())
""")


def test_a_text_conditioned_ensemble_samples_prompts_in_plain_diffusers_and_reads_back(tmp_path):
    """Each expert's learned null caption (guidance), the router's pooled caption and the condition router's
    p(cluster | caption) travel with the folder: the pipeline's samples are Islands' under three policies, and the
    folder imported back samples bit for bit as the ensemble it came from."""
    from test_diffusers_nets import TEXT_CLASSES, emoji_diffusers_run

    from islands.ddm.ensemble import load_condition_prior

    emoji_or_skip()
    torch.set_num_threads(1)
    cfg = emoji_diffusers_run(tmp_path / "ens", "SD3Transformer2DModel", sample_every=0)
    cfg["data"]["limit"] = 64
    cfg["eval"] = {"num": 8, "metrics": ["fd"], "features": "pixels"}
    cfg["sample"] = {"steps": 3, "solver": "euler", "guidance": 3.0}
    ensemble_of(tmp_path / "ddm.yaml", cfg, TEXT_CLASSES[1:] + TEXT_CLASSES[:1])
    root, out = tmp_path / "ens", tmp_path / "out"
    assert main(["export", str(root), str(out)]) == 0

    opts, routings = {"steps": 3, "solver": "euler", "guidance": 3.0}, ("ancestral", "top1", "full")
    sampler = open_sampler(root, opts, routing="ancestral")
    packed = sampler.conditions(4, SampleRequest(prompts=tuple(["red apple", "grinning face", "blue heart"])))
    width, pooled_width = sampler.cfg.model.text_width, sampler.cfg.model.text_pooled_width
    depth = max(width, pooled_width)
    noise = streams.normal(sampler.cfg.seed, list(range(4)), sampler.shape, "sample")
    clusters = ancestral_clusters(sampler.manifest, sampler.cfg.seed, 0, 4, packed,
                                  condition_prior=load_condition_prior(root, sampler.manifest))
    for name, value in (("states", packed[:, 1:, :width]), ("mask", packed[:, 1:, depth] > 0.5),
                        ("pooled", packed[:, 0, :pooled_width]), ("noise", noise), ("clusters", clusters)):
        np.save(tmp_path / f"{name}.npy", value.numpy())
    run_without_islands(SAMPLE_PROMPTS, out, tmp_path, json.dumps(routings), 3, 3.0)
    for routing in routings:
        drawn = open_sampler(root, opts, routing=routing).generate(4, packed)
        np.testing.assert_allclose(np.load(tmp_path / f"{routing}.npy"), drawn.numpy(), atol=1e-4, err_msg=routing)

    assert main(["import", str(out), str(tmp_path / "imported")]) == 0
    again = open_sampler(tmp_path / "imported", opts, routing="top1").generate(4, packed)
    assert torch.equal(again, open_sampler(root, opts, routing="top1").generate(4, packed))
