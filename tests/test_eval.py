"""Feature networks, `islands eval` and training-time evaluation (the metrics themselves: test_metrics.py)."""

import json
import pickle
import shutil
import sys
import time

import numpy as np
import pytest
import torch
import yaml
from conftest import a_feature_module, fashion_mnist_or_skip, tiny_unet_config, write_config

from islands.cli import main
from islands.config import EvalConfig, validate
from islands.data.sources import FashionMnist, Source
from islands.errors import CheckpointError, ConfigError
from islands.eval import metrics
from islands.eval.evaluate import Evaluator, timed
from islands.eval.features import Pixels, load_classifier, load_torch_features, train_classifier
from islands.rundir import latest_checkpoint, load_weights, save_weights
from islands.train.logbook import read_metrics
from islands.trainer import train


class Subset(Source):
    def __init__(self, source: Source, n: int, noise: float = 0.0, uniform: bool = False):
        self.source, self.n, self.noise, self.uniform = source, n, noise, uniform
        self.shape, self.num_classes, self.flip, self.holds = source.shape, source.num_classes, False, source.holds

    def __len__(self):
        return self.n

    def read(self, indices, fields):
        got = self.source.read(indices, fields)
        g = torch.Generator().manual_seed(len(indices))
        if self.uniform:
            got["x"] = torch.rand(got["x"].shape, generator=g) * 2 - 1
        elif self.noise:
            got["x"] = (got["x"] + self.noise * torch.randn(got["x"].shape, generator=g)).clamp(-1, 1)
        return got


@pytest.fixture(scope="module")
def fashion():
    fashion_mnist_or_skip()
    return Subset(FashionMnist(split="train"), 6000), FashionMnist(split="test")


def test_classifier_features_separate_real_images_from_noise(fashion):
    train_set, test_set = fashion
    features = load_classifier(train_set, seed=0, epochs=1)
    reference = metrics.feature_stats(features.of_source(train_set))

    def fd(source):
        return metrics.frechet_distance(metrics.feature_stats(features.of_source(source)), reference)

    clean, noisy, uniform = fd(Subset(test_set, 2000)), fd(Subset(test_set, 2000, noise=0.5)), \
        fd(Subset(test_set, 2000, uniform=True))
    assert clean * 10 < uniform and clean < noisy < uniform, (clean, noisy, uniform)
    acc = (features.predict(test_set.get(list(range(2000)))[0]) == test_set.get(list(range(2000)))[1]).double()
    assert acc.mean() > 0.5  # chance is 0.1; 47 steps of training (the default, 2 epochs of 60k, reaches ~0.9)


def test_an_evaluator_with_a_classifier_runs_every_sample_metric_and_counts_the_classifiers_labels(tmp_path,
                                                                                                     monkeypatch):
    """Four classes of 8x8 images (a pattern per class, plus noise) and the classifier Islands trains on them. Fresh
    images of the same kind read as real, uniform noise as far off; label_accuracy and class_balance are the
    classifier's own counts on the samples."""
    from islands.data.sources import _ArraySource

    monkeypatch.setenv("ISLANDS_CACHE", str(tmp_path))
    patterns = torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1

    def images(n, seed):
        labels = torch.arange(n) % 4
        noise = torch.rand(n, 1, 8, 8, generator=torch.Generator().manual_seed(seed)) * 2 - 1
        return 0.7 * patterns[labels] + 0.3 * noise, labels

    evaluator = Evaluator(_ArraySource(*images(512, 1), 4), EvalConfig(classifier_epochs=1), seed=0)  # 4 steps
    assert evaluator.metrics(with_denoiser=False) == ["fd", "kid", "precision_recall", "density_coverage",
                                                      "class_balance"]
    x, y = images(400, 2)
    real = evaluator([(x[:256], y[:256]), (x[256:], y[256:])])
    noise = evaluator([(torch.rand(x.shape, generator=torch.Generator().manual_seed(3)) * 2 - 1, y)])
    predicted = evaluator.features.predict(x)
    assert real["label_accuracy"] == (predicted == y).double().mean().item()
    assert real["class_balance"]["fake_share"] == (torch.bincount(predicted, minlength=4) / 400).double().tolist()
    assert real["class_balance_tv"] == real["class_balance"]["total_variation"]
    assert real["density"] > 0.5 and real["coverage"] > 0.5, real
    assert noise["density"] < 0.05 and noise["coverage"] < 0.05, noise
    assert abs(real["kid"]) < 3 * real["kid_se"] and noise["kid"] > 10 * noise["kid_se"] > 0


def test_the_classifier_is_deterministic_and_cached_by_data_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("ISLANDS_CACHE", str(tmp_path))
    rng = np.random.default_rng(0)
    from islands.data.sources import _ArraySource

    data = _ArraySource(torch.from_numpy(rng.uniform(-1, 1, (512, 1, 8, 8)).astype(np.float32)),
                        torch.arange(512) % 4, 4)
    a, b = train_classifier(data, seed=1, epochs=1), train_classifier(data, seed=1, epochs=1)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    first = load_classifier(data, seed=1, epochs=1)
    cached = list((tmp_path / "classifiers").glob("*.safetensors"))
    assert len(cached) == 1
    again = load_classifier(data, seed=1, epochs=1)  # read back, not retrained
    x = data.get(list(range(16)))[0]
    assert torch.equal(first(x), again(x)) and first.name == again.name
    data.data[0] += 0.5  # other data: another hash, another classifier
    load_classifier(data, seed=1, epochs=1)
    assert len(list((tmp_path / "classifiers").glob("*.safetensors"))) == 2


def tiny_extractor():
    """A user's feature network, as `islands eval` imports it: 'test_eval:tiny_extractor'."""
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1))


def test_user_feature_networks_load_from_safetensors_and_refuse_pickles(tmp_path, monkeypatch):
    monkeypatch.setenv("ISLANDS_TRUSTED_MODULES", "test_eval")  # the user trusts their own module
    torch.manual_seed(0)
    net = tiny_extractor()
    save_weights(net.state_dict(), tmp_path / "ext.safetensors")
    features = load_torch_features("test_eval:tiny_extractor", tmp_path / "ext.safetensors", size=16, channels=3)
    x = torch.rand(5, 1, 8, 8) * 2 - 1
    expected = net(torch.nn.functional.interpolate(x.expand(-1, 3, -1, -1), size=(16, 16), mode="bilinear"))
    assert torch.allclose(features(x), expected.flatten(1), atol=1e-6)
    (tmp_path / "evil.safetensors").write_bytes(pickle.dumps({"w": 1}))
    with pytest.raises(CheckpointError, match="evil.safetensors"):
        load_torch_features("test_eval:tiny_extractor", tmp_path / "evil.safetensors")


def own_reference(evaluator: Evaluator) -> np.ndarray:
    """The mean of the data's features computed with this evaluator's own feature network, not read from a cache."""
    return metrics.feature_stats(evaluator.features.of_source(evaluator.source)).mean


def test_reference_statistics_are_cached_per_feature_network_setting(tmp_path, monkeypatch):
    """Evaluations that differ only in classifier_epochs, or in a torch extractor's input size or channels, have other
    features: each is compared with statistics of its own features, never with another's cached ones."""
    from islands.data.sources import _ArraySource

    monkeypatch.setenv("ISLANDS_CACHE", str(tmp_path))
    monkeypatch.setenv("ISLANDS_TRUSTED_MODULES", "test_eval")
    rng = np.random.default_rng(0)
    data = _ArraySource(torch.from_numpy(rng.uniform(-1, 1, (256, 1, 8, 8)).astype(np.float32)),
                        torch.arange(256) % 4, 4)
    by_epochs = [Evaluator(data, EvalConfig(features="classifier", classifier_epochs=e)) for e in (1, 2)]
    torch.manual_seed(0)
    save_weights(tiny_extractor().state_dict(), tmp_path / "ext.safetensors")
    extractor = {"features": "torch", "feature_net": "test_eval:tiny_extractor",
                 "feature_weights": str(tmp_path / "ext.safetensors"), "feature_channels": 3}
    by_size = [Evaluator(data, EvalConfig(**extractor, feature_size=size)) for size in (8, 16)]
    for pair in (by_epochs, by_size):
        for evaluator in pair:  # the first fills the cache; the second must not read the first's statistics
            assert np.allclose(evaluator.reference()["stats"].mean, own_reference(evaluator), atol=1e-5)
    assert len(list((tmp_path / "stats").glob("*.npz"))) == 4
    names = {load_torch_features("test_eval:tiny_extractor", tmp_path / "ext.safetensors", 8, channels).name
             for channels in (None, 3)}
    assert len(names) == 2 and all("test_eval.tiny_extractor" in name for name in names)


def gmm_config(run_dir, **eval_keys) -> dict:
    return {"run_dir": str(run_dir), "seed": 5,
            "data": {"source": "gmm", "means": [[1.0, 0.0], [-1.0, 1.0], [0.0, -1.5]], "std": 0.2, "size": 2048},
            "model": {"arch": "mlp", "hidden": 32, "depth": 2},
            "train": {"images": 1280, "batch_size": 64, "lr": 2e-3, "ema_halflife_images": 200,
                      "checkpoint_every": 640, "log_every": 640},
            "sample": {"num": 16, "steps": 4, "solver": "euler"},
            "eval": {"num": 300, **eval_keys}}


@pytest.fixture(scope="module")
def gmm_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gmm")
    plain = train(validate(gmm_config(root / "plain")), progress=False)
    evaluated = train(validate(gmm_config(root / "evaluated", every=640)), progress=False)
    return plain, evaluated


def test_evaluating_during_training_logs_metrics_and_leaves_the_trajectory_alone(gmm_run):
    plain, evaluated = gmm_run
    records = read_metrics(evaluated, "eval")
    assert [r["images"] for r in records] == [640, 1280]
    for r in records:
        assert len(r["val_loss_by_t"]) == 8 and r["val_loss"] == pytest.approx(np.mean(r["val_loss_by_t"]))
        assert {"fd", "kid", "kid_se", "precision", "recall", "density", "coverage", "nll", "swd", "mode_mass_error",
                "velocity_mse"} <= set(r)
        assert "class_balance_tv" not in r  # pixels of a Gaussian mixture: no classifier to count classes
    a = load_weights(latest_checkpoint(plain) / "model.safetensors")
    b = load_weights(latest_checkpoint(evaluated) / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_islands_eval_on_a_run_and_on_its_samples_file(gmm_run, tmp_path, capsys):
    run, _ = gmm_run
    assert main(["eval", str(run), "--num", "200", "--batch-size", "64", "--quiet"]) == 0
    table = capsys.readouterr().out
    assert "velocity_mse" in table and "metrics.json" in table
    first = json.loads((run / "metrics.json").read_text())
    assert main(["eval", str(run), "--num", "200", "--batch-size", "7", "--quiet"]) == 0
    entries = json.loads((run / "metrics.json").read_text())
    assert entries.keys() == first.keys()  # the same evaluation, replaced: the batch size changes nothing
    (key, small_batches), = entries.items()
    (_, big_batches), = first.items()
    assert small_batches["fd"] == pytest.approx(big_batches["fd"], rel=1e-5)
    assert main(["eval", str(run), "--num", "200", "--quiet", "--metrics", "swd", "fd"]) == 0
    entries = json.loads((run / "metrics.json").read_text())
    assert len(entries) == 2 and entries[key] == small_batches  # other metrics: kept beside the first
    picked = entries[next(k for k in entries if k != key)]
    assert set(picked) >= {"fd", "swd"} and "kid" not in picked

    out = tmp_path / "samples"
    assert main(["sample", str(run), "--num", "200", "--out", str(out), "--quiet"]) == 0
    assert main(["eval", str(out / "samples.npz"), "--run", str(run), "--quiet", "--metrics", "fd", "nll"]) == 0
    (from_file,) = json.loads((out / "metrics.json").read_text()).values()
    assert from_file["fd"] == pytest.approx(big_batches["fd"], rel=1e-5)  # the same 200 samples


def test_evaluations_with_other_features_are_kept_side_by_side(tmp_path, capsys, image_npz):
    config = write_config(tmp_path / "c.yaml", tiny_unet_config(tmp_path / "run", image_npz, train={"images": 16}))
    assert main(["train", config, "--quiet"]) == 0
    for features in ("pixels", "classifier", "pixels"):
        assert main(["eval", str(tmp_path / "run"), "--features", features, "--num", "8", "--steps", "2",
                     "--quiet"]) == 0
    entries = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert sorted(entry["features"].split("-")[0] for entry in entries.values()) == ["classifier", "pixels"]
    assert all(f"features={entry['features']} " in key for key, entry in entries.items())


def test_islands_eval_names_bad_targets_and_metrics(gmm_run, tmp_path, capsys):
    run, _ = gmm_run
    assert main(["eval", str(tmp_path), "--quiet"]) == 2
    assert str(tmp_path) in capsys.readouterr().err
    assert main(["eval", str(run), "--metrics", "coverage", "--quiet"]) == 2  # the old name of class_balance
    err = capsys.readouterr().err
    assert "eval.metrics: 'coverage'" in err and "class_balance" in err and "density_coverage" in err
    assert len(err.strip().splitlines()) == 1
    assert main(["eval", str(run), "--metrics", "class_balance", "--quiet"]) == 2  # no classifier on a mixture
    assert "eval.metrics: 'class_balance' does not apply here" in capsys.readouterr().err
    (tmp_path / "samples.npz").write_bytes(b"not an npz")
    assert main(["eval", str(tmp_path / "samples.npz"), "--run", str(run), "--quiet"]) == 2
    assert "samples.npz" in capsys.readouterr().err


def test_islands_eval_imports_only_the_feature_module_the_user_names(gmm_run, tmp_path, capsys, monkeypatch):
    """A run folder may come from another island: its config.yaml alone must not decide what code runs."""
    run = tmp_path / "run"
    shutil.copytree(gmm_run[0], run)
    factory = a_feature_module(tmp_path, "island_features")
    monkeypatch.syspath_prepend(str(tmp_path))  # importable, as a module beside the user would be
    monkeypatch.delitem(sys.modules, "island_features", raising=False)
    monkeypatch.setenv("ISLANDS_TRUSTED_MODULES", "island_features")  # trusted here: the run folder still may not
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["eval"].update(features="torch", feature_net=factory, feature_weights=str(tmp_path / "features.safetensors"))
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))

    assert main(["eval", str(run), "--num", "200", "--metrics", "fd", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert not (tmp_path / "imported").exists()
    assert err.count("\n") == 1 and err.startswith("islands: config error: --feature-net: ")
    assert f"{run / 'config.yaml'} names '{factory}'" in err and f"pass --feature-net {factory} to trust it" in err

    assert main(["eval", str(run), "--num", "200", "--metrics", "fd", "--quiet", "--feature-net", factory]) == 0
    assert (tmp_path / "imported").exists()
    assert "fd" in next(iter(json.loads((run / "metrics.json").read_text()).values()))


def test_a_feature_module_is_imported_only_if_this_machine_trusts_it(gmm_run, tmp_path, capsys, monkeypatch):
    """A config, or a command line pasted from another island's README, names code: it runs only if the user listed
    its module in ISLANDS_TRUSTED_MODULES (issue 35), and the one line says what to set."""
    factory = a_feature_module(tmp_path, "island_features")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "island_features", raising=False)
    monkeypatch.delenv("ISLANDS_TRUSTED_MODULES", raising=False)
    weights = tmp_path / "features.safetensors"
    assert main(["eval", str(gmm_run[0]), "--num", "200", "--metrics", "fd", "--quiet", "--feature-net", factory,
                 "--feature-weights", str(weights)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "set ISLANDS_TRUSTED_MODULES=island_features" in err, err
    monkeypatch.setenv("ISLANDS_TRUSTED_MODULES", "torchvision, island_features_extra")  # others, not this one
    with pytest.raises(ConfigError, match="set ISLANDS_TRUSTED_MODULES=torchvision,island_features_extra,island_fe"):
        load_torch_features(factory, weights)
    assert not (tmp_path / "imported").exists()  # never imported, not even to look

    monkeypatch.setenv("ISLANDS_TRUSTED_MODULES", "torchvision,island_features")
    assert load_torch_features(factory, weights).name.startswith("torch-island_features.build-")
    assert (tmp_path / "imported").exists()
    package = tmp_path / "trusted_package"  # a name trusts the modules below it
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text("import torch\n\n\ndef build():\n    return torch.nn.Linear(2, 4)\n")
    monkeypatch.setenv("ISLANDS_TRUSTED_MODULES", "trusted_package")
    assert load_torch_features("trusted_package.nets:build", weights).name.startswith("torch-trusted_package.nets")
    with pytest.raises(ConfigError, match="'this:x' names module 'this'"):
        load_torch_features("this:x", weights)


def test_an_evaluator_on_pixels_scores_the_data_against_itself_near_zero(tmp_path, monkeypatch):
    from islands.data.gmm import GMMSource

    monkeypatch.setenv("ISLANDS_CACHE", str(tmp_path))
    source = GMMSource([[2.0, 0.0], [-2.0, 0.0]], 0.3, size=4000, seed=0)
    evaluator = Evaluator(source, EvalConfig(metrics=["fd", "nll", "mode_mass"]), seed=0)
    fresh = GMMSource([[2.0, 0.0], [-2.0, 0.0]], 0.3, size=4000, seed=1)
    result = evaluator([(fresh.x, None)])
    assert result["fd"] < 0.01 and result["mode_mass_error"] < 0.03
    assert result["nll"] == pytest.approx(result["nll_data"], abs=0.05)
    assert isinstance(evaluator.features, Pixels)
    # the data's statistics are cached per data set and feature network, and read back the same
    cached, = (tmp_path / "stats").glob("*-pixels.npz")
    again = Evaluator(source, EvalConfig(metrics=["fd"]), seed=0)([(fresh.x, None)])
    assert again["fd"] == result["fd"]
    metrics.GaussianStats(np.zeros(2), np.eye(2), 2).save(cached)  # what a stale cache would hold
    assert Evaluator(source, EvalConfig(metrics=["fd"]), seed=0)([(fresh.x, None)])["fd"] != result["fd"]


def test_sampling_time_counts_the_producer_not_the_consumer():
    def slow_batches():
        for i in range(3):
            time.sleep(0.05)
            yield i

    clock = {}
    for _ in timed(slow_batches(), clock):
        time.sleep(0.2)  # scoring the batch: not sampling
    assert 0.15 <= clock["seconds"] < 0.35, clock


def test_a_run_that_evaluates_with_an_untrusted_module_stops_before_it_trains(tmp_path, capsys, monkeypatch):
    """The trainer builds its feature network at its first evaluation; a module this machine does not trust is
    refused at the start instead, before a step is spent or a checkpoint written (issue 35, item 1)."""
    factory = a_feature_module(tmp_path, "untrusted_features")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "untrusted_features", raising=False)
    monkeypatch.delenv("ISLANDS_TRUSTED_MODULES", raising=False)
    cfg = gmm_config(tmp_path / "run", every=640)
    cfg["eval"].update(features="torch", feature_net=factory, feature_weights=str(tmp_path / "w.safetensors"))
    assert main(["train", write_config(tmp_path / "c.yaml", cfg), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "set ISLANDS_TRUSTED_MODULES=untrusted_features" in err, err
    assert not (tmp_path / "imported").exists()  # never imported, not even to look
    assert latest_checkpoint(tmp_path / "run") is None
