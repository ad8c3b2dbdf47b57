"""Decentralized Diffusion Models: exact per-cluster experts and the exact router recover the data's velocity."""

import re
import warnings

import pytest
import torch

from islands.config import SampleConfig
from islands.data.gmm import GaussianMixture
from islands.ddm.ensemble import ancestral_assignment, ancestral_clusters
from islands.ddm.mixture import ExpertSlot, Mixture, PriorRouter, Routing, parse_routing
from islands.flow.samplers import evaluations_per_sample, guided, sample
from islands.generate import generate

MEANS = [[2.0, 2.0], [-2.0, 2.0], [-2.0, -2.0], [2.0, -2.0]]
STD = 0.3
WEIGHTS = [0.4, 0.3, 0.2, 0.1]
DATA = GaussianMixture(MEANS, STD, WEIGHTS)  # component k is cluster k
NAMES = [f"expert{k}" for k in range(4)]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tensors here are tiny: a second thread only waits (seconds per test on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def gaussian_velocity(mean, std: float, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """E[eps - x0 | x_t = x] for data N(mean, std^2 I) on x_t = (1 - t) x0 + t eps.

    x_t ~ N((1 - t) mean, var I) with var = (1 - t)^2 std^2 + t^2, Cov(x0, x_t) = (1 - t) std^2 I and
    Cov(eps, x_t) = t I, so E[eps - x0 | x_t] = (t - (1 - t) std^2) / var (x_t - (1 - t) mean) - mean.
    """
    t = t.reshape(-1, 1).to(x.dtype)
    mean = torch.as_tensor(mean, dtype=x.dtype)
    var = (1 - t) ** 2 * std**2 + t**2
    return (t - (1 - t) * std**2) / var * (x - (1 - t) * mean) - mean


class Expert:
    """The exact expert of cluster k; records the inputs it is called on and, in `tally`, how many are alive."""

    def __init__(self, k: int, tally: dict | None = None):
        self.k, self.inputs, self.tally = k, [], tally
        if tally is not None:
            tally["loads"] += 1
            tally["live"] += 1
            tally["peak"] = max(tally["peak"], tally["live"])

    def __del__(self):
        if self.tally is not None:
            self.tally["live"] -= 1

    def __call__(self, x, t, cond=None):
        self.inputs.append(x.clone())
        return gaussian_velocity(MEANS[self.k], STD, x, t)


def eager_slots(missing=()):
    """Slots over four already built experts (returned too, to inspect their calls) and the list of loads."""
    experts, loads = [Expert(k) for k in range(4)], []

    def loader(k):
        def load():
            loads.append(k)
            return experts[k]
        return load

    return [ExpertSlot(NAMES[k], None if k in missing else loader(k)) for k in range(4)], experts, loads


def exact_router(x, t, cond=None):
    return DATA.posterior(x, t.expand(x.shape[0]))


def table_router(probs):
    return lambda x, t, cond=None: probs


def noisy_points(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x_t on the canonical path from the data, t uniform in (0, 1), float64."""
    g = torch.Generator().manual_seed(seed)
    x0, _ = DATA.sample(n, g)
    t = torch.rand(n, generator=g, dtype=torch.float64).clamp(1e-4, 1 - 1e-4)
    eps = torch.randn(n, 2, generator=g, dtype=torch.float64)
    return (1 - t)[:, None] * x0 + t[:, None] * eps, t


def exact_components(x, t):
    """u_k(x, t) of each cluster alone, (B, K, 2), from the closed form."""
    return torch.stack([gaussian_velocity(m, STD, x, t) for m in MEANS], dim=1)


# --- the experts and the factorisation --------------------------------------------------------------------------
@pytest.mark.parametrize("mean,std", [([2.0, -2.0], 0.3), ([0.5, 1.0], 1.7)])
def test_closed_form_expert_is_the_single_gaussian_velocity(mean, std):
    x, t = torch.randn(500, 2, dtype=torch.float64) * 3, torch.rand(500, dtype=torch.float64)
    assert torch.allclose(gaussian_velocity(mean, std, x, t), GaussianMixture([mean], std).velocity(x, t), atol=1e-12)
    # Independently: the velocity is linear in x_t, so it is the least-squares fit of eps - x0 on (1, x_t):
    # its residual has mean zero and is uncorrelated with x_t (Monte Carlo, 4 standard errors).
    g = torch.Generator().manual_seed(0)
    n, tt = 200_000, 0.4
    x0 = torch.tensor(mean, dtype=torch.float64) + std * torch.randn(n, 2, generator=g, dtype=torch.float64)
    eps = torch.randn(n, 2, generator=g, dtype=torch.float64)
    xt = (1 - tt) * x0 + tt * eps
    residual = (eps - x0) - gaussian_velocity(mean, std, xt, torch.full((n,), tt, dtype=torch.float64))
    centred = xt - xt.mean(0)
    assert residual.mean(0).abs().max() < 4 * residual.std() / n**0.5
    covariance = (residual[:, :, None] * centred[:, None, :]).mean(0)
    assert covariance.abs().max() < 4 * residual.std() * centred.std() / n**0.5


def test_full_mixture_of_cluster_experts_is_the_data_velocity():
    """The paper's identity u = sum_k p(k | x_t) u_k, at many (x_t, t)."""
    slots, _, _ = eager_slots()
    mixture = Mixture(slots, exact_router, routing="full")
    x, t = noisy_points(4000, seed=1)
    assert torch.allclose(mixture(x, t), DATA.velocity(x, t), rtol=0, atol=1e-6)
    far = torch.randn(1000, 2, dtype=torch.float64) * 4
    t_far = torch.rand(1000, dtype=torch.float64).clamp(1e-4, 1 - 1e-4)
    assert torch.allclose(mixture(far, t_far), DATA.velocity(far, t_far), rtol=0, atol=1e-6)


# --- routing policies ------------------------------------------------------------------------------------------
PROBS = torch.tensor([[0.6, 0.25, 0.1, 0.05], [0.03, 0.55, 0.4, 0.02], [0.05, 0.04, 0.46, 0.45], [0.0, 0.0, 0.0, 1.0],
                      [0.5, 0.25, 0.125, 0.125]], dtype=torch.float64)
# The experts each policy must select for each row of PROBS, worked out by hand. An expert of probability zero is
# never selected; nucleus:P keeps the smallest set reaching P (0.5 + 0.25 reaches 0.75 exactly).
SELECTIONS = {
    "full": [{0, 1, 2, 3}, {0, 1, 2, 3}, {0, 1, 2, 3}, {3}, {0, 1, 2, 3}],
    "top1": [{0}, {1}, {2}, {3}, {0}],
    "topk:2": [{0, 1}, {1, 2}, {2, 3}, {3}, {0, 1}],
    "nucleus:0.9": [{0, 1, 2}, {1, 2}, {2, 3}, {3}, {0, 1, 2, 3}],
    "nucleus:0.75": [{0, 1}, {1, 2}, {2, 3}, {3}, {0, 1}],
    "nucleus:1": [{0, 1, 2, 3}, {0, 1, 2, 3}, {0, 1, 2, 3}, {3}, {0, 1, 2, 3}],
}


@pytest.mark.parametrize("routing", list(SELECTIONS))
def test_policies_select_the_right_experts_and_renormalise(routing):
    slots, experts, _ = eager_slots()
    mixture = Mixture(slots, table_router(PROBS), routing=routing)
    x, t = torch.randn(5, 2, dtype=torch.float64), torch.full((5,), 0.5, dtype=torch.float64)
    out = mixture(x, t)
    chosen = SELECTIONS[routing]
    for k, expert in enumerate(experts):
        rows = [i for i, s in enumerate(chosen) if k in s]
        assert len(expert.inputs) == 1 and torch.equal(expert.inputs[0], x[rows]), (k, rows)
    assert mixture.evaluations == sum(len(s) for s in chosen)
    assert mixture.evaluations_by_expert == [sum(k in s for s in chosen) for k in range(4)]
    velocities = exact_components(x, t)
    for i, s in enumerate(chosen):
        w = torch.tensor([PROBS[i, k] if k in s else 0.0 for k in range(4)], dtype=torch.float64)
        assert torch.allclose(out[i], (w / w.sum()) @ velocities[i], atol=1e-12), (routing, i)


@pytest.mark.parametrize("routing", ["full", "top1", "topk:3", "nucleus:0.99", "sample", "ancestral"])
def test_one_hot_router_gives_the_selected_expert(routing):
    labels = torch.randint(0, 4, (64,), generator=torch.Generator().manual_seed(2))
    slots, _, _ = eager_slots()
    mixture = Mixture(slots, table_router(torch.nn.functional.one_hot(labels, 4).double()), routing=routing)
    field = mixture.assigned(labels) if mixture.routing.needs_assignment else mixture
    x, t = torch.randn(64, 2, dtype=torch.float64), torch.rand(64, dtype=torch.float64)
    expected = exact_components(x, t)[torch.arange(64), labels]
    assert torch.allclose(field(x, t), expected, atol=1e-12)
    assert mixture.evaluations == 64 and mixture.calls_per_sample(64) == 1.0


def test_an_assignment_belongs_to_its_batch_not_to_the_mixture():
    """Ancestral routing's experts travel with the batch they were drawn for (`Mixture.assigned`): two batches
    assigned differently, called in turns, each keep their own experts; the mixture itself keeps no assignment."""
    mixture = Mixture(eager_slots()[0], None, routing="ancestral")
    x, t = noisy_points(4, seed=12)
    first, second = torch.tensor([0, 1, 2, 3]), torch.tensor([3, 3, 1, 0])
    one, other = mixture.assigned(first), mixture.assigned(second)
    components = exact_components(x, t)
    for field, clusters in [(one, first), (other, second), (one, first)]:
        assert torch.equal(field(x, t), components[torch.arange(4), clusters])
    with pytest.raises(RuntimeError, match="assigned"):
        mixture(x, t)


@pytest.mark.parametrize("routing", ["top1", "full"])
def test_unneeded_experts_are_neither_loaded_nor_called(routing):
    slots, experts, loads = eager_slots()
    mixture = Mixture(slots, PriorRouter([0.0, 0.0, 1.0, 0.0]), routing=routing)
    assert mixture.loaded_names == [] and loads == []  # nothing loads before it is used
    x = torch.randn(32, 2, dtype=torch.float64)
    for t in (0.9, 0.5, 0.1):
        mixture(x, torch.tensor(t, dtype=torch.float64))
    assert loads == [2] and mixture.loaded_names == ["expert2"]
    assert [len(e.inputs) for e in experts] == [0, 0, 3, 0]
    assert mixture.evaluations_by_expert == [0, 0, 96, 0]


def test_at_most_max_loaded_experts_are_alive_and_results_do_not_change():
    tally = {"loads": 0, "live": 0, "peak": 0}
    lazy = [ExpertSlot(NAMES[k], lambda k=k: Expert(k, tally)) for k in range(4)]
    limited = Mixture(lazy, exact_router, routing="full", max_loaded=1)
    unlimited = Mixture(eager_slots()[0], exact_router, routing="full")
    x, t = noisy_points(256, seed=3)
    t = t.clamp(0.3, 0.95)  # every cluster has some posterior mass at every point
    for _ in range(3):
        out = limited(x, t)
        assert len(limited.loaded_names) == 1
        assert torch.equal(out, unlimited(x, t))
    assert tally["peak"] == 1
    assert limited.evaluations_by_expert == [3 * 256] * 4
    # The expert still loaded is used first in the next call: 4 loads, then 3 per call.
    assert tally["loads"] == 4 + 3 + 3
    del limited
    assert tally["live"] == 0


# --- missing experts -------------------------------------------------------------------------------------------
def test_missing_expert_is_routed_around_with_one_warning():
    slots, experts, loads = eager_slots(missing=(1,))
    mixture = Mixture(slots, exact_router, routing="full")
    x, t = noisy_points(2000, seed=4)
    with pytest.warns(UserWarning, match="expert1"):
        out = mixture(x, t)
    posterior = DATA.posterior(x, t)
    posterior[:, 1] = 0
    expected = ((posterior / posterior.sum(1, keepdim=True))[:, :, None] * exact_components(x, t)).sum(1)
    assert torch.allclose(out, expected, atol=1e-10)
    assert not torch.allclose(out, DATA.velocity(x, t), atol=1e-3)  # the missing cluster did matter
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mixture(x, t)  # warned once only
    assert 1 not in loads and experts[1].inputs == []

    top1 = Mixture(slots, exact_router, routing="top1")
    with pytest.warns(UserWarning, match="expert1"):
        out = top1(x, t)
    nearest_available = posterior.argmax(1)
    assert torch.allclose(out, exact_components(x, t)[torch.arange(2000), nearest_available], atol=1e-12)

    # All of a sample's probability on the missing expert: spread evenly over the others.
    stranded = Mixture(slots, PriorRouter([0.0, 1.0, 0.0, 0.0]), routing="full")
    with pytest.warns(UserWarning, match="expert1"):
        out = stranded(x[:8], t[:8])
    assert torch.allclose(out, exact_components(x[:8], t[:8])[:, [0, 2, 3]].mean(1), atol=1e-12)

    ancestral = Mixture(slots, None, routing="ancestral")
    with pytest.raises(ValueError, match="expert1"):
        ancestral.assigned(torch.tensor([0, 1, 2, 3]))


def test_no_available_expert_is_an_error():
    with pytest.raises(ValueError, match="no expert is available"):
        Mixture([ExpertSlot(name, None) for name in NAMES], exact_router)


# --- sampling --------------------------------------------------------------------------------------------------
def _mode_masses(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    modes = DATA.posterior(x, torch.zeros(x.shape[0], dtype=torch.float64)).argmax(1)
    return modes, torch.bincount(modes, minlength=4).double() / x.shape[0]


@pytest.mark.parametrize("routing", ["full", "top1", "ancestral"])
def test_sampling_with_exact_experts_covers_every_mode(routing):
    n, steps = 4000, 32
    noise = torch.randn(n, 2, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    slots, _, _ = eager_slots()
    mixture = Mixture(slots, exact_router, routing=routing)
    counts = (torch.tensor(WEIGHTS) * n).round().long()
    clusters = torch.repeat_interleave(torch.arange(4), counts)
    x = sample(mixture.assigned(clusters) if routing == "ancestral" else mixture, noise, steps=steps, solver="heun")
    modes, masses = _mode_masses(x)
    assert (masses > 0).all(), masses
    if routing == "full":
        assert torch.allclose(masses, DATA.weights, atol=0.03), masses
        assert mixture.calls_per_sample(n) <= 4 * evaluations_per_sample("heun", steps)
    else:
        assert mixture.calls_per_sample(n) == evaluations_per_sample("heun", steps)
    if routing == "ancestral":
        assert torch.allclose(masses, DATA.weights, atol=0.03), masses
        assert (modes == clusters).double().mean() > 0.99  # each sample ends in its assigned cluster


def test_nucleus_with_p_one_is_full_routing():
    x, t = noisy_points(2000, seed=9)
    full = Mixture(eager_slots()[0], exact_router, routing="full")(x, t)
    assert torch.equal(Mixture(eager_slots()[0], exact_router, routing="nucleus:1")(x, t), full)


def test_ancestral_then_topk_switches_to_the_router_at_its_time():
    """Above the switch each sample keeps its assigned expert; at and below it, the router's top-2 (PROBS' rows)."""
    slots, _, _ = eager_slots()
    mixture = Mixture(slots, table_router(PROBS), routing="ancestral_then:topk:2@0.4")
    assigned = torch.tensor([3, 3, 0, 1, 2])
    x = torch.randn(5, 2, dtype=torch.float64)
    components = exact_components(x, torch.full((5,), 0.5, dtype=torch.float64))
    early = mixture.assigned(assigned)(x, torch.full((5,), 0.5, dtype=torch.float64))
    assert torch.equal(early, components[torch.arange(5), assigned])
    # samples 1, 2 and 4 are past the switch: the router is asked about them alone
    t = torch.tensor([0.41, 0.4, 0.3, 0.9, 0.1], dtype=torch.float64)
    table = Mixture(slots, table_router(PROBS[[1, 2, 4]]), routing="topk:2")(x[[1, 2, 4]], t[[1, 2, 4]])
    hybrid = Mixture(slots, table_router(PROBS[[1, 2, 4]]), routing="ancestral_then:topk:2@0.4")
    out = hybrid.assigned(assigned)(x, t)
    own = exact_components(x, t)[torch.arange(5), assigned]
    assert torch.equal(out[[0, 3]], own[[0, 3]]) and torch.allclose(out[[1, 2, 4]], table, atol=1e-12)


@pytest.mark.parametrize("conditional", [False, True])
def test_ancestral_sampling_of_exact_experts_reproduces_unequal_mode_masses(conditional):
    """p(x) = sum_k pi_k p_k(x): drawing the expert once per sample from pi (or from p(cluster | class)) and keeping
    it is exact. Mode masses within 4 standard errors of the weights (samples drawn per class when conditional)."""
    n, steps = 8000, 24
    manifest = {"prior": WEIGHTS, "prior_by_class": [[0.7, 0.0, 0.3, 0.0], [0.0, 0.1, 0.0, 0.9]]}
    labels = torch.arange(n) % 2 if conditional else None
    clusters = ancestral_clusters(manifest, seed=3, first=0, num=n, labels=labels)
    mixture = Mixture(eager_slots()[0], None, routing="ancestral")
    noise = torch.randn(n, 2, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    modes, _ = _mode_masses(sample(mixture.assigned(clusters), noise, steps=steps, solver="heun"))
    groups = [(labels == c, torch.tensor(manifest["prior_by_class"][c])) for c in range(2)] if conditional else \
        [(torch.ones(n, dtype=torch.bool), DATA.weights)]
    for rows, weights in groups:
        masses = torch.bincount(modes[rows], minlength=4).double() / rows.sum()
        se = (weights * (1 - weights) / rows.sum()).sqrt()
        assert ((masses - weights).abs() <= 4 * se + 1e-3).all(), (masses, weights)


def test_sample_routing_draws_by_the_probabilities_reproducibly():
    n = 20_000
    x, t = torch.randn(n, 2, dtype=torch.float64), torch.full((n,), 0.5, dtype=torch.float64)

    def run(seed):
        mixture = Mixture(eager_slots()[0], PriorRouter(WEIGHTS), routing="sample", seed=seed)
        return [mixture(x, t) for _ in range(2)], mixture

    (first, second), mixture = run(seed=7)
    (again_first, again_second), _ = run(seed=7)
    (other_first, _), _ = run(seed=8)
    assert torch.equal(first, again_first) and torch.equal(second, again_second)
    assert not torch.equal(first, second)  # a fresh draw at every call
    assert not torch.equal(first, other_first)
    frequencies = torch.tensor(mixture.evaluations_by_expert, dtype=torch.float64) / (2 * n)
    assert torch.allclose(frequencies, DATA.weights, atol=0.01), frequencies  # standard error < 0.0025


# --- the policy's spelling and misuse ----------------------------------------------------------------------------
def test_parse_routing():
    assert parse_routing("full") == Routing("full")
    assert parse_routing() == parse_routing("ancestral") == parse_routing("oracle") == Routing("ancestral")
    assert parse_routing("top1") == Routing("topk", top_k=1)
    assert parse_routing("topk:3") == Routing("topk", top_k=3)
    assert parse_routing("nucleus:0.9") == parse_routing("threshold:0.9") == Routing("nucleus", p=0.9)
    assert parse_routing("nucleus:1") == Routing("nucleus", p=1.0)
    assert parse_routing("sample") == Routing("sample")
    assert parse_routing("ancestral_then:topk:2@0.3") == Routing("ancestral_then", top_k=2, switch=0.3)
    assert parse_routing("ancestral_then:top1@0.5") == Routing("ancestral_then", top_k=1, switch=0.5)


@pytest.mark.parametrize("spec", ["topk:0", "topk:", "topk:-1", "topk:two", "nucleus:0", "nucleus:1.5",
                                  "nucleus:nan", "threshold", "top1:2", "full:1", "best", "",
                                  "ancestral_then:topk:2", "ancestral_then:full@0.5", "ancestral_then:topk:2@1",
                                  "ancestral_then:topk:2@x", "ancestral_then:ancestral@0.5"])
def test_parse_routing_rejects_bad_specs(spec):
    with pytest.raises(ValueError, match=re.escape(f"--routing: {spec!r}")):
        parse_routing(spec)


def test_misuse_is_reported():
    slots, _, _ = eager_slots()
    with pytest.raises(ValueError, match="topk:5"):
        Mixture(slots, exact_router, routing="topk:5")
    with pytest.raises(ValueError, match="needs a router"):
        Mixture(slots, None, routing="top1")
    with pytest.raises(ValueError, match="ancestral"):
        Mixture(slots, exact_router, routing="top1").assigned(torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="needs a router"):
        Mixture(slots, None, routing="ancestral_then:top1@0.5")
    ancestral = Mixture(slots, None, routing="ancestral")
    x, t = torch.randn(4, 2, dtype=torch.float64), torch.rand(4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="assigned"):
        ancestral(x, t)
    with pytest.raises(ValueError, match="batch of 4"):
        ancestral.assigned(torch.tensor([0, 1, 2]))(x, t)
    with pytest.raises(ValueError, match="shape"):
        Mixture(slots, table_router(PROBS[:, :3]), routing="full")(x, t)


def test_ancestral_routing_draws_a_conditional_sample_from_the_clusters_of_its_class():
    manifest = {"prior": [0.5, 0.3, 0.2], "prior_by_class": [[0.0, 1.0, 0.0], [0.25, 0.0, 0.75]]}
    n = 30_000
    labels = torch.arange(n) % 3  # 2 = no label (2 classes)
    drawn = ancestral_clusters(manifest, seed=0, first=0, num=n, labels=labels)

    def share(c):
        return torch.bincount(drawn[labels == c], minlength=3).double() / (labels == c).sum()

    assert (drawn[labels == 0] == 1).all()  # a class held by one cluster always goes to that expert
    # 10k draws each: the standard error of a share is at most 0.005
    assert torch.allclose(share(1), torch.tensor([0.25, 0.0, 0.75], dtype=torch.float64), atol=0.02)
    assert torch.allclose(share(2), torch.tensor(manifest["prior"], dtype=torch.float64), atol=0.02)
    # sample i's draw is its own, whatever batch it comes in
    assert torch.equal(ancestral_clusters(manifest, 0, 100, 50, labels[100:150]), drawn[100:150])
    # unconditional samples (or a partition without classes) draw from the cluster sizes
    sizes = torch.bincount(ancestral_clusters(manifest, 0, 0, n), minlength=3).double() / n
    assert torch.allclose(sizes, torch.tensor(manifest["prior"], dtype=torch.float64), atol=0.02)


def test_a_routed_batch_is_drawn_wide_enough_for_each_expert_to_get_one_models_call():
    """A policy that sends every sample to one of K experts draws K batches at once (K / k for top-k), so that each
    expert's calls hold about one model's batch; under full and nucleus routing every expert may see every sample.
    K counts the available experts."""
    slots = eager_slots()[0]
    widths = {policy: Mixture(slots, exact_router, policy).samples_at_once(64)
              for policy in ("ancestral", "top1", "sample", "topk:2", "ancestral_then:topk:2@0.3", "full",
                             "nucleus:0.9")}
    assert widths == {"ancestral": 256, "top1": 256, "sample": 256, "topk:2": 128, "ancestral_then:topk:2@0.3": 128,
                      "full": 64, "nucleus:0.9": 64}
    assert Mixture(eager_slots(missing=(1,))[0], exact_router, "top1").samples_at_once(64) == 192


@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_no_expert_call_holds_more_than_one_models_batch_whatever_the_router_sends_it(scale):
    """A router that sends all 8 samples of a wide batch to one expert: with call_batch=3 the expert runs them
    in equal calls of at most 3 (3 + 3 + 2), and the velocity is the one uncapped calls give."""
    one_hot = torch.zeros(8, 4, dtype=torch.float64)
    one_hot[:, 2] = 1.0
    x, t = torch.randn(8, 2, dtype=torch.float64), torch.full((8,), 0.4, dtype=torch.float64)
    labels = torch.arange(8) % 3
    outputs, calls = [], []
    for cap in (None, 3):
        experts = [GuidedExpert(k) for k in range(4)]
        slots = [ExpertSlot(NAMES[k], lambda k=k, experts=experts: experts[k]) for k in range(4)]
        mixture = Mixture(slots, table_router(one_hot), "top1", call_batch=cap)
        if cap is not None:
            assert mixture.samples_at_once(cap) == 12  # K batches of 3 drawn at once
        outputs.append(guided(mixture, scale)(x, t, labels))
        calls.append([seen.shape[0] for seen in experts[2].inputs])
    halves = 2 if scale != 1.0 else 1
    assert calls[0] == [8] * halves and calls[1] == [n for n in (3, 3, 2) for _ in range(halves)]
    assert torch.equal(outputs[0], outputs[1])


def test_ancestral_samples_do_not_depend_on_how_many_are_drawn_at_once():
    """Each sample's noise and expert come from its own stream, so drawing 40 samples 7 or 40 at a time (or as
    wide as samples_at_once makes it) gives the same samples exactly."""
    samples = []
    for batch in (7, 40, 160):
        mixture = Mixture(eager_slots()[0], None, routing="ancestral")
        opts = SampleConfig(steps=6, solver="heun", batch_size=batch)
        samples.append(generate(mixture, (2,), 40, opts, 5, None,
                                for_batch=ancestral_assignment(mixture, {"prior": WEIGHTS}, 5)))
    assert torch.equal(samples[0], samples[1]) and torch.equal(samples[1], samples[2])
    assert samples[0].std() > 0.5  # samples, not a constant


# --- classifier-free guidance inside each expert -------------------------------------------------------------------
class GuidedExpert(Expert):
    """The exact expert of cluster k, shifted by 0.1 * (label + 1) when a label is given: a conditional velocity
    that differs from the unconditional one, so that guidance moves it."""

    def __call__(self, x, t, cond=None):
        v = super().__call__(x, t)
        return v if cond is None else v + 0.1 * (cond.to(x.dtype) + 1).unsqueeze(1)


def label_aware_router(x, t, cond=None):
    """PROBS with the label, and PROBS' columns reversed without it: the two halves would go to other experts."""
    return PROBS[:, [3, 2, 1, 0]] if cond is None else PROBS


@pytest.mark.parametrize("routing", ["top1", "topk:2", "nucleus:0.9"])
def test_guidance_runs_inside_each_expert_the_conditional_half_routes(routing):
    """v = sum_k w_k(x, t, c) [u_k + s (u_k(c) - u_k)]: each selected expert is asked both halves on the same rows,
    the router once per evaluation, by the conditional call."""
    experts = [GuidedExpert(k) for k in range(4)]
    router_calls = []
    mixture = Mixture([ExpertSlot(NAMES[k], lambda k=k: experts[k]) for k in range(4)],
                      lambda x, t, cond=None: router_calls.append(cond) or label_aware_router(x, t, cond), routing)
    x, t = torch.randn(5, 2, dtype=torch.float64), torch.full((5,), 0.5, dtype=torch.float64)
    labels, scale = torch.tensor([0, 1, 2, 3, 4]), 2.5
    out = guided(mixture, scale)(x, t, labels)
    assert len(router_calls) == 1 and router_calls[0] is labels
    chosen = SELECTIONS[routing]
    for k, expert in enumerate(experts):
        rows = [i for i, s in enumerate(chosen) if k in s]
        assert len(expert.inputs) == (2 if rows else 0)
        assert all(torch.equal(seen, x[rows]) for seen in expert.inputs), k
    uncond = exact_components(x, t)
    cond = uncond + 0.1 * (labels.double() + 1)[:, None, None]
    for i, s in enumerate(chosen):
        w = torch.tensor([PROBS[i, k] if k in s else 0.0 for k in range(4)], dtype=torch.float64)
        expected = (w / w.sum()) @ (uncond[i] + scale * (cond[i] - uncond[i]))
        assert torch.allclose(out[i], expected, atol=1e-12), (routing, i)
    assert mixture.evaluations == 2 * sum(len(s) for s in chosen) and mixture.router_evaluations == 5


def test_ancestral_guidance_inside_each_expert_is_guidance_of_the_mixture_to_the_bit():
    """Under ancestral routing a sample has one expert, so guiding inside it or guiding the mixture's two calls is
    the same sum; the samples are identical."""
    labels = torch.arange(40) % 5
    samples = []
    for inside in (True, False):
        mixture = Mixture([ExpertSlot(NAMES[k], lambda k=k: GuidedExpert(k)) for k in range(4)], None, "ancestral")
        assign = ancestral_assignment(mixture, {"prior": WEIGHTS}, 5)

        def for_batch(lo, hi, cond, inside=inside, assign=assign):
            field = assign(lo, hi, cond)
            return field if inside else (lambda x, t, c=None: field(x, t, c))  # no `guided` to find

        opts = SampleConfig(steps=6, solver="heun", batch_size=40, guidance=3.0)
        samples.append(generate(mixture, (2,), 40, opts, 5, labels, for_batch=for_batch))
    assert torch.equal(samples[0], samples[1]) and samples[0].std() > 0.5


def test_experts_spread_over_ranks_guide_inside_each_expert_as_one_process_does(tmp_path):
    """ExpertParallelMixture on a one-rank gloo group: the pairs travel through the all-to-all code and come back
    guided exactly as the single-process mixture guides them."""
    import torch.distributed as dist

    from islands.ddm.expert_parallel import ExpertParallelMixture
    from islands.parallel.launch import World

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        x, t = torch.randn(5, 2, dtype=torch.float64), torch.full((5,), 0.5, dtype=torch.float64)
        labels = torch.tensor([0, 1, 2, 3, 4])
        outputs = []
        for spread in (False, True):
            experts = [GuidedExpert(k) for k in range(4)]
            # spread, and in calls of at most 2 samples, which changes nothing but the calls
            mixture = Mixture([ExpertSlot(NAMES[k], lambda k=k, experts=experts: experts[k]) for k in range(4)],
                              label_aware_router, "topk:2", call_batch=2 if spread else None)
            field = ExpertParallelMixture(mixture, World()) if spread else mixture
            outputs.append(guided(field, 2.5)(x, t, labels))
        assert torch.equal(outputs[0], outputs[1])
        assert max(seen.shape[0] for expert in experts for seen in expert.inputs) == 2
        assert field.evaluations == 2 * sum(len(s) for s in SELECTIONS["topk:2"])
    finally:
        dist.destroy_process_group()
