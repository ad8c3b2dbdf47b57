"""Flow math against closed forms: paths, the exact adapters, time samplers, the Gaussian mixture."""

import math

import pytest
import torch

from islands.data.gmm import GaussianMixture
from islands.flow.denoiser import PREDICTIONS, NetworkDenoiser, broadcast, prediction_target
from islands.flow.objectives import training_loss
from islands.flow.paths import PATHS, build_path
from islands.flow.timesteps import TimeSampler

MEAN, STD = torch.tensor([0.7, -1.3, 0.2], dtype=torch.float64), 0.5
# The continuous paths run from data (tau = 0) to noise; vp_discrete's steps stop short of both (tests/test_paths.py).
CONTINUOUS = sorted(set(PATHS) - {"vp_discrete"})
# Every path, each discrete beta schedule included.
PATH_SPECS = [(name, {}) for name in sorted(PATHS)] + [("vp_discrete", {"beta_schedule": "cosine"})]


pytestmark = pytest.mark.usefixtures("float64")  # exact comparisons: tensors built in float64


class GaussianOracle(torch.nn.Module):
    """The exact posterior-mean prediction for x0 ~ N(MEAN, STD^2 I) on `path`, in the path's own frame."""

    def __init__(self, path, prediction):
        super().__init__()
        self.path, self.prediction = path, prediction

    def forward(self, x, tau, cond=None):
        a, s = broadcast(self.path.alpha(tau), x), broadcast(self.path.sigma(tau), x)
        var = a**2 * STD**2 + s**2
        resid = x - a * MEAN
        x0 = MEAN + a * STD**2 / var * resid
        eps = s / var * resid
        if self.prediction == "epsilon":
            return eps
        if self.prediction == "x0":
            return x0
        return broadcast(self.path.d_alpha(tau), x) * x0 + broadcast(self.path.d_sigma(tau), x) * eps


@pytest.mark.parametrize("path_name", CONTINUOUS)
def test_path_derivatives_and_time_maps(path_name):
    path = build_path(path_name)
    tau = torch.linspace(0.02, 0.98, 49)
    h = 1e-6
    assert torch.allclose(path.d_alpha(tau), (path.alpha(tau + h) - path.alpha(tau - h)) / (2 * h), atol=1e-6)
    assert torch.allclose(path.d_sigma(tau), (path.sigma(tau + h) - path.sigma(tau - h)) / (2 * h), atol=1e-6)
    t = torch.linspace(0.01, 0.95, 50)
    assert torch.allclose(path.canonical_time(path.own_time(t)), t, atol=1e-10)
    assert float(path.alpha(torch.tensor(0.0))) == pytest.approx(1.0)
    assert float(path.sigma(torch.tensor(0.0))) == pytest.approx(0.0)


class SlightlyWrongEpsilon(GaussianOracle):
    """The exact epsilon prediction plus a constant error of 1e-3: a well-trained network, not a perfect one."""

    def forward(self, x, tau, cond=None):
        return super().forward(x, tau, cond) + 1e-3


@pytest.mark.parametrize("path_name", ["vp_linear", "cosine"])
def test_an_epsilon_network_near_pure_noise_does_not_blow_its_error_up(path_name):
    """x0 = (x - sigma eps) / alpha multiplies an error of eps by sigma / alpha, 1e5 at t = 1 - 1e-5: sampled from
    t = 1 through the adapter, an eps error of 1e-3 moved the samples' mean by ~10. Evaluated no nearer noise than
    sigma / alpha = 80, it moves it by about 80 x 1e-3 x the first step's share of the signal (0.1), plus what the
    rest of the path adds."""
    from islands.flow.samplers import sample

    noise = torch.randn(4000, 3, generator=torch.Generator().manual_seed(5))
    x = {net.__name__: sample(NetworkDenoiser(net(build_path(path_name), "epsilon"), path_name, "epsilon"), noise,
                              steps=10, solver="euler") for net in (GaussianOracle, SlightlyWrongEpsilon)}
    moved = (x["SlightlyWrongEpsilon"] - x["GaussianOracle"]).abs().mean(0)
    assert moved.max() < 0.02, moved


@pytest.mark.parametrize("prediction", PREDICTIONS)
@pytest.mark.parametrize("path_name,options", PATH_SPECS)
def test_adapter_is_exact_for_every_path_and_prediction(path_name, options, prediction):
    """An oracle network on (path, prediction), adapted, equals the closed-form canonical velocity."""
    truth = GaussianMixture([MEAN.tolist()], STD)
    path = build_path(path_name, **options)
    denoiser = NetworkDenoiser(GaussianOracle(path, prediction), path, prediction)
    gen = torch.Generator().manual_seed(0)
    t = torch.rand(256, generator=gen) * 0.96 + 0.02
    x0 = MEAN + STD * torch.randn(256, 3, generator=gen)
    x = (1 - t[:, None]) * x0 + t[:, None] * torch.randn(256, 3, generator=gen)
    expected = truth.velocity(x, t)
    got = denoiser(x, t)
    assert torch.allclose(got, expected, atol=1e-8, rtol=1e-6), (got - expected).abs().max()


@pytest.mark.parametrize("prediction", PREDICTIONS)
def test_training_target_has_the_oracle_as_conditional_mean(prediction):
    """The oracle is E[target | x_tau]: the residual has mean zero and is uncorrelated with x_tau."""
    path = build_path("cosine")
    n = 200_000
    x0 = MEAN + STD * torch.randn(n, 3, generator=torch.Generator().manual_seed(1))
    noise = torch.randn(n, 3, generator=torch.Generator().manual_seed(2))
    tau = torch.full((n,), 0.4)
    x = broadcast(path.alpha(tau), x0) * x0 + broadcast(path.sigma(tau), x0) * noise
    resid = GaussianOracle(path, prediction)(x, tau) - prediction_target(path, prediction, x0, noise, tau)
    assert resid.mean(0).abs().max() < 0.01
    assert ((x - x.mean(0)) * resid).mean(0).abs().max() < 0.01
    assert training_loss(GaussianOracle(path, prediction), path, prediction, x0, noise, tau).mean() == pytest.approx(
        resid.square().mean().item())


def test_gmm_velocity_matches_score_by_tweedie():
    """For the canonical path, E[eps|x] = -t score and E[x0|x] = (x + t^2 score) / (1 - t)."""
    gmm = GaussianMixture([[2.0, 0.0], [-1.0, 1.5], [0.0, -2.0]], 0.3, [0.5, 0.3, 0.2])
    gen = torch.Generator().manual_seed(3)
    x, t = 2 * torch.randn(500, 2, generator=gen), torch.rand(500, generator=gen) * 0.9 + 0.05
    score = gmm.score(x, t)
    tt = t[:, None]
    expected = -tt * score - (x + tt**2 * score) / (1 - tt)
    assert torch.allclose(gmm.velocity(x, t), expected, atol=1e-9)
    # and the score is the gradient of the exact log density of x_t
    xg = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(gmm.log_prob(xg, t).sum(), xg)
    assert torch.allclose(score, grad, atol=1e-9)


def _normal_cdf(z):
    return 0.5 * (1 + torch.erf(z / math.sqrt(2)))


@pytest.mark.parametrize("kind", ["uniform", "logit_normal"])
@pytest.mark.parametrize("t_range", [(0.0, 1.0), (0.25, 0.6)])
def test_time_sampler_follows_its_restricted_distribution(kind, t_range):
    sampler = TimeSampler(kind, *t_range, mean=0.3, std=0.8)
    u = torch.rand(100_000, generator=torch.Generator().manual_seed(4))
    t = sampler(u)
    lo, hi = t_range
    assert t.min() >= lo and t.max() < hi
    # Kolmogorov-Smirnov distance to the closed-form restricted CDF.
    grid = torch.linspace(lo + 1e-3, hi - 1e-3, 200)
    if kind == "uniform":
        cdf = (grid - lo) / (hi - lo)
    else:
        def f(v):
            v = torch.as_tensor(v).clamp(1e-12, 1 - 1e-12)
            return _normal_cdf((torch.log(v / (1 - v)) - 0.3) / 0.8)
        cdf = (f(grid) - f(lo)) / (f(hi) - f(lo))
    empirical = (t[None, :] <= grid[:, None]).double().mean(1)
    assert (empirical - cdf).abs().max() < 0.01


def test_bad_time_range_is_refused():
    with pytest.raises(ValueError, match="t_lo"):
        TimeSampler("uniform", 0.7, 0.2)
