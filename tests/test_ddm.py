"""A whole Decentralized Diffusion Model on a 2-D mixture whose clusters are known: `islands ddm` end to end,
the router against the exact posterior, and islands that fail or lie. (The routing math: test_mixture.py;
the partition: test_partition.py.)"""

import json
import pickle
import shutil
import warnings

import numpy as np
import pytest
import torch
import yaml

from islands.cli import main
from islands.config import validate
from islands.data import build_data
from islands.data.gmm import GaussianMixture
from islands.ddm.ensemble import file_sha256, load_ensemble, read_manifest
from islands.ddm.partition import Partition
from islands.ddm.pipeline import sample_and_evaluate
from islands.ddm.runs import expert_config, router_config
from islands.train.checkpoint import CheckpointError

MEANS = [[2.0, 2.0], [-2.0, 2.0], [-2.0, -2.0], [2.0, -2.0]]
WEIGHTS = [0.4, 0.3, 0.2, 0.1]


def ddm_config(run_dir) -> dict:
    return {"run_dir": str(run_dir), "seed": 1,
            "data": {"source": "gmm", "means": MEANS, "std": 0.3, "weights": WEIGHTS, "size": 4000},
            "model": {"arch": "mlp", "hidden": 64, "depth": 3},
            "train": {"images": 12800, "batch_size": 128, "lr": 2e-3, "ema_halflife_images": 1000,
                      "checkpoint_every": 6400, "log_every": 3200},
            "sample": {"num": 64, "steps": 12},
            "eval": {"num": 1000},
            "ddm": {"k": 4, "partition": {"fine": 64, "balanced": False},
                    "router": {"images": 12800, "batch_size": 128, "lr": 2e-3, "hidden": 64, "depth": 3}}}


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddm")
    path = root / "ddm.yaml"
    path.write_text(yaml.safe_dump(ddm_config(root / "ensemble")))
    # Islands need not agree on conventions: expert 3 is trained on its own, on the cosine path with epsilon
    # prediction; `islands ddm` then skips it and the ensemble meets it in velocity space.
    assert main(["partition", str(path), "--quiet"]) == 0
    assert main(["train", str(path), "expert=3", "flow.path=cosine", "flow.prediction=epsilon", "--quiet"]) == 0
    assert main(["ddm", str(path), "--jobs", "2", "--quiet"]) == 0
    return validate(ddm_config(root / "ensemble")), root / "ensemble"


def component_of_cluster(root) -> list[int]:
    """The mixture component each cluster holds (the partition must have found them)."""
    part = Partition.load(root / "partition")
    source = build_data(validate(ddm_config(root)).data, 1)
    labels = source.get(list(range(len(source))))[1].numpy()
    table = np.zeros((4, 4), dtype=int)
    np.add.at(table, (part.cluster, labels), 1)
    assert (table > 0).sum() == 4, f"clusters are not the components:\n{table}"
    return table.argmax(1).tolist()


def test_the_ensemble_samples_every_mode_and_records_its_cost(ensemble):
    cfg, root = ensemble
    manifest = read_manifest(root)
    assert [(e["path"], e["prediction"]) for e in manifest["experts"]] == [("rectified_flow", "velocity")] * 3 + \
        [("cosine", "epsilon")]
    (key, top1), = json.loads((root / "metrics.json").read_text()).items()
    assert "routing=top1" in key
    assert min(top1["mode_mass"]) > 0.005  # top-1 favours the big cluster at t = 1, but reaches every mode
    assert top1["expert_evaluations_per_sample"] == 23  # heun, 12 steps: one expert per evaluation
    assert 0 < top1["seconds_per_sample"] < 1
    oracle = sample_and_evaluate(cfg, "oracle", progress=False)
    assert oracle["mode_mass_error"] < 0.04 and min(oracle["mode_mass"]) > 0.05
    assert (root / "samples" / "top1.png").stat().st_size > 0 and (root / "partition" / "clusters.png").exists()


def test_experts_see_only_their_cluster_and_cost_what_the_monolith_costs(ensemble):
    cfg, root = ensemble
    sizes = json.loads((root / "partition" / "partition.json").read_text())["sizes"]
    per_image, total = [], 0.0
    for k in range(4):
        expert = expert_config(cfg, k)
        assert len(build_data(expert.data, cfg.seed)) == sizes[k]
        assert expert.train.batch_size == 32 and expert.train.images == 3200  # compute parity
        flops = json.loads((root / "experts" / str(k) / "flops.json").read_text())
        per_image.append(flops["flops_per_image"])
        total += flops["training_flops"]
    assert len(set(per_image)) == 1  # the same network on the same shapes
    assert total == pytest.approx(per_image[0] * cfg.train.images)  # = the monolith of this config
    router = json.loads((root / "router" / "flops.json").read_text())
    assert router["training_flops"] > 0 and router_config(cfg).train.objective == "router"
    # the manifest's p(cluster | class): every component lies whole in its own cluster
    by_class = np.array(read_manifest(root)["prior_by_class"])
    assert np.allclose(by_class[component_of_cluster(root), range(4)], 1.0)


def test_the_trained_router_approaches_the_exact_posterior(ensemble):
    cfg, root = ensemble
    component = component_of_cluster(root)
    mixture, _ = load_ensemble(root)
    gmm = GaussianMixture(MEANS, 0.3, WEIGHTS)
    g = torch.Generator().manual_seed(0)
    distances, prior_distances = [], []
    for t in (0.2, 0.5, 0.8):
        x0, _ = gmm.sample(2000, g)
        x_t = (1 - t) * x0 + t * torch.randn(x0.shape, generator=g, dtype=x0.dtype)
        exact = gmm.posterior(x_t, torch.full((2000,), t, dtype=x0.dtype))[:, component]
        learned = mixture.router(x_t.float(), torch.full((2000,), t)).double()
        prior = torch.tensor(WEIGHTS, dtype=torch.float64)[component].expand_as(exact)
        distances.append(0.5 * (learned - exact).abs().sum(1).mean().item())
        prior_distances.append(0.5 * (prior - exact).abs().sum(1).mean().item())
    assert max(distances) < 0.1, distances  # mean total variation to the exact p(k | x_t, t)
    assert all(d < p / 3 for d, p in zip(distances, prior_distances)), (distances, prior_distances)
    accuracy = json.loads((root / "router" / "router_accuracy.json").read_text())
    assert accuracy["accuracy"][0] > 0.95 and accuracy["accuracy"][-1] < 0.6  # sharp at t ~ 0, the prior at t ~ 1


def test_a_missing_expert_is_survived_with_a_warning(ensemble, tmp_path, capsys):
    _, root = ensemble
    copy = tmp_path / "ensemble"
    shutil.copytree(root, copy)
    manifest = read_manifest(copy)
    (copy / manifest["experts"][2]["weights"]).unlink()
    with pytest.warns(UserWarning, match="expert2 is missing"):
        assert main(["sample", str(copy), "--num", "40", "--out", str(tmp_path / "out"), "--quiet",
                     "--routing", "full"]) == 0
    assert "expert evaluations per sample: 69.0" in capsys.readouterr().out  # 3 experts x 23 evaluations
    assert np.isfinite(np.load(tmp_path / "out" / "samples.npz")["x"]).all()


def test_a_tampered_expert_and_a_pickle_posing_as_one_are_refused(ensemble, tmp_path):
    _, root = ensemble
    copy = tmp_path / "ensemble"
    shutil.copytree(root, copy)
    manifest = read_manifest(copy)
    weights = copy / manifest["experts"][1]["weights"]
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{weights}: sha256 does not match"):
        load_ensemble(copy)

    marker = tmp_path / "pwned"
    weights.write_bytes(pickle.dumps(_Payload(str(marker)), protocol=2))
    manifest["experts"][1]["sha256"] = file_sha256(weights)  # a lying island signs its own file
    (copy / "ensemble.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        load_ensemble(copy)
    assert not marker.exists()


class _Payload:
    def __init__(self, mark):
        self.mark = mark

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.mark),))


def test_rerunning_skips_what_is_done_and_emit_writes_a_script_per_island(ensemble, tmp_path, capsys):
    cfg, root = ensemble
    path = tmp_path / "ddm.yaml"
    path.write_text(yaml.safe_dump(ddm_config(root)))
    before = {p: p.stat().st_mtime for p in root.glob("experts/*/checkpoints/*/ema.safetensors")}
    with warnings.catch_warnings():
        assert main(["ddm", str(path), "--quiet"]) == 0
    assert {p: p.stat().st_mtime for p in root.glob("experts/*/checkpoints/*/ema.safetensors")} == before
    assert main(["ddm", str(path), "--emit", "slurm"]) == 0
    scripts = sorted(p.name for p in (root / "launch").glob("*.sh"))
    assert scripts == ["0_partition.sh", "1_expert0.sh", "1_expert1.sh", "1_expert2.sh", "1_expert3.sh",
                       "2_router.sh", "3_ensemble.sh"]
    assert "expert=2" in (root / "launch" / "1_expert2.sh").read_text()


def test_distillation_learns_the_ensemble_in_one_network(ensemble, tmp_path):
    cfg, root = ensemble
    copy = tmp_path / "ensemble"
    shutil.copytree(root, copy)
    assert main(["distill", str(copy), "train.images=12800", "eval.every=12800", "--quiet"]) == 0
    # the manifest points inside the copied ensemble: relative paths, so islands can be moved whole
    student = json.loads((copy / "distilled" / "eval.jsonl").read_text().splitlines()[-1])
    assert student["mode_mass_error"] < 0.1 and student["precision"] > 0.5  # every mode near its weight
    teacherless = json.loads((copy / "experts" / "0" / "flops.json").read_text())["flops_per_image"]
    assert json.loads((copy / "distilled" / "flops.json").read_text())["flops_per_image"] > teacherless
    config = yaml.safe_load((copy / "distilled" / "config.yaml").read_text())
    assert config["train"]["objective"] == "distill" and config["data"]["cluster"] is None


def test_the_monolith_of_the_same_budget_is_trained_and_compared_side_by_side(ensemble, tmp_path):
    cfg, root = ensemble
    path = tmp_path / "ddm.yaml"
    path.write_text(yaml.safe_dump(ddm_config(root)))
    assert main(["ddm", str(path), "ddm.monolith=true", "--quiet"]) == 0
    table = json.loads((root / "comparison.json").read_text())
    assert {"fd", "nll", "mode_mass_error", "training_flops", "expert_evaluations_per_sample"} <= set(table)
    router = json.loads((root / "router" / "flops.json").read_text())["training_flops"]
    mono = json.loads((root / "monolith" / "flops.json").read_text())
    # the monolith costs what the experts (one of them on another path, the same network) and the router cost
    # together, rounded up to whole batches: the router's FLOPs bought it more images than the config's
    batch_flops = mono["flops_per_image"] * cfg.train.batch_size
    assert 0 <= table["training_flops"]["monolith"] - table["training_flops"]["ensemble"] < batch_flops
    assert mono["images"] - cfg.train.images == pytest.approx(router / mono["flops_per_image"], abs=cfg.train.batch_size)
    assert table["expert_evaluations_per_sample"] == {"ensemble": 23, "monolith": 23}
    assert (root / "comparison.png").stat().st_size > 0
