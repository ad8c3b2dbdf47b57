"""Samplers driven by exact velocity fields; their grids, costs and order; agreement with diffusers; guidance."""

import math
import os
import subprocess
import sys
import typing

import numpy as np
import pytest
import torch
from diffusers import (
    DPMSolverMultistepScheduler,
    FlowMatchEulerDiscreteScheduler,
    FlowMatchHeunDiscreteScheduler,
)

from islands.cli import build_parser
from islands.config import SampleConfig
from islands.data.gmm import GaussianMixture
from islands.flow.denoiser import NetworkDenoiser
from islands.flow.samplers import (
    GRIDS,
    HEUN_T_MIN,
    LOGSNR_CENTRE,
    LOGSNR_WARP,
    LOGSNR_WIDTH,
    SOLVERS,
    _exponential_step,
    dpm2m,
    euler,
    evaluations_per_sample,
    guided,
    heun,
    sample,
    time_grid,
    unipc,
)
from islands.generate import generate, resolve_precision
from islands.nets.mlp import MLP
from islands.nets.unet import UNet

MIXTURE = GaussianMixture([[2.0, 0.0, 1.0], [-1.0, 1.5, 0.0], [0.0, -2.0, -1.0]], 0.4, [0.5, 0.3, 0.2])


@pytest.mark.parametrize("solver,steps,grid", [("euler", 200, "uniform"), ("heun", 40, "uniform"), ("heun", 40, "edm"),
                                               ("dpm2m", 40, "uniform"), ("dpm2m", 40, "edm"),
                                               ("unipc", 16, "uniform"), ("unipc", 16, "logsnr")])
def test_exact_velocity_reproduces_mixture_moments(solver, steps, grid):
    n = 20_000
    noise = torch.randn(n, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = sample(MIXTURE.denoiser(), noise, steps=steps, solver=solver, grid=grid)
    # Monte-Carlo error of the mean is about sqrt(var / n) ~ 0.01; allow 4 standard errors.
    assert torch.allclose(x.mean(0), MIXTURE.mean(), atol=0.045)
    assert torch.allclose(torch.cov(x.T), MIXTURE.covariance(), atol=0.08)
    # Mode masses: assign each sample to its most likely component under the data density.
    k = MIXTURE.posterior(x, torch.zeros(n)).argmax(1)
    assert torch.allclose(torch.bincount(k, minlength=3).double() / n, MIXTURE.weights, atol=0.02)


def test_second_order_solvers_beat_euler_at_equal_evaluations():
    noise = torch.randn(2000, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    reference = sample(MIXTURE.denoiser(), noise, steps=200, solver="unipc")  # converged: see the order test
    errors = {s: (sample(MIXTURE.denoiser(), noise, steps=12 if s == "heun" else 23, solver=s) - reference)
              .norm(dim=1).mean().item() for s in SOLVERS}
    assert max(errors["heun"], errors["dpm2m"], errors["unipc"]) < 0.5 * errors["euler"], errors


# --- grids, point by point against their formulas --------------------------------------------------------------

def test_uniform_and_shifted_grids_follow_their_formulas():
    n, shift = 10, 3.0
    u = np.arange(n, -1, -1) / n  # 1, 0.9, ..., 0
    assert np.allclose(time_grid(n, "uniform").numpy(), u, rtol=0, atol=1e-15)
    assert np.allclose(time_grid(n, "shifted", shift=shift).numpy(), shift * u / (1 + (shift - 1) * u), atol=1e-15)
    # with t_min: n times from 1 to t_min evenly (shifted: then shifted), then 0, as diffusers' flow schedulers
    u_min = np.append(1 - (1 - 0.01) * np.arange(n) / (n - 1), 0.0)
    assert np.allclose(time_grid(n, "uniform", t_min=0.01).numpy(), u_min, atol=1e-15)
    assert np.allclose(time_grid(n, "shifted", t_min=0.01).numpy(), 3 * u_min / (1 + 2 * u_min), atol=1e-15)


def test_edm_grid_follows_karras_eq_5():
    n, rho, smin, smax = 8, 7.0, 0.002, 80.0
    sigma = [(smax ** (1 / rho) + i / (n - 1) * (smin ** (1 / rho) - smax ** (1 / rho))) ** rho for i in range(n)]
    expected = [1.0] + [s / (1 + s) for s in sigma[1:]] + [0.0]  # t = sigma / (1 + sigma), the first moved to 1
    assert np.allclose(time_grid(n, "edm").numpy(), expected, rtol=1e-13, atol=0)


@pytest.mark.parametrize("n", [2, 3, 8, 32])
def test_logsnr_grid_spaces_log_snr_over_its_window(n):
    g = time_grid(n, "logsnr").numpy()
    assert g.shape == (n + 1,) and g[0] == 1.0 and g[-1] == 0.0
    lam = np.log((1 - g[1:-1]) / g[1:-1])
    width = max(LOGSNR_WIDTH[0] * math.log(n) - LOGSNR_WIDTH[1], 0.0)
    s = np.linspace(-1, 1, n - 1) if n > 2 else np.zeros(1)
    expected = LOGSNR_CENTRE + width / 2 * np.sinh(LOGSNR_WARP * s) / np.sinh(LOGSNR_WARP)
    assert np.allclose(lam, expected, atol=1e-12)


@pytest.mark.parametrize("kind", GRIDS)
def test_time_grids_decrease_from_one_to_zero(kind):
    for n in (1, 2, 5, 16):
        g = time_grid(n, kind)
        assert g.shape == (n + 1,) and g[0] == 1.0 and g[-1] == 0.0 and (g[1:] < g[:-1]).all(), (kind, n, g)


# --- costs -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("grid", GRIDS)
def test_evaluations_per_sample_counts_every_call(solver, grid):
    calls = []

    def field(x, t, cond=None):
        calls.append(x.shape[0])
        return MIXTURE.velocity(x, t)

    noise = torch.randn(5, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for steps in (1, 2, 3, 7):
        for guidance, cond in ((1.0, None), (2.0, torch.zeros(5, dtype=torch.long))):
            calls.clear()
            sample(field, noise, steps=steps, solver=solver, grid=grid, guidance=guidance, cond=cond)
            assert len(calls) == evaluations_per_sample(solver, steps, guidance), (solver, grid, steps, guidance)


# --- accuracy against closed forms -------------------------------------------------------------------------------

GAUSSIAN = GaussianMixture([[0.5, -1.0]], 0.3)  # one component: x_t = (1 - t) mu + sqrt((1 - t)^2 s^2 + t^2) z


def _exact(t: float, z: torch.Tensor) -> torch.Tensor:
    return (1 - t) * GAUSSIAN.means[0] + math.sqrt((1 - t) ** 2 * GAUSSIAN.std**2 + t**2) * z


def _errors(solver, steps) -> list[float]:
    z = torch.randn(64, 2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    v = lambda x, t: GAUSSIAN.velocity(x, t)  # noqa: E731
    return [(solver(v, _exact(0.9, z), torch.linspace(0.9, 0.1, n + 1, dtype=torch.float64)) - _exact(0.1, z))
            .norm(dim=1).mean().item() for n in steps]


@pytest.mark.parametrize("solver,order", [(euler, 1), (heun, 2), (dpm2m, 2),
                                          (lambda v, x, g: unipc(v, x, g, order=2), 3)])
def test_solvers_converge_at_their_order(solver, order):
    """On a Gaussian the ODE's solution is known in closed form; between 0.9 and 0.1 halving the steps must divide
    the error by 2^order (UniPC-2: order 2 predictor + corrector = 3). From 32 steps on the ratios are asymptotic."""
    errors = _errors(solver, (32, 64, 128))
    observed = [math.log2(a / b) for a, b in zip(errors, errors[1:], strict=False)]
    assert order - 0.3 < observed[0] < observed[1] + 0.05 and abs(observed[1] - order) < 0.15, (errors, observed)


def test_unipc_takes_order_3_from_16_steps_and_beats_order_2():
    """Order 3 + corrector approaches 4 slowly (its warm-up steps are lower order) but is well ahead of order 2."""
    steps = (64, 128, 256)
    third, second = _errors(unipc, steps), _errors(lambda v, x, g: unipc(v, x, g, order=2), steps)
    assert all(a < 0.1 * b for a, b in zip(third, second, strict=True)), (third, second)
    assert math.log2(third[1] / third[2]) > 3.5, third
    few = _errors(unipc, (8,)) + _errors(lambda v, x, g: unipc(v, x, g, order=2), (8,))
    assert few[0] == few[1]  # below 16 steps the default is order 2


@pytest.mark.parametrize("rs", [[], [-1.0], [-0.7, -1.9], [-0.8, 1.0], [-0.5, -1.2, 1.0]])
@pytest.mark.parametrize("t,t_next", [(0.8, 0.6), (0.3, 0.05)])
def test_exponential_step_integrates_the_interpolated_data_prediction(rs, t, t_next):
    """The multistep update against its definition, computed another way: sigma'/sigma x + sigma' times the
    integral of e^lambda P(lambda) over the step, P the polynomial through the data predictions (numpy's fit),
    the integral by 24-point Gauss-Legendre (exact for these degrees up to rounding)."""
    g = torch.Generator().manual_seed(8)
    x, x0 = torch.randn(3, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64)
    points = [(r, torch.randn(3, generator=g, dtype=torch.float64)) for r in rs]
    lam_s, lam_t = math.log((1 - t) / t), math.log((1 - t_next) / t_next)
    h = lam_t - lam_s
    nodes, weights = np.polynomial.legendre.leggauss(24)
    lam = lam_s + (nodes + 1) / 2 * h
    expected = (t_next / t) * x.numpy()
    for d in range(3):
        coef = np.polyfit([lam_s] + [lam_s + r * h for r in rs], [x0[d].item()] + [p[d].item() for _, p in points],
                          len(rs))
        expected[d] += t_next * h / 2 * np.sum(weights * np.exp(lam) * np.polyval(coef, lam))
    assert np.allclose(_exponential_step(x, t, t_next, x0, points, h).numpy(), expected, rtol=1e-10, atol=1e-12)


def test_every_solver_is_exact_for_a_point_mass():
    """Data at one point: x0 = mu at every (x, t), so the multistep solvers' exponential integrator is exact in
    one step, and every solver ends on mu."""
    point = GaussianMixture([[0.5, -1.0]], 1e-9)
    noise = torch.randn(16, 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    for solver in SOLVERS:
        for grid in GRIDS:
            x = sample(point.denoiser(), noise, steps=5, solver=solver, grid=grid)
            assert torch.allclose(x, point.means[0].expand_as(x), atol=1e-7), (solver, grid)


# --- the same solvers as diffusers, on the same grids ------------------------------------------------------------

PEER = GaussianMixture([[1.5, 0.0], [-1.0, 1.0], [0.0, -1.5], [0.6, 0.8]], 0.15, [0.4, 0.3, 0.2, 0.1])


def _diffusers(scheduler, noise: torch.Tensor) -> torch.Tensor:
    """diffusers' own loop, fed the exact velocity at the sigma the scheduler is at (its flow convention: sigma is
    t, and the model output is the velocity noise - x0, the same sign as ours)."""
    x = noise
    for i, timestep in enumerate(scheduler.timesteps):
        sigma = float(scheduler.sigmas[i])
        x = scheduler.step(PEER.velocity(x, torch.full((x.shape[0],), sigma)).float(), timestep, x).prev_sample
    return x


def _islands(solver, grid: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return solver(lambda x, t: PEER.velocity(x, t).to(x.dtype), noise, grid)


def _agree(ours: torch.Tensor, theirs: torch.Tensor, mean: float = 1e-7) -> bool:
    """Equal up to the float32 rounding diffusers computes in, whatever its input: about 1e-7 on average, a few
    1e-6 at worst."""
    gap = (ours.double() - theirs.double()).abs()
    return gap.mean() < mean and gap.max() < 1e-5


def test_euler_heun_and_dpm_solver_match_diffusers_on_the_same_grids():
    noise = torch.randn(256, 2, generator=torch.Generator().manual_seed(5))
    steps = 8

    s = FlowMatchEulerDiscreteScheduler()
    s.set_timesteps(sigmas=time_grid(steps, "uniform")[:-1].tolist())
    grid = s.sigmas.double()
    assert torch.allclose(grid, time_grid(steps, "uniform"), atol=1e-7)
    assert _agree(_islands(euler, grid, noise), _diffusers(s, noise))

    # Heun: diffusers' own grid, which is Islands' (1 .. HEUN_T_MIN, then 0); its sigmas repeat each inner time
    s = FlowMatchHeunDiscreteScheduler()
    s.set_timesteps(steps)
    grid = torch.unique_consecutive(s.sigmas).double()
    assert torch.allclose(grid, time_grid(steps, "uniform", t_min=HEUN_T_MIN), atol=1e-7)
    assert len(s.timesteps) == evaluations_per_sample("heun", steps)
    # diffusers' Heun recovers the velocity as (x - (x - sigma v)) / sigma in float32, which loses three digits
    # at sigma = 1e-3: 1.2e-6 apart on average, in float64 on our side too
    theirs = _diffusers(s, noise)
    assert _agree(_islands(heun, grid, noise.double()), theirs, mean=2e-6)
    assert _agree(sample(lambda x, t, c=None: PEER.velocity(x, t).float(), noise, steps=steps, solver="heun"), theirs,
                  mean=2e-6)

    # DPM-Solver++(2M): diffusers' flow grid starts at t = 0.999, so its second step is second order too
    s = DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", solver_order=2)
    s.set_timesteps(steps)
    grid = s.sigmas.double()
    assert grid[0] < 1.0 and grid[-1] == 0.0
    theirs = _diffusers(s, noise)
    assert _agree(_islands(dpm2m, grid, noise), theirs)
    # ... where a first-order second step (what Islands took on grids below t = 1 before) is visibly off:
    # restarting after one step drops the history, so the restarted run's first step is first order
    restarted = _islands(dpm2m, grid[1:], _islands(dpm2m, grid[:2], noise))
    assert (restarted - theirs).abs().max() > 1e-3


# --- guidance ------------------------------------------------------------------------------------------------------

def test_guidance_extrapolates_from_a_nonzero_unconditional_field():
    def field(x, t, cond=None):
        base = torch.sin(3 * x) + t[:, None]  # unconditional: depends on x and t, nowhere zero
        return base if cond is None else base + cond[:, None].to(x.dtype) * x

    g = torch.Generator().manual_seed(6)
    x, t, cond = torch.randn(4, 2, generator=g), torch.rand(4, generator=g), torch.tensor([1, 2, 3, 4])
    v_u = torch.sin(3 * x) + t[:, None]
    v_c = v_u + cond[:, None] * x
    for scale in (0.0, 1.5, 3.0):
        assert torch.allclose(guided(field, scale)(x, t, cond), v_u + scale * (v_c - v_u), atol=1e-6)
    assert torch.equal(guided(field, 3.0)(x, t, None), v_u)  # unconditional samples: no second call, no guidance
    assert guided(field, 1.0) is field
    assert evaluations_per_sample("heun", 10) == 19 and evaluations_per_sample("euler", 10, guidance=2.0) == 20


def test_config_and_cli_accept_exactly_the_solvers_and_grids_that_exist():
    assert typing.get_args(SampleConfig.model_fields["solver"].annotation) == SOLVERS
    assert typing.get_args(SampleConfig.model_fields["grid"].annotation) == GRIDS
    sample_parser = build_parser()._subparsers._group_actions[0].choices["sample"]
    options = {a.dest: a.choices for a in sample_parser._actions}
    assert tuple(options["solver"]) == SOLVERS and tuple(options["grid"]) == GRIDS


def test_unknown_solver_and_grid_are_named():
    with pytest.raises(ValueError, match="'rk4'"):
        sample(MIXTURE.denoiser(), torch.zeros(1, 3), solver="rk4")
    with pytest.raises(ValueError, match="'rk4'"):
        evaluations_per_sample("rk4", 4)
    with pytest.raises(ValueError, match="'cosine'"):
        time_grid(4, "cosine")


# --- per-sample seeding and precision ------------------------------------------------------------------------------

def _perturbed(net):
    torch.manual_seed(5)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return net.eval()


@pytest.mark.parametrize("make,shape", [(lambda: MLP(3, hidden=32, depth=2, num_classes=4), (3,)),
                                        (lambda: UNet(1, 8, channels=8, channel_mult=(1, 2), num_res_blocks=1,
                                                      attention_resolutions=(4,), num_classes=4), (1, 8, 8))])
def test_same_seed_same_sample_whatever_the_batch(make, shape):
    denoiser = NetworkDenoiser(_perturbed(make()))
    labels = torch.arange(16) % 4
    opts = [SampleConfig(steps=6, solver="heun", guidance=1.5, batch_size=b) for b in (1, 16)]
    one_by_one, batched = (generate(denoiser, shape, 16, o, 7, labels) for o in opts)
    assert torch.allclose(one_by_one, batched, atol=1e-5)
    # A later sample does not depend on how many came before it in the request.
    tail = generate(denoiser, shape, 4, SampleConfig(steps=6, solver="heun", guidance=1.5), 7, labels[12:], first=12)
    assert torch.allclose(tail, batched[12:], atol=1e-5)
    other_seed = generate(denoiser, shape, 16, SampleConfig(steps=6, solver="heun", guidance=1.5), 8, labels)
    assert not torch.allclose(other_seed, batched, atol=1e-3)


def test_bf16_sampling_runs_the_network_in_bf16_and_keeps_the_solver_in_fp32():
    net = _perturbed(UNet(1, 8, channels=16, channel_mult=(1, 2), num_res_blocks=1, attention_resolutions=(4,)))
    seen = []
    net.conv_in.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    denoiser = NetworkDenoiser(net)
    x = {precision: generate(denoiser, (1, 8, 8), 6, SampleConfig(steps=4, batch_size=4, precision=precision), seed=3)
         for precision in ("fp32", "bf16")}
    assert set(seen) == {torch.float32, torch.bfloat16}  # the convolutions ran in bf16 under autocast only
    assert x["bf16"].dtype == torch.float32
    scale = x["fp32"].std().item()
    error = (x["bf16"] - x["fp32"]).abs().max().item()
    assert 0 < error < 0.05 * scale, (error, scale)  # bf16's 8-bit mantissa: close, but really bf16


@pytest.mark.parametrize("native", [True, False])
def test_auto_precision_is_bf16_only_for_a_bf16_run_on_a_device_that_computes_bf16_natively(monkeypatch, native):
    monkeypatch.setattr("islands.parallel.launch.bf16_is_native", lambda device: native)
    assert resolve_precision("auto", "bf16") == ("bf16" if native else "fp32")
    assert resolve_precision("auto", "fp32") == "fp32"
    assert resolve_precision("auto", "fp16") == "fp32"  # bf16 rounds coarser than what the run trained with
    for explicit in ("fp32", "bf16"):  # as written, also in an older run's config.yaml
        assert resolve_precision(explicit, "bf16") == resolve_precision(explicit, "fp32") == explicit
    assert SampleConfig().precision == "auto"


def test_networks_for_sampling_are_built_without_initialisation_or_importing_torch_dynamo():
    """Built on the meta device, an nn.Embedding's normal_ (and the DiT's arange) ran through torch._refs, whose
    first call imports torch._dynamo: seconds of every `islands sample`."""
    code = """
import sys
import torch
from islands.conditions import network_spec
from islands.config import validate
from islands.generate import network_with_weights
from islands.nets import build_network

for model, shape in [(dict(arch="unet", num_classes=4, channels=8, channel_mult=[1, 2], num_res_blocks=1,
                           attention_resolutions=[4]), (1, 8, 8)),
                     (dict(arch="dit", num_classes=4, patch_size=2, hidden_size=24, depth=1, num_heads=2), (1, 8, 8)),
                     (dict(arch="mlp", hidden=16, depth=2, num_classes=4), (3,))]:
    cfg = validate({"run_dir": ".", "model": model}).model
    torch.manual_seed(0)
    weights = build_network(network_spec(cfg, shape, 4)).state_dict()
    state = torch.get_rng_state()
    net = network_with_weights(network_spec(cfg, shape, 4), weights)
    assert torch.equal(torch.get_rng_state(), state), model["arch"]  # no global random numbers drawn
    assert all(torch.equal(a, weights[k]) for k, a in net.state_dict().items()) and not net.training
assert "torch._dynamo" not in sys.modules
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
