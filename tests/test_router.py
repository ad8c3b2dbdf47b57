"""The router's truth and its measures: the exact cluster posterior of a training set, calibration against it,
and routers anchored at the prior. (A trained router against these: test_ddm.py.)"""

import json
import math

import pytest
import torch

from islands.data.clusters import read_prior_table
from islands.data.gmm import GaussianMixture
from islands.data.posterior import ExactPosterior
from islands.data.sources import DataError
from islands.nets.router import MLPRouter, TransformerRouter
from islands.train.objectives import calibration

MIXTURE = GaussianMixture([[2.0, 2.0], [-2.0, 2.0], [-2.0, -2.0], [2.0, -2.0]], 0.4, [0.4, 0.3, 0.2, 0.1])


def noised(x0: torch.Tensor, t: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (1 - t) * x0 + t * noise, torch.full((x0.shape[0],), t, dtype=torch.float64)


def test_the_exact_posterior_is_the_sum_of_gaussians_around_the_scaled_points():
    """Against the definition, term by term: N(x_t; (1 - t) x_i, t^2 I) summed per cluster, normalised."""
    g = torch.Generator().manual_seed(0)
    points, clusters = torch.randn(60, 3, generator=g, dtype=torch.float64), torch.arange(60) % 3
    posterior = ExactPosterior(points, clusters, 3)
    for t in (0.05, 0.3, 0.7, 1.0):
        x, tt = torch.randn(20, 3, generator=g, dtype=torch.float64), torch.full((20,), t, dtype=torch.float64)
        density = torch.distributions.Normal((1 - t) * points[None], t).log_prob(x[:, None]).sum(-1).exp()  # (20, 60)
        by_cluster = torch.stack([density[:, clusters == k].sum(1) for k in range(3)], 1)
        assert torch.allclose(posterior(x, tt), by_cluster / by_cluster.sum(1, keepdim=True), atol=1e-12), t


def test_the_exact_posterior_of_whole_modes_is_the_mixture_posterior():
    """Clusters that are the mixture's components: the training set's posterior is the mixture's own, up to the
    sampling noise of 20,000 points (at t = 1 it is the empirical cluster shares, within 0.004 of the weights)."""
    x, component = MIXTURE.sample(20_000, torch.Generator().manual_seed(1))
    posterior = ExactPosterior(x, component, 4)
    probe, _ = MIXTURE.sample(1000, torch.Generator().manual_seed(2))
    for t in (0.1, 0.5, 0.9, 1.0):
        x_t, tt = noised(probe, t, seed=3)
        tv = 0.5 * (posterior(x_t, tt) - MIXTURE.posterior(x_t, tt)).abs().sum(1).mean()
        assert tv < 0.01, (t, tv)


def test_the_exact_posterior_given_a_class_counts_only_that_class():
    x, component = MIXTURE.sample(2000, torch.Generator().manual_seed(4))
    clusters = component % 2  # clusters {0, 2} and {1, 3}; classes are the components
    posterior = ExactPosterior(x, clusters, 2, classes=component, num_classes=4)
    x_t, tt = noised(x[:200], 0.8, seed=5)
    given = posterior(x_t, tt, component[:200])
    assert torch.equal(given, torch.nn.functional.one_hot(component[:200] % 2, 2).double())
    null = torch.full((200,), 4)
    assert torch.allclose(posterior(x_t, tt, null), ExactPosterior(x, clusters, 2)(x_t, tt), atol=1e-12)
    with pytest.raises(ValueError, match="0 < t"):
        posterior(x_t, torch.zeros(200, dtype=torch.float64))


def test_calibration_measures_against_known_answers():
    exact = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.25, 0.75]], dtype=torch.float64)
    clusters = torch.tensor([0, 0, 1])
    same = calibration(exact, exact, clusters)
    assert same["tv"] == 0 and same["kl"] == 0 and same["exact_accuracy"] == 1.0
    uniform = calibration(torch.full((3, 2), 0.5, dtype=torch.float64), exact, clusters)
    assert uniform["tv"] == pytest.approx((0 + 0.5 + 0.25) / 3)
    assert uniform["kl"] == pytest.approx((0 + math.log(2) + 0.25 * math.log(0.5) + 0.75 * math.log(1.5)) / 3)
    # ECE by hand: confidences 0.9 (right), 0.9 (wrong), 0.6 (right) -> bins 9: |0.5 - 0.9| * 2/3, 6: |1 - 0.6| / 3
    probs = torch.tensor([[0.9, 0.1], [0.9, 0.1], [0.4, 0.6]], dtype=torch.float64)
    assert calibration(probs, exact, torch.tensor([0, 1, 1]))["ece"] == pytest.approx(0.4 * 2 / 3 + 0.4 / 3)
    # labels drawn from the probabilities themselves: calibrated, so ECE is sampling noise only
    g = torch.Generator().manual_seed(6)
    p = torch.softmax(3 * torch.randn(20_000, 4, generator=g, dtype=torch.float64), 1)
    drawn = torch.multinomial(p, 1, generator=g).squeeze(1)
    assert calibration(p, p, drawn)["ece"] < 0.02


@pytest.mark.parametrize("router", [lambda: MLPRouter(2, 3, hidden=16, depth=2, num_classes=2),
                                    lambda: TransformerRouter(8, 1, 3, patch_size=4, hidden_size=16, depth=1,
                                                              num_heads=2, num_classes=2)])
def test_a_router_at_pure_noise_returns_the_prior_of_the_class(router):
    torch.manual_seed(0)
    net = router()
    for p in net.parameters():  # trained-looking weights, not the initial ones
        torch.nn.init.normal_(p, std=0.5)
    table = torch.tensor([[0.7, 0.3, 0.0], [0.1, 0.1, 0.8], [0.5, 0.25, 0.25]])
    net.anchor.set_prior(table)
    shape = (6, 2) if isinstance(net, MLPRouter) else (6, 1, 8, 8)
    x, cond = 3 * torch.randn(shape), torch.tensor([0, 1, 2, 0, 1, 2])
    probs = net(x, torch.ones(6), cond).softmax(1)
    assert torch.allclose(probs, table.clamp_min(1e-6)[cond] / table.clamp_min(1e-6)[cond].sum(1, keepdim=True),
                          atol=1e-6)
    assert torch.allclose(net(x, torch.ones(6)).softmax(1), table[2].expand(6, -1), atol=1e-6)  # no class
    away = net(x, torch.full((6,), 0.5), cond).softmax(1)
    assert not torch.allclose(away, probs, atol=1e-2)  # elsewhere the network decides
    assert "anchor.log_prior" in net.state_dict()  # saved with the weights, so sampling sees the same prior


def test_the_prior_table_comes_from_the_partition(tmp_path):
    (tmp_path / "partition.json").write_text(json.dumps({
        "k": 2, "method": "kmeans", "features_name": "pixels", "seed": 0, "balanced": False, "n": 40,
        "sizes": [30, 10], "sizes_by_class": [[20, 0], [10, 10], [0, 0]]}))
    table = read_prior_table(tmp_path, 3)
    expected = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.75, 0.25], [0.75, 0.25]], dtype=torch.float64)
    assert torch.equal(table, expected)  # a class no cluster holds falls back to the sizes
    assert torch.equal(read_prior_table(tmp_path, 0), expected[-1:])
    with pytest.raises(DataError, match="counts 3 classes, the model has 2"):
        read_prior_table(tmp_path, 2)
    with pytest.raises(DataError, match="partition.json"):
        read_prior_table(tmp_path / "absent", 2)


def test_a_router_batch_carries_the_class_as_its_condition_and_the_cluster_beside_it():
    """Through a partition, the loader's batch holds each example's own class (what the networks embed) and its
    cluster in a field of its own, read from the partition's assignment of the example at its index: no label
    packs the two into one integer."""
    from islands.data.clusters import ClusterLabelled
    from islands.data.loader import stream_loader
    from islands.data.sources import _ArraySource

    x = torch.arange(12, dtype=torch.float32).reshape(12, 1)  # each example's value is its index
    classes, clusters = torch.arange(12) % 3, (torch.arange(12) * 7) % 4
    source = ClusterLabelled(_ArraySource(x, classes, 3), clusters.numpy())
    batch = next(iter(stream_loader(source, 6, seed=0)))
    index = batch.x[:, 0].long()
    assert torch.equal(batch.condition, classes[index]) and torch.equal(batch.cluster, clusters[index])
    rows = batch.rows(torch.tensor([4, 1]))
    assert torch.equal(rows.cluster, batch.cluster[[4, 1]]) and torch.equal(rows.positions, batch.positions[[4, 1]])
