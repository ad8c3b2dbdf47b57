"""Samplers driven by exact velocity fields; per-sample seeding; guidance."""

import pytest
import torch

from islands.config import SampleConfig
from islands.data.gmm import GaussianMixture
from islands.flow.denoiser import NetworkDenoiser
from islands.flow.samplers import evaluations_per_sample, guided, sample, time_grid
from islands.generate import generate
from islands.nets.mlp import MLP
from islands.nets.unet import UNet

MIXTURE = GaussianMixture([[2.0, 0.0, 1.0], [-1.0, 1.5, 0.0], [0.0, -2.0, -1.0]], 0.4, [0.5, 0.3, 0.2])


@pytest.mark.parametrize("solver,steps", [("euler", 200), ("heun", 40), ("dpm2m", 40)])
@pytest.mark.parametrize("grid", ["uniform", "edm"])
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


def test_second_order_solvers_beat_euler_at_equal_steps():
    noise = torch.randn(4000, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    reference = sample(MIXTURE.denoiser(), noise, steps=1000, solver="heun")
    errors = {s: (sample(MIXTURE.denoiser(), noise, steps=12, solver=s) - reference).norm(dim=1).mean().item()
              for s in ("euler", "heun", "dpm2m")}
    assert errors["heun"] < 0.5 * errors["euler"] and errors["dpm2m"] < 0.5 * errors["euler"], errors


@pytest.mark.parametrize("kind", ["uniform", "edm", "shifted"])
def test_time_grids_run_from_one_to_zero(kind):
    g = time_grid(10, kind)
    assert g.shape == (11,) and g[0] == 1.0 and g[-1] == 0.0 and (g[1:] < g[:-1]).all()


def test_guidance_extrapolates_from_unconditional():
    def field(x, t, cond=None):
        return torch.zeros_like(x) if cond is None else cond[:, None].to(x.dtype).expand_as(x)

    x, t, cond = torch.zeros(4, 2), torch.full((4,), 0.5), torch.tensor([1, 2, 3, 4])
    assert torch.equal(guided(field, 3.0)(x, t, cond), 3.0 * field(x, t, cond))
    assert guided(field, 1.0) is field
    assert evaluations_per_sample("heun", 10) == 19 and evaluations_per_sample("euler", 10, guidance=2.0) == 20


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
    one_by_one = generate(denoiser, shape, 16, SampleConfig(steps=6, solver="heun", guidance=1.5, batch_size=1), 7, labels)
    batched = generate(denoiser, shape, 16, SampleConfig(steps=6, solver="heun", guidance=1.5, batch_size=16), 7, labels)
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
