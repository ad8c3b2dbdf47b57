"""Evaluation metrics against independent truths: closed forms, numerical integrals, known limits."""

import itertools
import math
import pickle
import re

import numpy as np
import prdc
import pytest
import torch

from islands.data.gmm import GaussianMixture
from islands.eval import metrics
from islands.eval.exact import mean_nll, mode_mass, sliced_wasserstein, velocity_error
from islands.eval.metrics import (
    GaussianStats,
    StatsAccumulator,
    class_balance,
    density_coverage,
    feature_stats,
    frechet_distance,
    kid,
    precision_recall,
)


def gaussian(n, dim, mean=0.0, std=1.0, seed=0):
    return mean + std * np.random.default_rng(seed).standard_normal((n, dim))


def stats(mean, cov):
    return GaussianStats(np.asarray(mean, dtype=np.float64), np.asarray(cov, dtype=np.float64), 100)


# --- Frechet distance --------------------------------------------------------------------------------------

def test_frechet_distance_of_stats_with_themselves_is_zero():
    mixing = np.random.default_rng(1).standard_normal((16, 16))
    s = feature_stats(gaussian(2000, 16) @ mixing + 3.0)
    assert frechet_distance(s, s) < 1e-9


def test_frechet_distance_of_diagonal_gaussians_is_the_closed_form():
    """Commuting covariances: |dmu|^2 + sum (sqrt s1 - sqrt s2)^2."""
    mu1, mu2 = np.array([0.0, 1.0, -2.0, 0.5, 3.0]), np.array([1.0, 1.0, 0.0, -0.5, 2.5])
    s1, s2 = np.array([1.0, 0.25, 4.0, 2.0, 0.1]), np.array([2.0, 1.0, 1.0, 2.0, 3.0])
    expected = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(s1) - np.sqrt(s2)) ** 2)
    assert frechet_distance(stats(mu1, np.diag(s1)), stats(mu2, np.diag(s2))) == pytest.approx(expected, abs=1e-8)


def test_frechet_distance_of_non_commuting_2x2_covariances_is_the_closed_form():
    """Sa^1/2 Sb Sa^1/2 has the eigenvalues of Sa Sb, and tr sqrt(M) = sqrt(tr M + 2 sqrt(det M)) for 2x2 PSD M."""
    sa, sb = np.array([[2.0, 0.7], [0.7, 1.0]]), np.array([[1.0, -0.4], [-0.4, 3.0]])
    assert not np.allclose(sa @ sb, sb @ sa)
    mu_a, mu_b = np.array([0.3, -1.0]), np.array([1.0, 0.5])
    cross = math.sqrt(np.trace(sa @ sb) + 2 * math.sqrt(np.linalg.det(sa) * np.linalg.det(sb)))
    expected = np.sum((mu_a - mu_b) ** 2) + np.trace(sa) + np.trace(sb) - 2 * cross
    assert frechet_distance(stats(mu_a, sa), stats(mu_b, sb)) == pytest.approx(expected, abs=1e-8)


def test_frechet_distance_of_shifted_samples_approaches_the_squared_shift():
    n, dim = 20_000, 8
    mu = np.full(dim, 0.25)
    fake = torch.from_numpy(gaussian(n, dim, mu, seed=3))
    got = frechet_distance(feature_stats(gaussian(n, dim, seed=2)), feature_stats(fake))
    # mean term: 2 mu.noise has std 2 |mu| sqrt(2 / n); covariance estimation adds a bias of order D^2 / n
    tolerance = 5 * 2 * np.linalg.norm(mu) * math.sqrt(2 / n) + dim**2 / n
    assert got == pytest.approx(mu @ mu, abs=tolerance)


# --- statistics files and streaming ---------------------------------------------------------------------------

def test_accumulator_over_uneven_batches_equals_the_whole():
    x = gaussian(1000, 6, mean=50.0, seed=4) @ np.random.default_rng(5).standard_normal((6, 6))
    accumulator = StatsAccumulator()
    start = 0
    for size in (1, 7, 300, 2, 0, 690):
        batch = x[start:start + size]
        accumulator.add(torch.from_numpy(batch) if size % 2 else batch)
        start += size
    whole, streamed = feature_stats(x), accumulator.stats()
    assert streamed.count == whole.count == 1000
    assert np.allclose(streamed.mean, whole.mean, rtol=1e-10, atol=0)
    assert np.abs(streamed.cov - whole.cov).max() < 1e-10 * np.abs(whole.cov).max()
    # and feature_stats itself is the textbook unbiased estimate
    centred = x - x.mean(0)
    assert np.allclose(whole.cov, centred.T @ centred / 999, rtol=1e-12)


def test_stats_save_load_round_trip(tmp_path):
    original = feature_stats(gaussian(50, 4, seed=6))
    path = tmp_path / "reference_stats"  # a bare name stays a bare name
    original.save(path)
    loaded = GaussianStats.load(path)
    assert loaded.count == 50
    assert np.array_equal(loaded.mean, original.mean) and np.array_equal(loaded.cov, original.cov)


class TouchFile:
    """Unpickling this creates a file: proof that a pickle ran."""

    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return open, (self.target, "w")


@pytest.mark.parametrize("kind", ["pickle", "pickle_in_npz", "garbage", "missing", "missing_key", "npy"])
def test_loading_anything_but_stats_raises_a_one_line_error_and_never_unpickles(tmp_path, kind):
    path, marker = tmp_path / f"stats_{kind}.npz", tmp_path / "pickle_ran"
    if kind == "pickle":
        path.write_bytes(pickle.dumps(TouchFile(marker)))
    elif kind == "pickle_in_npz":
        payload = np.array([TouchFile(marker)], dtype=object)
        with open(path, "wb") as file:
            np.savez(file, mean=payload, cov=np.eye(1), count=np.int64(3))
    elif kind == "garbage":
        path.write_bytes(b"\x00\x93NUMPY garbage" * 10)
    elif kind == "missing_key":
        with open(path, "wb") as file:
            np.savez(file, mean=np.zeros(2), count=np.int64(3))
    elif kind == "npy":
        with open(path, "wb") as file:
            np.save(file, np.zeros(2))
    with pytest.raises(ValueError, match=re.escape(str(path))) as info:
        GaussianStats.load(path)
    assert "\n" not in str(info.value)
    assert not marker.exists()


# --- KID -------------------------------------------------------------------------------------------------------

def test_kid_is_unbiased_for_samples_of_one_distribution():
    means, errors = [], []
    for seed in range(6):
        mean, error = kid(gaussian(2000, 8, seed=10 + seed), gaussian(2000, 8, seed=20 + seed))
        assert abs(mean) < 3 * error
        means.append(mean)
        errors.append(error)
    assert abs(np.mean(means)) < 3 * math.sqrt(np.sum(np.square(errors))) / len(errors)


def test_kid_of_shifted_distributions_is_many_standard_errors_positive():
    mean, error = kid(gaussian(2000, 8, seed=30), gaussian(2000, 8, mean=0.5, seed=31))
    assert mean > 10 * error > 0


def test_kid_estimates_the_population_mmd_in_one_dimension():
    """D = 1: k(x, y) = (xy + 1)^3 = sum_j C(3, j) (xy)^j, so MMD^2 = sum_j C(3, j) (E x^j - E y^j)^2."""
    (m1, s1), (m2, s2) = (0.0, 1.0), (0.4, 0.8)

    def moments(m, s):
        return np.array([m, m**2 + s**2, m**3 + 3 * m * s**2])

    expected = np.dot([3, 3, 1], (moments(m1, s1) - moments(m2, s2)) ** 2)
    mean, error = kid(gaussian(6000, 1, m1, s1, seed=40), gaussian(6000, 1, m2, s2, seed=41))
    assert mean == pytest.approx(expected, abs=5 * error)
    assert error < 0.1 * expected


def test_kid_and_its_variance_are_unbiased_over_every_draw_of_two_discrete_distributions():
    """P on {-1, 2} and Q on {0.5, 1.5} (1-D), 5 real and 4 fake points: all 2^9 draws, weighted by their
    probabilities, give the exact mean and variance of the estimate; KID's mean must be the population MMD^2 and
    the mean of the summed variance terms the exact variance (kid_se is their square root)."""
    xs, p, ys, q = np.array([-1.0, 2.0]), np.array([0.3, 0.7]), np.array([0.5, 1.5]), np.array([0.6, 0.4])
    m, n = 5, 4
    probabilities, values, variances = [], [], []
    for i in itertools.product(range(2), repeat=m):
        for j in itertools.product(range(2), repeat=n):
            probabilities.append(np.prod(np.take(p, i)) * np.prod(np.take(q, j)))
            value, terms = metrics._mmd2_and_variance_terms(np.take(xs, i)[:, None], np.take(ys, j)[:, None])
            values.append(value)
            variances.append(sum(terms.values()))
    probabilities, values = np.array(probabilities), np.array(values)
    def gram(a, b):
        return (np.outer(a, b) + 1) ** 3

    population = p @ gram(xs, xs) @ p + q @ gram(ys, ys) @ q - 2 * p @ gram(xs, ys) @ q
    mean = probabilities @ values
    assert mean == pytest.approx(population, rel=1e-12)
    assert probabilities @ np.array(variances) == pytest.approx(probabilities @ (values - mean) ** 2, rel=1e-10)


@pytest.mark.parametrize("shift", [0.0, 0.15])
def test_kid_standard_error_is_the_spread_of_kid_over_independent_draws(shift):
    """400 real and 200 fake points of N(0, I) and N(shift, I) in 16-D, drawn afresh 200 times: the standard
    deviation of KID over the draws (itself within ~5%) matches the mean reported standard error within 25%.
    (With shift 0 the first-order terms are 0 and their clipped noise makes the error read 10-20% high.)"""
    rng = np.random.default_rng(70)
    values, errors = [], []
    for _ in range(200):
        value, error = kid(rng.standard_normal((400, 16)), shift + rng.standard_normal((200, 16)))
        values.append(value)
        errors.append(error)
    assert np.std(values, ddof=1) == pytest.approx(np.mean(errors), rel=0.25)
    if shift:
        assert np.mean(values) > 2 * np.std(values)  # a shift the test can see


def test_kid_refuses_sets_too_small_for_its_standard_error():
    with pytest.raises(ValueError, match="at least 4"):
        kid(gaussian(3, 2), gaussian(10, 2))


# --- precision and recall -----------------------------------------------------------------------------------

CORNERS = [[4.0, 4.0], [-4.0, 4.0], [-4.0, -4.0], [4.0, -4.0]]


def mixture_samples(means, n, seed):
    return GaussianMixture(means, 0.5).sample(n, torch.Generator().manual_seed(seed))[0]


def test_precision_and_recall_on_a_hand_worked_line(monkeypatch):
    """k = 2: real 0, 1, 3, 7, 15 have radii 3, 2, 3, 6, 12, balls covering [-3, 27]: 2 of the 5 fakes are in;
    fakes -3.5, -2, 20, 27.5, 30 have radii 23.5, 22, 10, 7.5, 10, and [-27, 20] alone holds every real point.
    k = 1: real radii 1, 1, 2, 4, 8 cover [-1, 23] (holds 20 only); fake radii 1.5, 1.5, 7.5, 2.5, 2.5 hold 15 only."""
    monkeypatch.setattr(metrics, "DISTANCE_CHUNK", 2)  # exercise the chunking
    real, fake = [[0.0], [1.0], [3.0], [7.0], [15.0]], [[-3.5], [-2.0], [20.0], [27.5], [30.0]]
    assert precision_recall(np.array(real), torch.tensor(fake), k=2) == (pytest.approx(0.4), pytest.approx(1.0))
    assert precision_recall(np.array(real), torch.tensor(fake), k=1) == (pytest.approx(0.2), pytest.approx(0.2))


def test_precision_and_recall_of_one_distribution_are_near_one():
    precision, recall = precision_recall(mixture_samples(CORNERS, 2000, 50), mixture_samples(CORNERS, 2000, 51))
    assert precision > 0.9 and recall > 0.9


def test_dropping_half_the_modes_keeps_precision_and_halves_recall():
    precision, recall = precision_recall(mixture_samples(CORNERS, 2000, 52), mixture_samples(CORNERS[:2], 1000, 53))
    assert precision > 0.9
    assert recall == pytest.approx(0.5, abs=0.06)


def test_far_away_samples_have_neither_precision_nor_recall():
    real = mixture_samples(CORNERS, 1500, 54)
    precision, recall = precision_recall(real, mixture_samples(CORNERS, 1500, 55) + 100.0)
    assert precision < 0.01 and recall < 0.01


# --- density and coverage (Naeem et al. 2020) ----------------------------------------------------------------

def test_density_and_coverage_on_a_hand_worked_line(monkeypatch):
    """k = 2: real 0, 1, 3, 7, 15 have radii 3, 2, 3, 6, 12, balls [-3, 3], [-1, 3], [0, 6], [1, 13], [3, 27]; of the
    fakes -3.5, -2, 20, 27.5, 30 only -2 (in the first ball) and 20 (in the last) are in one: density
    2 / (2 * 5), coverage 2 / 5. k = 1: balls [-1, 1], [0, 2], [1, 5], [3, 11], [7, 23] hold 20 alone: 1 / 5 twice.
    Five fakes at 0.5 lie in the first three k = 2 balls: density 3 * 5 / (2 * 5) = 1.5 (above 1), coverage 3 / 5."""
    monkeypatch.setattr(metrics, "DISTANCE_CHUNK", 2)  # exercise the chunking
    real, fake = np.array([[0.0], [1.0], [3.0], [7.0], [15.0]]), torch.tensor([[-3.5], [-2.0], [20.0], [27.5], [30.0]])
    assert density_coverage(real, fake, k=2) == (pytest.approx(0.2), pytest.approx(0.4))
    assert density_coverage(real, fake, k=1) == (pytest.approx(0.2), pytest.approx(0.2))
    assert density_coverage(real, np.full((5, 1), 0.5), k=2) == (pytest.approx(1.5), pytest.approx(0.6))


def test_density_and_coverage_of_one_distribution_have_their_closed_form_means():
    """Fake and real alike: a fake point is among a real point's k nearest of the other N - 1 + 1 with probability
    k / N, so E density = 1; a real point's ball holds no fake when its k nearest of the N - 1 + M others are all
    real, so E coverage = 1 - prod_{j=1..k} (N - j) / (N + M - j) (Naeem et al. 2020)."""
    real_n, fake_n, k, draws = 800, 400, 5, 12
    rng = np.random.default_rng(80)
    found = np.array([density_coverage(rng.standard_normal((real_n, 6)), rng.standard_normal((fake_n, 6)), k)
                      for _ in range(draws)])
    expected = [1.0, 1 - np.prod([(real_n - j) / (real_n + fake_n - j) for j in range(1, k + 1)])]
    for value, truth, spread in zip(found.mean(0), expected, found.std(0, ddof=1), strict=True):
        assert value == pytest.approx(truth, abs=4 * spread / math.sqrt(draws))


def test_precision_recall_density_coverage_equal_prdc_on_the_same_features():
    """The peer library (prdc, by Naeem et al.) on float64 features. prdc counts a point strictly inside (<) a ball,
    we count the boundary too (<=), and the two compute distances differently: the features are checked to keep
    every distance at least 1e-9 (relative) away from every radius, so neither can matter."""
    rng = np.random.default_rng(81)
    real, fake = rng.standard_normal((600, 16)), 0.3 + 1.2 * rng.standard_normal((400, 16))
    cross = np.sqrt(np.square(real[:, None] - fake[None]).sum(-1))  # [600, 400], exact differences
    for k in (3, 5):
        real_radii = np.sort(np.sqrt(np.square(real[:, None] - real[None]).sum(-1)), 1)[:, k]
        fake_radii = np.sort(np.sqrt(np.square(fake[:, None] - fake[None]).sum(-1)), 1)[:, k]
        assert np.abs(cross / real_radii[:, None] - 1).min() > 1e-9
        assert np.abs(cross / fake_radii[None] - 1).min() > 1e-9
        theirs = prdc.compute_prdc(real, fake, nearest_k=k)
        precision, recall = precision_recall(real, fake, k=k)
        density, coverage = density_coverage(real, fake, k=k)
        assert (precision, recall) == (theirs["precision"], theirs["recall"])
        assert density == pytest.approx(theirs["density"], rel=1e-12) and coverage == theirs["coverage"]
        assert 0.05 < min(precision, recall, density, coverage) and max(precision, recall, coverage) < 0.99


def test_dropping_half_the_modes_halves_coverage():
    """Within the two modes kept, coverage is 1 - prod (N' - j) / (N' + M - j) ~ 1 - 2^-5 (N' ~ M = 1000)."""
    coverage = density_coverage(mixture_samples(CORNERS, 2000, 56), mixture_samples(CORNERS[:2], 1000, 57))[1]
    assert coverage == pytest.approx(0.5 * (1 - 0.5**5), abs=0.04)


# --- class balance --------------------------------------------------------------------------------------------

def test_class_balance_gives_the_exact_shares():
    fake = [0, 0, 0, 0, 1, 1, 3, 3, 3, 3]  # 0.4, 0.2, 0, 0.4
    data = torch.tensor([0, 1, 1, 2, 0, 1, 1, 2])  # 0.25, 0.5, 0.25, 0
    balance = class_balance(fake, data, 4)
    assert balance["fake_share"] == pytest.approx([0.4, 0.2, 0.0, 0.4])
    assert balance["data_share"] == pytest.approx([0.25, 0.5, 0.25, 0.0])
    assert balance["total_variation"] == pytest.approx(0.5 * (0.15 + 0.3 + 0.25 + 0.4))
    assert balance["worst_class"] == 2 and balance["worst_ratio"] == 0.0  # class 3 is absent from the data
    with pytest.raises(ValueError, match="fake_labels"):
        class_balance([0, 4], data, 4)


# --- exact metrics for Gaussian mixtures ------------------------------------------------------------------

def test_mean_nll_of_an_isotropic_gaussian_is_its_entropy():
    dim, std, n = 3, 0.7, 20_000
    gmm = GaussianMixture([[1.0, -2.0, 0.5]], std)
    x, _ = gmm.sample(n, torch.Generator().manual_seed(60))
    entropy = 0.5 * dim * math.log(2 * math.pi * math.e * std**2)
    # -log p = const + chi^2_D / 2, whose std is sqrt(2 D) / 2
    assert mean_nll(gmm, x) == pytest.approx(entropy, abs=4 * math.sqrt(2 * dim) / 2 / math.sqrt(n))


def test_mean_nll_of_a_1d_mixture_is_its_numerically_integrated_entropy():
    gmm = GaussianMixture([[-2.0], [0.5], [3.0]], 0.6, [0.5, 0.2, 0.3])
    grid = torch.linspace(-12.0, 13.0, 50_001, dtype=torch.float64)
    density = gmm.log_prob(grid[:, None], 0.0).exp()
    entropy = float(torch.trapezoid(-density * density.log(), grid))
    x, _ = gmm.sample(20_000, torch.Generator().manual_seed(61))
    nll = -gmm.log_prob(x, 0.0)
    assert mean_nll(gmm, x) == pytest.approx(entropy, abs=4 * float(nll.std()) / math.sqrt(x.shape[0]))


def test_sliced_wasserstein_of_isotropic_gaussians_is_the_closed_form():
    """Projections of N(m, s^2 I) are N(u.m, s^2); W2^2 in 1-D is (dmean)^2 + (dstd)^2; E_u (u.dm)^2 = |dm|^2 / D."""
    dim, projections, n = 4, 1024, 4000
    dm = torch.tensor([1.0, -1.0, 1.0, 1.0], dtype=torch.float64)  # |dm|^2 = 4
    gen = torch.Generator().manual_seed(62)
    x = 0.5 * torch.randn(n, dim, dtype=torch.float64, generator=gen)
    y = dm + 0.5 * torch.randn(n, dim, dtype=torch.float64, generator=gen)
    expected = math.sqrt(float(dm.square().sum()) / dim)
    # direction sampling: Var (u.dm)^2 = |dm|^4 (3 / (D (D + 2)) - 1 / D^2); plus O(1/n) sampling terms
    direction_std = float(dm.square().sum()) * math.sqrt(3 / (dim * (dim + 2)) - 1 / dim**2) / math.sqrt(projections)
    got = sliced_wasserstein(x, y, projections=projections, seed=1)
    assert got**2 == pytest.approx(expected**2, abs=4 * direction_std + 0.01)
    same = sliced_wasserstein(x, 0.5 * torch.randn(n, dim, dtype=torch.float64, generator=gen), projections, seed=2)
    assert same < 0.05 * expected


@pytest.mark.parametrize("sizes", [(5000, 3000), (3000, 5000), (4000, 4000)])
def test_sliced_wasserstein_in_one_dimension_is_w2_even_for_different_sizes(sizes):
    """Quantile grids m + s Phi^-1((i + 0.5) / n) of N(0, 0.5^2) and N(1, 1.5^2): W2^2 = 1^2 + 1^2, no noise."""

    def quantile_grid(n, mean, std):
        levels = (torch.arange(n, dtype=torch.float64) + 0.5) / n
        return (mean + std * math.sqrt(2) * torch.erfinv(2 * levels - 1))[:, None]

    got = sliced_wasserstein(quantile_grid(sizes[0], 0.0, 0.5), quantile_grid(sizes[1], 1.0, 1.5), projections=4)
    assert got**2 == pytest.approx(2.0, abs=2e-3)


def test_mode_mass_of_true_samples_matches_the_weights():
    weights = [0.4, 0.3, 0.2, 0.1]
    gmm = GaussianMixture([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0], [10.0, 10.0]], 0.5, weights)
    n = 10_000
    x, labels = gmm.sample(n, torch.Generator().manual_seed(63))
    result = mode_mass(gmm, x)
    assert result["weights"] == pytest.approx(weights)
    assert result["mass"] == pytest.approx(torch.bincount(labels).double().div(n).tolist(), abs=1e-12)  # separated
    for mass, w in zip(result["mass"], weights, strict=True):
        assert mass == pytest.approx(w, abs=4 * math.sqrt(w * (1 - w) / n))
    errors = [abs(m - w) for m, w in zip(result["mass"], weights, strict=True)]
    assert result["max_abs_error"] == pytest.approx(max(errors))
    assert result["total_variation"] == pytest.approx(0.5 * sum(errors))


GMM = GaussianMixture([[2.0, 0.0], [-1.0, 1.5], [0.0, -2.0]], 0.3, [0.5, 0.3, 0.2])


def test_velocity_error_of_the_exact_denoiser_is_zero():
    assert velocity_error(GMM.denoiser(), GMM, num=2048, times=8) < 1e-10


def test_velocity_error_of_a_constant_offset_is_its_squared_norm():
    offset = torch.tensor([0.3, -0.4], dtype=torch.float64)
    exact = GMM.denoiser()
    seen = []

    def shifted(x, t, cond=None):
        seen.append(cond)
        return exact(x, t) + offset

    error = velocity_error(shifted, GMM, num=2500, times=8, seed=3, cond=torch.arange(2500) % 3)
    assert error == pytest.approx(0.25, rel=1e-6)
    assert [c.shape[0] for c in seen[:3]] == [1024, 1024, 452]


def test_velocity_error_follows_the_midpoint_rule_and_the_path():
    """Error t c: |c|^2 mean_k t_k^2 exactly. Error x_t: E|x_t|^2 = (1-t)^2 E|x0|^2 + t^2 D, to MC error (~0.8%)."""
    times = 8
    midpoints = (torch.arange(times, dtype=torch.float64) + 0.5) / times
    offset = torch.tensor([0.3, -0.4], dtype=torch.float64)
    exact = GMM.denoiser()
    error = velocity_error(lambda x, t, cond=None: exact(x, t) + t[:, None] * offset, GMM, num=1000, times=times)
    assert error == pytest.approx(0.25 * float(midpoints.square().mean()), rel=1e-6)
    second_moment = float(GMM.weights @ GMM.means.square().sum(1)) + GMM.dim * GMM.std**2
    expected = second_moment * float((1 - midpoints).square().mean()) + GMM.dim * float(midpoints.square().mean())
    error = velocity_error(lambda x, t, cond=None: exact(x, t) + x, GMM, num=4096, times=times, seed=5)
    assert error == pytest.approx(expected, rel=0.03)


def test_the_config_asks_for_exactly_the_samples_each_metric_needs():
    """eval.num is refused below MIN_SAMPLES (config.py, which cannot import the metrics): each metric runs on that
    many samples and refuses one fewer."""
    from islands.config import MIN_SAMPLES

    real = np.random.default_rng(0).standard_normal((64, 3))
    run = {"kid": lambda fake: metrics.kid(real, fake), "precision_recall": lambda fake: metrics.precision_recall(
        real, fake), "fd": lambda fake: metrics.frechet_distance(metrics.feature_stats(fake),
                                                                 metrics.feature_stats(real))}
    assert set(run) == set(MIN_SAMPLES)
    for name, fewest in MIN_SAMPLES.items():
        run[name](real[:fewest] + 0.1)
        with pytest.raises(ValueError):
            run[name](real[:fewest - 1] + 0.1)
