"""A whole Decentralized Diffusion Model on a 2-D mixture whose clusters are known: `islands ddm` end to end,
the router against the exact posterior, and islands that fail or lie. (The routing math: test_mixture.py;
the partition: test_partition.py.)"""

import json
import os
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml
from conftest import a_feature_module, run_ranks

from islands.cli import main
from islands.config import to_dict, trajectory_changes, validate
from islands.data import build_data
from islands.data.gmm import GaussianMixture
from islands.ddm.ensemble import file_sha256, load_ensemble, read_manifest, write_manifest
from islands.ddm.partition import Partition
from islands.ddm.pipeline import sample_and_evaluate
from islands.ddm.runs import expert_config, router_config
from islands.ddm.sampling import open_sampler
from islands.errors import CheckpointError, ConfigError, IslandsWarning
from islands.rundir import latest_checkpoint, read_state

MEANS = [[2.0, 2.0], [-2.0, 2.0], [-2.0, -2.0], [2.0, -2.0]]
WEIGHTS = [0.4, 0.3, 0.2, 0.1]
ROUTER_TV = 0.07  # the fixture's router (400 steps) against the exact posterior, at every t of its report


def ddm_config(run_dir) -> dict:
    return {"run_dir": str(run_dir), "seed": 1,
            "data": {"source": "gmm", "means": MEANS, "std": 0.3, "weights": WEIGHTS, "size": 4000},
            "model": {"arch": "mlp", "hidden": 64, "depth": 3},
            "train": {"images": 12800, "batch_size": 128, "lr": 2e-3, "ema_halflife_images": 1000,
                      "checkpoint_every": 6400, "log_every": 3200},
            "sample": {"num": 64, "steps": 12},
            "eval": {"num": 1000},
            "ddm": {"k": 4, "partition": {"fine": 64, "balanced": False},
                    "router": {"images": 25600, "batch_size": 64, "lr": 2e-3, "hidden": 64, "depth": 3}}}


def command_line(run_dir) -> list[str]:
    """Keys the fixture's config file leaves out and gives only on the command line."""
    return [f"run_dir={run_dir}", "train.images=12800", "ddm.k=4"]


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddm")
    bare = ddm_config(root / "ensemble")
    del bare["run_dir"], bare["train"]["images"], bare["ddm"]["k"]  # the defaults would be 10000 images, k = 0
    path = root / "ddm.yaml"
    path.write_text(yaml.safe_dump(bare))
    overrides = command_line(root / "ensemble")
    # Islands need not agree on conventions: expert 3 is trained on its own, on the cosine path with epsilon
    # prediction; `islands ddm` then skips it and the ensemble meets it in velocity space.
    assert main(["partition", str(path), *overrides, "--quiet"]) == 0
    assert main(["train", str(path), "expert=3", *overrides, "flow.path=cosine", "flow.prediction=epsilon",
                 "--quiet"]) == 0
    assert main(["ddm", str(path), *overrides, "--jobs", "2", "--quiet"]) == 0
    return validate(ddm_config(root / "ensemble")), root / "ensemble"


def test_one_opening_serves_an_ensemble_and_its_members(ensemble):
    """open_sampler: an ensemble's experts are called with one model's batch (sample.batch_size) and never more, so
    a one-expert policy draws K batches at once; a member opens as a plain run, which takes no routing; ancestral
    samples do not depend on how many are drawn at once."""
    cfg, root = ensemble
    routed = open_sampler(root, routing="top1")
    assert routed.denoiser.call_batch == cfg.sample.batch_size and routed.opts.batch_size == 4 * cfg.sample.batch_size
    member = open_sampler(root / "experts" / "0")
    assert member.manifest is None and member.shape == routed.shape == (2,)
    with pytest.raises(ConfigError, match="--routing"):
        open_sampler(root / "experts" / "0", routing="top1")
    narrow, wide = open_sampler(root, {"batch_size": 3, "steps": 4}), open_sampler(root, {"steps": 4})
    assert torch.equal(narrow.generate(10), wide.generate(10))


def test_every_member_trains_on_the_config_the_ensemble_was_built_from(ensemble):
    """run_dir, train.images and ddm.k came from the command line only: every member's own config shows them."""
    cfg, root = ensemble
    assert yaml.safe_load((root / "config.yaml").read_text()) == to_dict(cfg)
    for k in range(4):
        member = yaml.safe_load((root / "experts" / str(k) / "config.yaml").read_text())
        assert member["run_dir"] == str(root / "experts" / str(k))
        assert member["data"]["partition"] == str(root / "partition") and member["data"]["cluster"] == k
        assert member["train"]["batch_size"] == 32 and member["train"]["images"] == 3200  # 128 / k, 12800 / k
    router = yaml.safe_load((root / "router" / "config.yaml").read_text())
    assert router["run_dir"] == str(root / "router") and router["model"]["outputs"] == 4
    assert sorted(p.name for p in (root / "logs").glob("*.log")) == ["expert0.log", "expert1.log", "expert2.log",
                                                                    "router.log"]


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
    assert [(e.path, e.prediction) for e in manifest.experts] == [("rectified_flow", "velocity")] * 3 + \
        [("cosine", "epsilon")]
    (key, ancestral), = json.loads((root / "metrics.json").read_text()).items()
    assert "routing=ancestral" in key  # the default policy: each sample's expert drawn from the cluster sizes
    assert ancestral["mode_mass_error"] < 0.04 and min(ancestral["mode_mass"]) > 0.05
    assert ancestral["expert_evaluations_per_sample"] == 23  # heun, 12 steps: one expert per evaluation
    assert ancestral["router_evaluations_per_sample"] == 0  # ancestral routing never asks the router
    assert 0 < ancestral["seconds_per_sample"] < 1
    top1 = sample_and_evaluate(cfg, "top1", progress=False)
    assert min(top1["mode_mass"]) > 0.005  # top-1 favours the big cluster at t = 1, but reaches every mode
    assert top1["expert_evaluations_per_sample"] == top1["router_evaluations_per_sample"] == 23
    for picture in ("ancestral.png", "top1.png"):
        assert (root / "samples" / picture).stat().st_size > 0
    assert (root / "partition" / "clusters.png").exists()


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
    by_class = np.array(read_manifest(root).prior_by_class)
    assert np.allclose(by_class[component_of_cluster(root), range(4)], 1.0)


def test_the_router_budget_is_a_share_of_the_experts_flops(ensemble):
    """Without ddm.router.images, the router trains for flops_fraction of what the experts cost, in whole batches:
    checked against the flops.json every trained member wrote."""
    cfg, root = ensemble
    raw = to_dict(cfg)
    raw["ddm"]["router"].update(images=None, flops_fraction=0.5)
    images = router_config(validate(raw)).train.images
    experts = sum(json.loads((root / "experts" / str(k) / "flops.json").read_text())["training_flops"]
                  for k in range(4))
    per_image = json.loads((root / "router" / "flops.json").read_text())["flops_per_image"]
    assert images % 64 == 0 and images == pytest.approx(0.5 * experts / per_image, abs=64)
    assert router_config(validate(raw)).train.ema_halflife_images == pytest.approx(0.1 * images)
    assert router_config(validate(raw)).train.ema_rampup is None  # which would cap the half-life at 5%
    raw["ddm"]["router"].update(images=640)
    assert router_config(validate(raw)).train.images == 640  # a fixed length, when given
    raw["ddm"]["router"].update(hidden=None)  # the default width for vectors: a quarter of the experts'
    assert router_config(validate(raw)).model.hidden == 16 and cfg.model.hidden == 64


def test_the_trained_router_approaches_the_exact_posterior(ensemble):
    cfg, root = ensemble
    component = component_of_cluster(root)
    mixture, _ = load_ensemble(root, "full")
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
    assert all(d < p / 3 for d, p in zip(distances, prior_distances, strict=True)), (distances, prior_distances)
    report = json.loads((root / "router" / "router_accuracy.json").read_text())
    assert report["accuracy"][0] > 0.95 and report["accuracy"][-1] < 0.6  # sharp at t ~ 0, the prior at t ~ 1
    # against the training set's exact posterior (islands.data.posterior) at t = 0.05, 0.15, ..., 0.95
    assert report["t"] == pytest.approx([0.05 + 0.1 * b for b in range(10)])
    assert max(report["tv"]) < ROUTER_TV, report["tv"]
    assert all(0 <= e < 0.1 for e in report["ece"]) and all(kl >= 0 for kl in report["kl"])
    # no router beats the exact posterior
    assert all(a <= e + 0.03 for a, e in zip(report["accuracy"], report["exact_accuracy"], strict=True))


def test_a_router_from_before_the_prior_anchor_is_refused_by_name(ensemble, tmp_path, capsys):
    """Its logits were never multiplied by 1 - t: read as anchored they would route wrongly, silently."""
    from safetensors.torch import load_file, save_file

    cfg, root = ensemble
    copy = tmp_path / "ensemble"
    shutil.copytree(root, copy)
    weights = copy / read_manifest(copy).router.weights
    save_file({k: v for k, v in load_file(weights).items() if k != "anchor.log_prior"}, weights)
    write_manifest(cfg.model_copy(update={"run_dir": str(copy)}))  # the hashes of the files as they are now
    assert main(["sample", str(copy), "--num", "8", "--out", str(tmp_path / "out"), "--routing", "full",
                 "--quiet"]) == 2
    assert "trained before routers were anchored at the prior" in capsys.readouterr().err
    assert main(["sample", str(copy), "--num", "8", "--out", str(tmp_path / "out"), "--quiet"]) == 0  # no router
    assert main(["sample", str(copy), "--num", "8", "--out", str(tmp_path / "out2"), "--routing", "best"]) == 2
    assert "config error: --routing: 'best' is not a routing policy" in capsys.readouterr().err
    assert not (tmp_path / "out2").exists()


def test_a_missing_expert_is_survived_with_one_line_for_people_and_a_warning_for_callers(ensemble, tmp_path, capsys):
    _, root = ensemble
    copy = tmp_path / "ensemble"
    shutil.copytree(root, copy)
    manifest = read_manifest(copy)
    weights = copy / manifest.experts[2].weights
    weights.unlink()
    assert main(["sample", str(copy), "--num", "40", "--out", str(tmp_path / "out"), "--quiet",
                 "--routing", "full"]) == 0
    out, err = capsys.readouterr()
    assert err == f"islands: warning: expert2 is missing from disk ({weights}); routing around it\n"
    assert "expert evaluations per sample: 69.0" in out  # 3 experts x 23 evaluations
    assert np.isfinite(np.load(tmp_path / "out" / "samples.npz")["x"]).all()
    mixture, _ = load_ensemble(copy, "full")
    with pytest.warns(IslandsWarning, match="expert2 is missing from disk"):  # the library's callers get a warning
        mixture(torch.zeros(2, 2), torch.full((2,), 0.5))


def test_an_expert_that_never_finished_is_named_and_routed_around(ensemble, tmp_path, capsys):
    cfg, root = ensemble
    copy = tmp_path / "ensemble"
    shutil.copytree(root, copy)
    shutil.rmtree(copy / "experts" / "1" / "checkpoints")  # it started, and stopped before its first checkpoint

    assert "weights" not in write_manifest(cfg.model_copy(update={"run_dir": str(copy)}))["experts"][1]
    assert main(["sample", str(copy), "--num", "8", "--out", str(tmp_path / "out"), "--quiet"]) == 0
    err = capsys.readouterr().err
    missing = copy / "experts" / "1"
    assert err == f"islands: warning: expert1 has no finished checkpoint ({missing}); routing around it\n"


def test_a_member_that_crashes_exits_1_naming_it_its_status_and_its_log(ensemble, tmp_path, capsys):
    _, root = ensemble
    copy = tmp_path / "ensemble"
    shutil.copytree(root, copy)
    shutil.rmtree(copy / "experts" / "1")
    (copy / "experts" / "1").mkdir()
    (copy / "experts" / "1" / "checkpoints").write_text("a file where its checkpoints should go")
    assert main(["ddm", str(copy / "config.yaml"), f"run_dir={copy}", "--quiet"]) == 1
    err = capsys.readouterr().err
    log = copy / "logs" / "expert1.log"
    assert err.count("\n") == 1 and err.startswith("islands: ddm: expert1 failed with exit status 1")
    # the member's own line, which names the checkpoint it could not write, is the last line of its log
    assert f"log: {log}; last line: 'islands: cannot write checkpoint {copy / 'experts' / '1' / 'checkpoints'}" in err
    assert log.read_text().splitlines()[-1].startswith("islands: cannot write checkpoint")


def test_a_tampered_expert_and_a_pickle_posing_as_one_are_refused(ensemble, tmp_path):
    _, root = ensemble
    copy = tmp_path / "ensemble"
    shutil.copytree(root, copy)
    manifest = json.loads((copy / "ensemble.json").read_text())  # the file, as a lying island edits it
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


def test_an_expert_swapped_after_the_ensemble_was_opened_is_refused_when_it_is_loaded_again(ensemble, tmp_path):
    """--max-loaded drops experts and builds them again: every load checks the file, not only the first."""
    _, root = ensemble
    copy = tmp_path / "ensemble"
    shutil.copytree(root, copy)
    manifest = read_manifest(copy)
    mixture, _ = load_ensemble(copy, "full", max_loaded=1)
    x, t = torch.zeros(2, 2), torch.full((2,), 0.5)
    mixture(x, t)  # every expert built in turn, each dropped for the next
    first = copy / manifest.experts[0].weights
    shutil.copyfile(copy / manifest.experts[1].weights, first)  # a valid expert of the same shape, another one
    with pytest.raises(CheckpointError, match=f"{first}: sha256 does not match"):
        mixture(x, t)


@pytest.mark.parametrize("member,where", [("expert1", "parent"), ("expert1", "absolute"), ("expert1", "symlink"),
                                          ("router", "parent")])
def test_a_manifest_entry_that_leads_out_of_the_ensemble_folder_is_refused(ensemble, tmp_path, capsys, member, where):
    _, root = ensemble
    copy = tmp_path / "ensemble"
    shutil.copytree(root, copy)
    manifest = json.loads((copy / "ensemble.json").read_text())  # the file, as a hostile island edits it
    entry = manifest["router"] if member == "router" else manifest["experts"][1]
    outside = tmp_path / "x.safetensors"
    shutil.copyfile(copy / entry["weights"], outside)  # the same bytes: the manifest's sha256 holds for it
    if where == "symlink":
        (copy / entry["weights"]).unlink()
        (copy / entry["weights"]).symlink_to(outside)
    else:
        entry["weights"] = "../x.safetensors" if where == "parent" else str(outside)
        (copy / "ensemble.json").write_text(json.dumps(manifest))
    code = main(["sample", str(copy), "--num", "8", "--steps", "2", "--routing", "full", "--out",
                 str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"{member}'s weights {entry['weights']} lie outside {copy}" in err


def test_distill_imports_no_feature_module_named_only_by_the_ensemble_folder(ensemble, tmp_path, capsys, monkeypatch):
    """The student's evaluations would build the feature network the ensemble's config.yaml names: only if the user
    names it too."""
    _, root = ensemble
    copy = tmp_path / "ensemble"
    shutil.copytree(root, copy)
    factory = a_feature_module(tmp_path, "ensemble_features")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ensemble_features", raising=False)
    cfg = yaml.safe_load((copy / "config.yaml").read_text())
    cfg["eval"].update(features="torch", feature_net=factory, feature_weights=str(tmp_path / "features.safetensors"))
    (copy / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["distill", str(copy), "train.images=256", "eval.every=256", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert not (tmp_path / "imported").exists()
    assert err.count("\n") == 1 and f"pass eval.feature_net={factory} to trust it" in err, err
    assert not (copy / "distilled").exists()


class _Payload:
    def __init__(self, mark):
        self.mark = mark

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.mark),))


def test_rerunning_skips_what_is_done(ensemble, tmp_path):
    _, root = ensemble
    path = tmp_path / "ddm.yaml"
    path.write_text(yaml.safe_dump(ddm_config(root)))
    before = {p: p.stat().st_mtime for p in root.glob("experts/*/checkpoints/*/ema.safetensors")}
    assert main(["ddm", str(path), "--quiet"]) == 0
    assert {p: p.stat().st_mtime for p in root.glob("experts/*/checkpoints/*/ema.safetensors")} == before


def test_emitted_scripts_train_an_island_from_the_ensemble_config(ensemble, tmp_path):
    """Each island runs its script where the shared folder is; the scripts find it through ENSEMBLE."""
    cfg, root = ensemble
    copy = tmp_path / "ensemble"
    shutil.copytree(root, copy)
    shutil.rmtree(copy / "experts" / "1")  # the island that still has to train
    assert main(["ddm", str(copy / "config.yaml"), f"run_dir={copy}", "--emit", "torchrun"]) == 0
    scripts = sorted(p.name for p in (copy / "launch").glob("*.sh"))
    assert scripts == ["0_partition.sh", "1_expert0.sh", "1_expert1.sh", "1_expert2.sh", "1_expert3.sh",
                       "2_router.sh", "3_ensemble.sh"]
    moved = tmp_path / "mounted-elsewhere"
    shutil.move(copy, moved)
    env = {**os.environ, "ENSEMBLE": str(moved), "NPROC": "1", "OMP_NUM_THREADS": "1"}
    for script in ("1_expert1.sh", "3_ensemble.sh"):
        done = subprocess.run(["bash", str(moved / "launch" / script), "--quiet"], env=env, capture_output=True,
                              text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-2000:]
    trained = yaml.safe_load((moved / "experts" / "1" / "config.yaml").read_text())
    assert trained == to_dict(expert_config(cfg.model_copy(update={"run_dir": str(moved)}), 1))
    assert read_manifest(moved).experts[1].weights.startswith("experts/1/checkpoints/")

    assert main(["ddm", str(moved / "config.yaml"), f"run_dir={moved}", "--emit", "slurm"]) == 0
    for script in (moved / "launch").glob("*.sh"):
        text = script.read_text()
        assert text.startswith("#!/bin/bash\n#SBATCH --job-name=islands-")
        assert f'ENSEMBLE="${{ENSEMBLE:-{moved}}}"' in text
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert "srun" in (moved / "launch" / "1_expert2.sh").read_text()


@pytest.mark.parametrize("overrides,message", [
    (["ddm.k=1"], "ddm.k: 1; a decentralized model needs at least 2 experts"),
    (["ddm.router.depth=0"], "ddm.router.depth: Input should be greater than 0"),
    (["ddm.expert_batch=3", "train.accumulate=2", "train.batch_size=128"], "ddm.expert_batch: 3 does not split"),
    (["ddm.partition.method=spectral"], "ddm.partition.method"),
])
def test_ddm_config_errors_exit_2_with_one_line_before_anything_is_written(tmp_path, capsys, overrides, message):
    path = tmp_path / "ddm.yaml"
    path.write_text(yaml.safe_dump(ddm_config(tmp_path / "new")))
    for command in (["ddm"], ["ddm", "--emit", "torchrun"], ["partition"]):
        if command == ["partition"] and "expert_batch" in message:
            continue  # partitioning needs no expert's batch
        assert main([command[0], str(path), *overrides, *command[1:], "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
        assert not (tmp_path / "new").exists()


def test_an_ensemble_folder_is_not_reused_for_another_config(ensemble, tmp_path, capsys):
    _, root = ensemble
    path = tmp_path / "ddm.yaml"
    path.write_text(yaml.safe_dump(ddm_config(root)))
    before = (root / "config.yaml").read_bytes()
    assert main(["ddm", str(path), "train.lr=0.1", "--quiet"]) == 2
    assert "holds an ensemble with another config (train.lr: 0.002 -> 0.1)" in capsys.readouterr().err
    assert (root / "config.yaml").read_bytes() == before


@pytest.mark.parametrize("teacher,routing", [("cluster", "ancestral"), ("full", "full")])
def test_distillation_learns_the_ensemble_in_one_network(ensemble, tmp_path, teacher, routing):
    cfg, root = ensemble
    copy = tmp_path / "ensemble"
    shutil.copytree(root, copy)
    assert main(["distill", str(copy), "train.images=12800", "eval.every=12800", "--teacher", teacher, "--quiet"]) == 0
    # the manifest points inside the copied ensemble: relative paths, so islands can be moved whole
    student = json.loads((copy / "distilled" / "eval.jsonl").read_text().splitlines()[-1])
    own = sample_and_evaluate(cfg.model_copy(update={"run_dir": str(copy)}), routing, progress=False)
    # as near every mode's weight as the teacher it learned from: 1000 samples move a mode's mass by ~0.015
    assert student["mode_mass_error"] < own["mode_mass_error"] + 0.03 and student["precision"] > 0.5
    # `islands eval` judges the student on the data itself, as training did, not on its cluster-labelled view
    assert main(["eval", str(copy / "distilled"), "--quiet"]) == 0
    (again,) = json.loads((copy / "distilled" / "metrics.json").read_text()).values()
    assert again["mode_mass_error"] == pytest.approx(student["mode_mass_error"], rel=1e-6)
    config = yaml.safe_load((copy / "distilled" / "config.yaml").read_text())
    assert config["train"]["objective"] == "distill" and config["train"]["teacher"] == teacher
    assert config["data"]["cluster"] is None
    # the teacher's cost is in the student's FLOPs: one expert per image, or all four and the router
    expert = json.loads((copy / "experts" / "0" / "flops.json").read_text())["flops_per_image"]
    distilled = json.loads((copy / "distilled" / "flops.json").read_text())["flops_per_image"]
    router = json.loads((copy / "router" / "flops.json").read_text())["flops_per_image"]
    teaching = expert / 3 if teacher == "cluster" else 4 * expert / 3 + router / 3  # a forward is ~1/3 of a step
    assert distilled == pytest.approx(expert + teaching, rel=0.1)


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
    extra_images = mono["images"] - cfg.train.images
    assert extra_images == pytest.approx(router / mono["flops_per_image"], abs=cfg.train.batch_size)
    assert table["expert_evaluations_per_sample"] == {"ensemble": 23, "monolith": 23}
    assert (root / "comparison.png").stat().st_size > 0


@pytest.mark.parametrize("routing", ["full", "ancestral"])  # the most traffic, and the default
def test_experts_spread_over_two_ranks_sample_what_one_process_samples(ensemble, tmp_path, capsys, routing):
    """torchrun ... islands sample ENSEMBLE --distributed: each rank owns two of the four experts, routes its half
    of the samples, and sends every (sample, expert) pair to the expert's rank and the velocity back."""
    _, root = ensemble
    assert main(["sample", str(root), "--num", "30", "--routing", routing, "--out", str(tmp_path / "one"),
                 "--quiet"]) == 0
    capsys.readouterr()
    ranks = run_ranks(["sample", str(root), "--num", "30", "--routing", routing, "--distributed", "--out",
                       str(tmp_path / "two"), "--quiet"])
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-2000:] for r in ranks]
    run = ranks[0]
    one, two = (np.load(tmp_path / name / "samples.npz")["x"] for name in ("one", "two"))
    assert one.shape == two.shape == (30, 2) and np.allclose(one, two, atol=1e-5), np.abs(one - two).max()
    moved = float(run.stdout.split("images/s, ")[1].split(" MB")[0])
    assert "2 ranks:" in run.stdout and moved > 0  # samples really travelled to the other rank's experts


def tiny_ddm_config() -> dict:
    """Two experts of 256 images each on a 2-D mixture of two modes: an ensemble built in seconds."""
    return {"seed": 1, "data": {"source": "gmm", "means": [[2.0, 2.0], [-2.0, -2.0]], "std": 0.3, "size": 2000},
            "model": {"arch": "mlp", "hidden": 16, "depth": 2},
            "train": {"images": 512, "batch_size": 64, "lr": 2e-3, "ema_halflife_images": 100,
                      "checkpoint_every": 256, "log_every": 256},
            "sample": {"num": 16, "steps": 4}, "eval": {"num": 200},
            "ddm": {"k": 2, "partition": {"fine": 16, "balanced": False},
                    "router": {"images": 128, "batch_size": 64, "hidden": 16, "depth": 2}}}


@pytest.fixture(scope="module")
def relative_ensemble(tmp_path_factory):
    """`islands ddm ddm.yaml run_dir=ens`, run in the folder that holds both; its first attempt named a class count
    the data does not have, so every member failed before its first checkpoint, and the second corrected it.
    -> (the folder, the exit status of each attempt)."""
    where = tmp_path_factory.mktemp("relative")
    (where / "ddm.yaml").write_text(yaml.safe_dump(tiny_ddm_config()))
    cwd = os.getcwd()
    os.chdir(where)
    try:
        codes = [main(["ddm", "ddm.yaml", "run_dir=ens", *wrong, "--quiet"]) for wrong in (["model.num_classes=5"], [])]
    finally:
        os.chdir(cwd)
    return where, codes


def test_an_ensemble_whose_members_all_failed_takes_a_corrected_config(relative_ensemble):
    where, codes = relative_ensemble
    assert codes == [1, 0]  # a member failed; then the corrected config was taken and the ensemble built
    assert "model.num_classes: 5 does not match" in (where / "ens" / "logs" / "expert0.log").read_text()
    assert yaml.safe_load((where / "ens" / "config.yaml").read_text())["model"]["num_classes"] == 0
    assert (where / "ens" / "ensemble.json").exists()


def test_an_expert_half_trained_by_islands_ddm_resumes_from_its_emitted_script(relative_ensemble, tmp_path):
    """`islands ddm` ran with run_dir=ens, so the experts' configs name their partition 'ens/partition'; the emitted
    script names it by its absolute path, and another island may mount the folder elsewhere: the same partition."""
    where, _ = relative_ensemble
    root = where / "ens"
    assert yaml.safe_load((root / "experts" / "0" / "config.yaml").read_text())["data"]["partition"] == "ens/partition"
    assert main(["ddm", str(root / "config.yaml"), f"run_dir={root}", "--emit", "torchrun"]) == 0
    moved = tmp_path / "mounted-elsewhere"
    shutil.copytree(root, moved)
    env = {**os.environ, "ENSEMBLE": str(moved), "NPROC": "1", "OMP_NUM_THREADS": "1"}
    # twice the ensemble's images: expert 0 goes on from its checkpoint at 256 images to 512
    done = subprocess.run(["bash", str(moved / "launch" / "1_expert0.sh"), "train.images=1024", "--quiet"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    expert = moved / "experts" / "0"
    assert read_state(latest_checkpoint(expert)).progress["images"] == 512
    logged = [json.loads(line)["images"] for line in (expert / "metrics.jsonl").read_text().splitlines()]
    assert logged == [128, 256, 384, 512]  # resumed at 256, not begun again
    assert yaml.safe_load((expert / "config.yaml").read_text())["data"]["partition"] == f"{moved}/partition"


def test_a_partition_is_compared_where_it_lies_beside_the_run_not_as_spelled():
    def resolved(run_dir: str, partition: str) -> dict:
        return to_dict(validate({"run_dir": run_dir, "data": {"partition": partition, "cluster": 0}}))

    expert = resolved("ens/experts/0", "ens/partition")
    assert trajectory_changes(expert, resolved("/mnt/x/ens/experts/0", "/mnt/x/ens/partition")) == []
    assert trajectory_changes(expert, resolved("/mnt/x/ens/experts/0", "/mnt/x/other/partition")) == [
        "data.partition: 'ens/partition' -> '/mnt/x/other/partition'"]
    assert trajectory_changes(resolved("a", "/p"), resolved("b", "/p")) == []  # as written: the same folder
