"""Low resolution first (issue 28, section 4): a run continued at a larger size from a smaller one's weights
(`train.init_from`), and SD3's resolution-dependent time shift in training and sampling."""

import math

import numpy as np
import pytest
import torch

from islands.cli import main
from islands.conditions import network_spec
from islands.config import validate
from islands.data import streams
from islands.errors import ConfigError
from islands.flow.samplers import HEUN_T_MIN, sample, solver_grid, time_grid, with_boundaries
from islands.flow.timesteps import TimeSampler, shift_time
from islands.generate import load_denoiser, network_with_weights
from islands.nets import build_network
from islands.nets.dit import interpolated_pos_embed, sincos_2d
from islands.rundir import latest_checkpoint, load_weights
from islands.train.objectives import build_objective
from islands.trainer import train
from islands.trainer.parts import start_from
from tests.conftest import tiny_unet


def test_the_time_shift_is_sd3s_eq_23_and_a_shift_of_1_changes_nothing():
    t = torch.linspace(0, 1, 101, dtype=torch.float64)
    m, n = 28 * 28, 14 * 14  # pixels at the larger and the smaller size
    a = math.sqrt(m / n)
    assert a == 2
    expected = math.sqrt(m / n) * t / (1 + (math.sqrt(m / n) - 1) * t)  # Esser et al. 2024, eq. 23
    assert torch.allclose(shift_time(t, a), expected, atol=1e-15)
    inner = t[1:-1]  # the noise-to-signal ratio t / (1 - t) is multiplied by a; 1 / a undoes the shift
    assert torch.allclose(shift_time(inner, a) / (1 - shift_time(inner, a)), a * inner / (1 - inner), atol=1e-12)
    assert torch.allclose(shift_time(shift_time(t, a), 1 / a), t, atol=1e-15)
    assert torch.equal(shift_time(t, 1.0), t)
    u = torch.rand(1000, generator=torch.Generator().manual_seed(0))
    for kind in ("uniform", "logit_normal"):
        assert torch.equal(TimeSampler(kind, shift=1.0)(u), TimeSampler(kind)(u))
    bounds = [0.3, 0.7]
    for solver in ("heun", "dpm2m"):
        unshifted = with_boundaries(time_grid(8, "uniform", t_min=HEUN_T_MIN if solver == "heun" else 0.0), bounds)
        assert torch.equal(solver_grid(8, "uniform", solver, 1.0, bounds), unshifted)
    grid = time_grid(8, "uniform")
    shifted = solver_grid(8, "uniform", "euler", a)
    assert torch.allclose(shifted, a * grid / (1 + (a - 1) * grid), atol=1e-15) and shifted[0] == 1 and shifted[-1] == 0


@pytest.mark.parametrize("t_range", [(0.0, 1.0), (0.25, 0.6)])
def test_a_shifted_time_sampler_draws_the_shifted_distribution_inside_its_range(t_range):
    """T = a U / (1 + (a - 1) U) for U uniform on the range's preimage: P(T <= t) = (s(t) - s(lo)) / (s(hi) - s(lo))
    with s(t) = t / (a - (a - 1) t), the inverse shift."""
    a, (lo, hi) = 2.0, t_range
    t = TimeSampler("uniform", lo, hi, shift=a)(torch.rand(100_000, generator=torch.Generator().manual_seed(1)))
    assert t.min() >= lo and t.max() <= hi

    def s(v):
        return v / (a - (a - 1) * v)

    grid = torch.linspace(lo + 1e-3, hi - 1e-3, 200)
    cdf = (s(grid) - s(lo)) / (s(hi) - s(lo))
    empirical = (t[None, :] <= grid[:, None]).double().mean(1)
    assert (empirical - cdf).abs().max() < 0.01
    assert t.median() > (lo + hi) / 2  # towards noise


def test_the_shift_is_a_flow_key_that_training_and_the_runs_samples_both_use(tmp_path):
    cfg = validate({"run_dir": str(tmp_path), "flow": {"time_shift": 2}})
    assert cfg.sample.time_shift == 2  # the run's samples shift their grid as it trained
    assert validate({"run_dir": str(tmp_path)}).sample.time_shift == 1
    assert validate({"run_dir": str(tmp_path), "flow": {"time_shift": 2}, "sample": {"time_shift": 1}}).sample \
        .time_shift == 1
    u = torch.rand(64, generator=torch.Generator().manual_seed(2))
    plain = build_objective(validate({"run_dir": str(tmp_path)}), 0).times(u)
    assert torch.allclose(build_objective(cfg, 0).times(u), shift_time(plain.double(), 2).float(), atol=1e-6)
    with pytest.raises(ConfigError, match="flow.time_shift: SD3's shift is defined on rectified-flow time"):
        validate({"run_dir": str(tmp_path), "flow": {"path": "cosine", "time_shift": 2}})
    with pytest.raises(ConfigError, match="flow.time_shift"):
        validate({"run_dir": str(tmp_path), "flow": {"time_shift": 0}})


def test_islands_sample_shifts_its_grid_as_the_run_trained(tmp_path, image_npz):
    run = train(tiny_unet(tmp_path / "run", image_npz, flow={"time_shift": 2.0},
                          train={"images": 16, "checkpoint_every": 16, "sample_every": 16}), progress=False)
    assert "time_shift: 2.0" in (run / "config.yaml").read_text()
    assert main(["sample", str(run), "--num", "4", "--out", str(tmp_path / "out"), "--quiet"]) == 0
    written = torch.from_numpy(np.load(tmp_path / "out" / "samples.npz")["x"])
    denoiser, cfg, info = load_denoiser(run)
    noise = streams.normal(cfg.seed, list(range(4)), info.shape, "sample")
    labels = torch.arange(4) % 4

    def drawn(shift):
        return sample(denoiser, noise, steps=cfg.sample.steps, solver=cfg.sample.solver, grid=cfg.sample.grid,
                      guidance=cfg.sample.guidance, cond=labels, time_shift=shift).clamp(-1, 1)

    # bit for bit: the same network, noise and grid (a network this young moves its samples little, so the
    # unshifted grid's differ by about 1e-6)
    assert torch.equal(written, drawn(2.0)) and not torch.equal(written, drawn(1.0))


def test_interpolating_the_sincos_embedding_is_exact_and_the_identity_at_its_own_size():
    dim = 32
    small = sincos_2d(4, dim).unsqueeze(0)
    assert interpolated_pos_embed(small, 4) is small
    assert torch.equal(sincos_2d(4, dim, scale=1.0), sincos_2d(4, dim))
    # Three times the grid, centres aligned: new token (3i + 1, 3j + 1) lies exactly on old token (i, j).
    triple = interpolated_pos_embed(small, 12)[0].reshape(12, 12, dim)
    assert torch.allclose(triple[1::3, 1::3], small[0].reshape(4, 4, dim), atol=1e-6)
    # Between the old tokens it is what resizing the old embedding would give, where the old grid resolves it (the
    # low frequencies: bicubic interpolation of the high ones, 2 samples a period, is no reference).
    doubled = interpolated_pos_embed(small, 8)[0]
    image = small[0].T.reshape(1, dim, 4, 4).double()
    resized = torch.nn.functional.interpolate(image, size=8, mode="bicubic", align_corners=False).reshape(dim, 64).T
    low = [k for half in (0, dim // 2) for k in range(half, half + dim // 2) if (k - half) % (dim // 4) >= dim // 8]
    assert torch.allclose(doubled[2:6, low].double(), resized[2:6, low], atol=2e-3)
    # A grown run grown again is where the first grows to at once: the scale is read from the embedding itself.
    twice = interpolated_pos_embed(interpolated_pos_embed(small, 8), 16)
    assert torch.allclose(twice, interpolated_pos_embed(small, 16), atol=1e-6)
    with pytest.raises(ValueError, match="pos_embed: not the sin-cos embedding of a 4x4 grid"):
        interpolated_pos_embed(torch.randn(1, 16, dim), 8)


def tiny_dit(run_dir, data_path, side: int, **train_keys):
    return validate({
        "run_dir": str(run_dir), "seed": 1,
        "data": {"source": "npz", "path": str(data_path), "resolution": side},
        "model": {"arch": "dit", "num_classes": 4, "patch_size": 2, "hidden_size": 32, "depth": 2, "num_heads": 2},
        "train": {"images": 16, "batch_size": 8, "lr": 1e-3, "checkpoint_every": 16, "sample_every": 16,
                  **train_keys},
        "sample": {"num": 4, "steps": 2, "solver": "euler"},
        "eval": {"val_size": 0},
    })


def test_a_dit_from_a_run_of_its_own_size_computes_exactly_what_that_run_computes(tmp_path, image_npz):
    base = train(tiny_dit(tmp_path / "base", image_npz, 8), progress=False)
    weights = load_weights(latest_checkpoint(base) / "ema.safetensors")
    cfg = tiny_dit(tmp_path / "next", image_npz, 8)
    net = build_network(network_spec(cfg.model, (1, 8, 8), 4))
    start_from(net, base)
    reference = network_with_weights(network_spec(cfg.model, (1, 8, 8), 4), weights)
    x, t, y = torch.randn(4, 1, 8, 8), torch.rand(4), torch.arange(4)
    assert torch.equal(net.eval()(x, t, y), reference(x, t, y))


def test_a_14x14_dit_goes_on_at_28x28_with_every_weight_but_its_positions_as_it_was(tmp_path, image_npz):
    low = train(tiny_dit(tmp_path / "low", image_npz, 14), progress=False)
    weights = load_weights(latest_checkpoint(low) / "ema.safetensors")
    high_cfg = tiny_dit(tmp_path / "high", image_npz, 28, init_from=str(low), lr=1e-12)
    net = build_network(network_spec(high_cfg.model, (1, 28, 28), 4))
    start_from(net, low)
    loaded = net.state_dict()
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[k], weights[k]) for k in weights if k != "pos_embed")
    assert weights["pos_embed"].shape == (1, 49, 32) and loaded["pos_embed"].shape == (1, 196, 32)
    assert torch.equal(loaded["pos_embed"], sincos_2d(14, 32, scale=0.5).unsqueeze(0))
    # the run keeps the interpolated embedding: its checkpoints, and what `islands sample` loads from them
    high = train(high_cfg, progress=False)
    denoiser, _, _ = load_denoiser(high)
    assert torch.equal(denoiser.net.pos_embed, loaded["pos_embed"])
    assert not torch.allclose(denoiser.net.pos_embed, sincos_2d(14, 32).unsqueeze(0))
    # and a resume, which builds the network afresh (its default positions) and fills it from the checkpoint
    train(tiny_dit(tmp_path / "high", image_npz, 28, init_from=str(low), lr=1e-12, images=24), progress=False)
    assert torch.equal(load_denoiser(high)[0].net.pos_embed, loaded["pos_embed"])


def test_a_unet_goes_on_at_twice_the_size_as_it_was_and_a_weight_that_does_not_fit_is_named(tmp_path, image_npz):
    # attention at the second level: its side is 2 at 4x4 and 4 at 8x8
    low = train(tiny_unet(tmp_path / "low", image_npz, data={"resolution": 4}, model={"attention_resolutions": [2]},
                          train={"images": 16, "checkpoint_every": 16, "sample_every": 16}), progress=False)
    weights = load_weights(latest_checkpoint(low) / "ema.safetensors")
    cfg = tiny_unet(tmp_path / "high", image_npz)
    net = build_network(network_spec(cfg.model, (1, 8, 8), 4))
    start_from(net, low)
    loaded = net.state_dict()
    assert loaded.keys() == weights.keys() and all(torch.equal(loaded[k], weights[k]) for k in weights)
    # attention listed by the same side at both sizes sits at another level: named, not dropped
    other_cfg = tiny_unet(tmp_path / "x", image_npz, model={"attention_resolutions": [2]})
    other = build_network(network_spec(other_cfg.model, (1, 8, 8), 4))
    with pytest.raises(ConfigError, match=r"train.init_from: the weights of .*low do not fit this model: "
                                          r"this model has no blocks\.\d+\.attn\."):
        start_from(other, low)
    wider_cfg = tiny_unet(tmp_path / "y", image_npz, model={"channels": 16})
    wider = build_network(network_spec(wider_cfg.model, (1, 8, 8), 4))
    with pytest.raises(ConfigError, match=r"do not fit this model: blocks\.0\.res\.conv1\.bias is \(8,\) there, "
                                          r"\(16,\) here"):
        start_from(wider, low)
