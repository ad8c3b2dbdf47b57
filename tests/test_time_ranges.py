"""Timestep-range experts: the gate by t, grids that put a step on every boundary, the derived runs, eDiff-I's
initialisation from a run trained on all t, two range experts that together sample a mixture's modes, and a
cluster x range grid of decentralized experts."""

import numpy as np
import pytest
import torch
import yaml
from conftest import run_ranks, tiny_unet, write_config

from islands.cli import main
from islands.config import ConfigError, validate
from islands.data.gmm import GaussianMixture
from islands.ddm.ensemble import ancestral_clusters, load_ensemble
from islands.ddm.pipeline import build_ensemble
from islands.ddm.time_gate import TimeGate, load_time_gate
from islands.flow.paths import build_path
from islands.flow.samplers import HEUN_T_MIN, sample, time_grid, with_boundaries
from islands.rundir import latest_checkpoint, load_weights
from islands.trainer import train
from islands.trainer.ranges import tstage_config

BOUNDS = [0.0, 0.3, 0.7, 1.0]


class Constant:
    """An expert whose velocity is its own index everywhere, and who remembers the times it was asked about."""

    def __init__(self, index: int):
        self.index, self.times = index, []

    def __call__(self, x, t, cond=None):
        self.times += t.tolist()
        return torch.full_like(x, float(self.index))


def test_the_gate_picks_the_expert_of_each_range_at_and_around_every_boundary():
    gate = TimeGate([Constant(i) for i in range(3)], BOUNDS)
    eps = 1e-6
    times = [0.0, eps, 0.3 - eps, 0.3, 0.3 + eps, 0.5, 0.7 - eps, 0.7, 0.7 + eps, 1 - eps, 1.0]
    expected = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2]  # expert i owns (b_i, b_i+1], expert 0 also t = 0
    out = gate(torch.zeros(len(times), 1), torch.tensor(times, dtype=torch.float64))
    assert out.squeeze(1).tolist() == expected
    assert gate.evaluations == len(times)


@pytest.mark.parametrize("solver", ["euler", "heun", "dpm2m", "unipc"])
def test_every_solver_step_lies_inside_one_range(solver):
    experts = [Constant(i) for i in range(3)]
    sample(TimeGate(experts, BOUNDS), torch.zeros(4, 1), steps=5, solver=solver)
    grid = with_boundaries(time_grid(5, t_min=HEUN_T_MIN if solver == "heun" else 0.0), BOUNDS[1:-1])
    assert {0.3, 0.7} <= set(grid.tolist())
    for t, t_next in zip(grid[:-1].tolist(), grid[1:].tolist(), strict=True):
        assert any(lo <= t_next < t <= hi for lo, hi in zip(BOUNDS[:-1], BOUNDS[1:], strict=True)), (t, t_next)
    ends = torch.tensor(BOUNDS, dtype=torch.float32).tolist()  # the experts see float32 times
    for i, expert in enumerate(experts):  # each expert was asked only about times of its own closed range
        assert expert.times and all(ends[i] <= t <= ends[i + 1] for t in expert.times), (i, expert.times)


def test_a_range_experts_run_is_the_configs_run_on_its_range_in_the_paths_own_time(tmp_path):
    raw = {"run_dir": str(tmp_path / "run"), "flow": {"t_ranges": BOUNDS}}
    stage = tstage_config(validate(raw), 1)
    assert stage.run_dir == str(tmp_path / "run" / "tstages" / "1") and stage.flow.t_range == (0.3, 0.7)
    cosine = tstage_config(validate({**raw, "flow": {"path": "cosine", "t_ranges": BOUNDS}}), 1)
    path = build_path("cosine")
    canonical = path.canonical_time(torch.tensor(cosine.flow.t_range, dtype=torch.float64))
    assert torch.allclose(canonical, torch.tensor([0.3, 0.7], dtype=torch.float64), atol=1e-9)
    with pytest.raises(ConfigError, match="tstage: 3 is not one of the 3 ranges"):
        tstage_config(validate(raw), 3)
    with pytest.raises(ConfigError, match="tstage: flow.t_ranges is not set"):
        tstage_config(validate({"run_dir": "."}), 0)
    with pytest.raises(ConfigError, match="flow.t_ranges: must rise strictly from 0 to 1"):
        validate({"run_dir": ".", "flow": {"t_ranges": [0, 0.7, 0.3, 1]}})


def test_init_from_starts_from_the_other_runs_weights(tmp_path, image_npz):
    base = train(tiny_unet(tmp_path / "base", image_npz), progress=False)
    weights = load_weights(latest_checkpoint(base) / "ema.safetensors")
    # a learning rate too small to move anything: what the run holds after its steps is where it started
    start = tiny_unet(tmp_path / "fine", image_npz, train={"init_from": str(base), "lr": 1e-12, "images": 16,
                                                         "checkpoint_every": 16})
    fine = load_weights(latest_checkpoint(train(start, progress=False)) / "model.safetensors")
    assert all(torch.allclose(fine[k], weights[k], atol=1e-6) for k in weights)
    scratch = tiny_unet(tmp_path / "scratch", image_npz, train={"lr": 1e-12, "images": 16, "checkpoint_every": 16})
    other = load_weights(latest_checkpoint(train(scratch, progress=False)) / "model.safetensors")
    assert not all(torch.allclose(other[k], weights[k], atol=1e-3) for k in weights)
    wider = tiny_unet(tmp_path / "wider", image_npz, model={"channels": 16}, train={"init_from": str(base)})
    with pytest.raises(ConfigError, match="train.init_from: the weights of .*base do not fit this model"):
        train(wider, progress=False)


def test_two_range_experts_trained_apart_sample_the_modes_of_a_mixture_through_the_cli(tmp_path, capsys):
    """Each expert sees only its half of t. The gate chains them: the noisy half decides which mode a sample goes
    to, the clean half draws it."""
    means, weights = [[-2.0, -2.0], [2.0, -2.0], [-2.0, 2.0], [2.0, 2.0]], [0.4, 0.3, 0.2, 0.1]
    cfg = {"run_dir": str(tmp_path / "ranges"), "seed": 0,
           "data": {"source": "gmm", "means": means, "std": 0.1, "weights": weights, "size": 20000},
           "model": {"arch": "mlp", "hidden": 128, "depth": 3}, "flow": {"t_ranges": [0.0, 0.5, 1.0]},
           "train": {"images": 40_000, "batch_size": 256, "lr": 2e-3, "checkpoint_every": 40_000,
                     "log_every": 40_000, "ema_halflife_images": 4000},
           "sample": {"num": 16, "steps": 16, "batch_size": 4000}}
    config = write_config(tmp_path / "ranges.yaml", cfg)
    for stage in ("tstage=0", "tstage=1"):
        assert main(["train", config, stage, "--quiet"]) == 0
    assert main(["sample", str(tmp_path / "ranges"), "--num", "4000", "--out", str(tmp_path / "out"),
                 "--quiet"]) == 0
    capsys.readouterr()
    x = torch.from_numpy(np.load(tmp_path / "out" / "samples.npz")["x"]).double()
    truth = GaussianMixture(means, 0.1, weights)
    nearest = torch.cdist(x, truth.means).min(1)
    mass = torch.bincount(nearest.indices, minlength=4).double() / len(x)
    assert (nearest.values < 0.5).double().mean() > 0.9  # on the modes
    assert 0.5 * (mass - truth.weights).abs().sum() < 0.05, mass
    gate, cfg, _ = load_time_gate(tmp_path / "ranges")
    assert gate.time_boundaries == [0.5] and cfg.flow.t_range == (0.0, 0.5)
    sample(gate, torch.randn(10, 2), steps=4, solver="euler")  # grid 1, 0.75, 0.5, 0.25: two steps per expert
    assert gate.evaluations == 40


def test_a_cluster_by_range_grid_samples_every_mode_and_every_policy_works(tmp_path):
    """K = 2 clusters x R = 2 ranges: four runs, each on its cluster and its range; one manifest; the router gates
    clusters and t gates ranges. Every mode of the mixture gets samples near its weight."""
    means, weights = [[2.0, 2.0], [-2.0, 2.0], [-2.0, -2.0], [2.0, -2.0]], [0.4, 0.3, 0.2, 0.1]
    cfg = validate({"run_dir": str(tmp_path / "grid"), "seed": 1,
                    "data": {"source": "gmm", "means": means, "std": 0.3, "weights": weights, "size": 4000},
                    "model": {"arch": "mlp", "hidden": 64, "depth": 3},
                    "train": {"images": 25600, "batch_size": 128, "lr": 2e-3, "ema_halflife_images": 1000,
                              "checkpoint_every": 25600, "log_every": 6400},
                    "sample": {"num": 64, "steps": 12}, "eval": {"num": 2000},
                    "ddm": {"k": 2, "t_ranges": [0.0, 0.5, 1.0], "partition": {"fine": 64, "balanced": False},
                            "router": {"images": 12800, "batch_size": 64, "lr": 2e-3, "depth": 3}}})
    manifest = build_ensemble(cfg, jobs=2, progress=False)
    assert [[part["name"] for part in e["ranges"]] for e in manifest["experts"]] == \
        [["expert0.0", "expert0.1"], ["expert1.0", "expert1.1"]]
    stage = yaml.safe_load((tmp_path / "grid" / "experts" / "1" / "tstages" / "0" / "config.yaml").read_text())
    assert stage["data"]["cluster"] == 1 and stage["flow"]["t_range"] == [0.0, 0.5]
    truth = GaussianMixture(means, 0.3, weights)
    for routing in ("ancestral", "full", "top1"):
        mixture, manifest = load_ensemble(tmp_path / "grid", routing, seed=1)
        assert mixture.time_boundaries == [0.5]
        noise = torch.randn(4000, 2, generator=torch.Generator().manual_seed(2))
        field = mixture.assigned(ancestral_clusters(manifest, 1, 0, 4000)) if routing == "ancestral" else mixture
        x = sample(field, noise, steps=12).double()
        mass = torch.bincount(torch.cdist(x, truth.means).argmin(1), minlength=4).double() / len(x)
        assert (mass > 0.5 * truth.weights).all() and 0.5 * (mass - truth.weights).abs().sum() < 0.08, (routing, mass)


def test_range_experts_on_two_ranks_pipeline_their_batches_and_sample_what_one_process_samples(tmp_path, capsys):
    """torchrun ... islands sample RUN --distributed: rank 0 integrates each batch from noise to t = 0.5 and sends
    it on to rank 1, which integrates the rest; three batches keep both ranks busy at once."""
    cfg = {"run_dir": str(tmp_path / "ranges"), "seed": 0,
           "data": {"source": "gmm", "means": [[-2.0, 0.0], [2.0, 0.0]], "std": 0.2, "size": 2000},
           "model": {"arch": "mlp", "hidden": 32, "depth": 2}, "flow": {"t_ranges": [0.0, 0.5, 1.0]},
           "train": {"images": 2048, "batch_size": 256, "checkpoint_every": 2048, "log_every": 2048},
           "sample": {"steps": 6, "batch_size": 40}}
    config = write_config(tmp_path / "ranges.yaml", cfg)
    for stage in ("tstage=0", "tstage=1"):
        assert main(["train", config, stage, "--quiet"]) == 0
    assert main(["sample", cfg["run_dir"], "--num", "100", "--out", str(tmp_path / "one"), "--quiet"]) == 0
    capsys.readouterr()
    ranks = run_ranks(["sample", cfg["run_dir"], "--num", "100", "--distributed", "--out", str(tmp_path / "two"),
                       "--quiet"])
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-2000:] for r in ranks]
    one, two = (np.load(tmp_path / name / "samples.npz")["x"] for name in ("one", "two"))
    assert one.shape == two.shape == (100, 2) and np.array_equal(one, two)
    assert "2 ranks:" in ranks[0].stdout
    ranks = run_ranks(["sample", cfg["run_dir"], "--num", "10", "--distributed", "--solver", "dpm2m", "--out",
                       str(tmp_path / "three"), "--quiet"])
    assert [r.returncode for r in ranks] == [2, 2] and "sample.solver: 'dpm2m' keeps a history" in ranks[0].stderr
