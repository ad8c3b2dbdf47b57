"""Decentralized Diffusion Models (McAllister et al. 2025, arXiv 2501.05450): K experts and a router as one Denoiser.

Partition the data into clusters k. On the canonical path x_t = (1 - t) x0 + t eps the marginal velocity of the
whole data set factors exactly as

    u(x_t, t) = sum_k p(k | x_t, t) u_k(x_t, t),

where u_k is the marginal velocity of cluster k alone and p(k | x_t, t) the posterior of the cluster given the noisy
point. Expert k, trained on cluster k only, estimates u_k; a router estimates p(k | x_t, t). `Mixture` combines
them under a routing policy that may evaluate only a few experts per sample, and is itself a `Denoiser`, so every
sampler runs it unchanged.
"""

import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import Tensor, nn

from islands.errors import ConfigError, IslandsWarning
from islands.flow.denoiser import Denoiser, broadcast

ROUTINGS = ("ancestral", "full", "top1", "topk:K", "nucleus:P", "sample", "ancestral_then:topk:K@T")
ALIASES = {"oracle": "ancestral", "threshold": "nucleus"}  # the names of earlier releases
DEFAULT_ROUTING = "ancestral"  # the best of the measured policies (docs/BENCHMARKS.md, ddm_gmm and ddm_fashion)


@dataclass(frozen=True)
class ExpertSlot:
    """A named expert, loaded on first use by `load`; `load=None` marks it missing (never trained, or its files
    are absent), and `missing` says which, for the warning."""

    name: str
    load: Callable[[], Denoiser] | None
    missing: str = "is missing"

    @property
    def available(self) -> bool:
        return self.load is not None


class Router(Protocol):
    """Estimates p(k | x_t, t): probabilities of shape (B, K) whose rows sum to 1."""

    def __call__(self, x: Tensor, t: Tensor, cond: Tensor | None = None) -> Tensor: ...


class PriorRouter:
    """The same probabilities for every sample (e.g. cluster sizes): p(k | x_t, t) at t = 1, where x_t is noise."""

    def __init__(self, probabilities):
        p = torch.as_tensor(probabilities, dtype=torch.float64)
        if p.dim() != 1 or (p < 0).any() or p.sum() <= 0:
            raise ValueError(f"probabilities must be K non-negative numbers with a positive sum, got {probabilities}")
        self.probabilities = p / p.sum()

    def __call__(self, x: Tensor, t: Tensor, cond: Tensor | None = None) -> Tensor:
        return self.probabilities.to(x.device).expand(x.shape[0], -1)


@dataclass(frozen=True)
class Routing:
    """A parsed routing policy.

    ancestral: each sample's expert is drawn once, from p(cluster | condition), and kept from noise to data: exact
        ancestral sampling of p(x) = sum_k p(k) p_k(x), no router needed. full: every expert, weighted by the
        router. topk (top1 is top_k = 1): the router's k likeliest, renormalised. nucleus: the smallest set whose
        router probability reaches `p` (top-p). sample: one expert per call, drawn from the router.
        ancestral_then: the ancestral expert while t > `switch`, the router's top_k after.
    """

    policy: str
    top_k: int = 1
    p: float = 1.0
    switch: float = 0.0

    @property
    def needs_assignment(self) -> bool:  # each sample's ancestral expert, given by `Mixture.assigned`
        return self.policy in ("ancestral", "ancestral_then")

    @property
    def needs_router(self) -> bool:
        return self.policy != "ancestral"


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("nan")  # rejected by the range checks


def parse_routing(spec: str = DEFAULT_ROUTING) -> Routing:
    """Parse a policy of ROUTINGS (or an alias: oracle = ancestral, threshold:P = nucleus:P)."""
    name, colon, arg = spec.partition(":")
    name = ALIASES.get(name, name)
    if name in ("full", "top1", "sample", "ancestral") and not colon:
        return Routing("topk") if name == "top1" else Routing(name)
    if name == "topk" and arg.isdecimal() and int(arg) >= 1:
        return Routing("topk", top_k=int(arg))
    if name == "nucleus" and 0 < _number(arg) <= 1:
        return Routing("nucleus", p=_number(arg))
    late, at, switch = arg.rpartition("@")
    if name == "ancestral_then" and at and 0 < _number(switch) < 1:
        try:
            after = parse_routing(late)
        except ValueError:
            after = None
        if after is not None and after.policy == "topk":
            return Routing("ancestral_then", top_k=after.top_k, switch=_number(switch))
    raise ValueError(f"--routing: {spec!r} is not a routing policy; choose from {', '.join(ROUTINGS)} "
                     "(K >= 1, 0 < P <= 1, 0 < T < 1)")


class Mixture(nn.Module):
    """sum_k w_k(x_t, t) u_k(x_t, t) over the experts a routing policy selects, as a `Denoiser`.

    The router's probabilities of missing experts are set to zero and the rest renormalised; a sample whose
    probability lies entirely on missing experts is spread uniformly over the available ones. The policy selects
    experts per sample (never one with zero probability) and their probabilities are renormalised per sample.
    Each selected expert runs once per call, on exactly the samples that selected it. Experts load on first use;
    with `max_loaded`, the least recently used ones are dropped to keep at most that many loaded.
    """

    def __init__(
        self,
        experts: list[ExpertSlot],
        router: Router | None,
        routing: str | Routing = DEFAULT_ROUTING,
        max_loaded: int | None = None,
        seed: int = 0,
        time_boundaries: list[float] = (),
        call_batch: int | None = None,
    ):
        super().__init__()
        # where the experts' own timestep-range experts hand over (a cluster x range grid), for the samplers' grids
        self.time_boundaries = list(time_boundaries)
        self.routing = parse_routing(routing) if isinstance(routing, str) else routing
        self.slots = list(experts)
        if not any(slot.available for slot in self.slots):
            raise ValueError(f"no expert is available among {[slot.name for slot in self.slots]}")
        if self.routing.top_k > len(self.slots):
            raise ConfigError(f"--routing: 'topk:{self.routing.top_k}' selects more than the {len(self.slots)} "
                              "experts")
        if router is None and self.routing.needs_router:
            raise ValueError(f"routing {self.routing.policy!r} needs a router")
        if max_loaded is not None and max_loaded < 1:
            raise ConfigError(f"--max-loaded: {max_loaded} must be at least 1")
        if call_batch is not None and call_batch < 1:
            raise ValueError(f"call_batch must be >= 1, got {call_batch}")
        self.router = router
        self.max_loaded = max_loaded
        self.generator = torch.Generator().manual_seed(seed)
        self.available = torch.tensor([slot.available for slot in self.slots])
        self._loaded: OrderedDict[int, Denoiser] = OrderedDict()  # least recently used first
        self._warned_missing = False
        self.call_batch = call_batch  # the most samples one expert call holds (None: no limit)
        self.reset_counts()

    # --- bookkeeping ----------------------------------------------------------------------------
    def reset_counts(self) -> None:
        self.evaluations = 0  # (sample, expert) pairs evaluated, over all calls
        self.evaluations_by_expert = [0] * len(self.slots)
        self.router_evaluations = 0  # samples the router was asked about (none under ancestral routing)

    def calls_per_sample(self, num_samples: int) -> float:
        """Expert evaluations per sample, for `num_samples` samples generated since the last `reset_counts`."""
        return self.evaluations / num_samples

    def samples_at_once(self, batch_size: int) -> int:
        """How many samples to draw at once so that each expert's calls hold about `batch_size` (the mixture's
        `call_batch`), as one model's calls do: a policy that sends every sample to one of K experts splits a batch K
        ways, and small calls waste an accelerator. Under full and nucleus routing an expert may see every sample:
        `batch_size` itself. No expert call holds more than `call_batch` samples: a router that sends most of a wide
        batch to one expert would otherwise hand it K batches at once, beyond the memory the user planned for and
        slower per sample on a CPU (docs/BENCHMARKS.md section 12)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if self.routing.policy in ("full", "nucleus"):
            return batch_size
        return batch_size * int(self.available.sum()) // self.routing.top_k

    def in_calls(self, call: Callable, expert: Denoiser, rows: Tensor) -> Tensor:
        """call(expert, rows) in as few calls of at most `call_batch` samples as there can be, of equal sizes
        (400 rows under a cap of 256 run as 200 + 200, not 256 + 144)."""
        if self.call_batch is None or rows.numel() <= self.call_batch:
            return call(expert, rows)
        return torch.cat([call(expert, part) for part in rows.tensor_split(-(-rows.numel() // self.call_batch))])

    @property
    def loaded_names(self) -> list[str]:
        """Names of the loaded experts, least recently used first."""
        return [self.slots[k].name for k in self._loaded]

    @property
    def missing_names(self) -> list[str]:
        """Names of the experts whose slot has nothing to load."""
        return [slot.name for slot in self.slots if not slot.available]

    def assigned(self, clusters: Tensor) -> "MixtureView":
        """Ancestral routing: the mixture for a batch whose samples' experts are `clusters`, as a `Denoiser`."""
        if not self.routing.needs_assignment:
            raise ValueError(f"assigned() is for ancestral routing, not {self.routing.policy!r}")
        clusters = torch.as_tensor(clusters, dtype=torch.long)
        if clusters.dim() != 1 or (clusters < 0).any() or (clusters >= len(self.slots)).any():
            raise ValueError(f"clusters must be a vector of expert indices in [0, {len(self.slots)})")
        missing = sorted({self.slots[k].name for k in clusters.unique().tolist() if not self.slots[k].available})
        if missing:
            raise ValueError(f"ancestral routing assigns samples to missing experts {missing}")
        return MixtureView(self, assigned=clusters)

    # --- the velocity -----------------------------------------------------------------------------
    def for_range(self, i: int) -> Denoiser:
        """The mixture with each expert's timestep-range expert i answering (a cluster x range grid), for a sampler
        integrating range i."""
        return MixtureView(self, time_range=i)

    def forward(self, x: Tensor, t: Tensor, cond: Tensor | None = None, time_range: int | None = None,
                assigned: Tensor | None = None) -> Tensor:
        t = torch.as_tensor(t, dtype=x.dtype, device=x.device).expand(x.shape[0])
        weights = self.selection_weights(x, t, cond, assigned)  # (B, K), zero where not selected, rows sum to 1
        return self._combine(x, weights, lambda expert, rows: expert(x[rows], t[rows], None if cond is None
                                                                     else cond[rows]), time_range)

    def guided(self, scale: float, time_range: int | None = None, assigned: Tensor | None = None) -> Denoiser:
        """Classifier-free guidance inside each expert, as the samplers' `guided` asks of a denoiser that has it:

            v = sum_k w_k(x_t, t, c) [u_k(x_t, t) + scale (u_k(x_t, t, c) - u_k(x_t, t))],

        the weights those of the conditional call. Guiding the mixture's two halves apart would route the
        unconditional half on its own, so that a sample's guidance direction could be the difference of two
        experts' predictions; here it is always one expert's, and the router runs once per evaluation, not twice.
        Under ancestral routing both are the same (each sample has one expert), to the bit."""
        def velocity(x: Tensor, t: Tensor, cond: Tensor | None = None) -> Tensor:
            if cond is None or scale == 1.0:
                return self.forward(x, t, cond, time_range, assigned)
            t = torch.as_tensor(t, dtype=x.dtype, device=x.device).expand(x.shape[0])

            def call(expert, rows):
                v_cond, v_uncond = expert(x[rows], t[rows], cond[rows]), expert(x[rows], t[rows], None)
                return v_uncond + scale * (v_cond - v_uncond)

            return self._combine(x, self.selection_weights(x, t, cond, assigned), call, time_range, calls=2)

        return velocity

    def _combine(self, x: Tensor, weights: Tensor, call: Callable, time_range: int | None, calls: int = 1) -> Tensor:
        """sum_k weights[:, k] call(expert k, its rows): each selected expert runs once, on the samples that selected
        it (`calls` network evaluations per sample each)."""
        selected = weights > 0
        order = [k for k in self._loaded if selected[:, k].any()]  # loaded experts first: fewer reloads
        order += [k for k in range(len(self.slots)) if k not in order and selected[:, k].any()]
        contributions = {}
        for k in order:
            rows = selected[:, k].nonzero().squeeze(1)
            v = self.in_calls(call, self.expert(k, time_range), rows).to(x.dtype)
            contributions[k] = (rows, broadcast(weights[rows, k], v) * v)
            self.evaluations += calls * rows.numel()
            self.evaluations_by_expert[k] += calls * rows.numel()
        out = torch.zeros_like(x)
        for k in sorted(contributions):  # a fixed order of summation, whatever was loaded
            rows, term = contributions[k]
            out[rows] += term
        return out

    def selection_weights(self, x: Tensor, t: Tensor, cond: Tensor | None, assigned: Tensor | None = None) -> Tensor:
        """Per-sample weights of the selected experts, float64 (B, K); `assigned`: each sample's ancestral expert."""
        batch, num = x.shape[0], len(self.slots)
        if self.routing.needs_assignment:
            if assigned is None:
                raise RuntimeError("ancestral routing: sample the mixture assigned(clusters), each sample's expert")
            if assigned.shape[0] != batch:
                raise ValueError(f"ancestral routing: {assigned.shape[0]} clusters assigned, batch of {batch}")
            ancestral = nn.functional.one_hot(assigned.to(x.device), num).double()
            if self.routing.policy == "ancestral":
                return ancestral
            late = t <= self.routing.switch  # ancestral_then: the router takes over from t = switch
            if not late.any():
                return ancestral
            ancestral[late] = self._routed(x[late], t[late], None if cond is None else cond[late])
            return ancestral
        return self._routed(x, t, cond)

    def _routed(self, x: Tensor, t: Tensor, cond: Tensor | None) -> Tensor:
        """The weights the router's probabilities give under the policy, float64 (B, K)."""
        batch, num = x.shape[0], len(self.slots)
        probs = self.router(x, t, cond).double()
        self.router_evaluations += batch
        if probs.shape != (batch, num):
            raise ValueError(f"the router returned shape {tuple(probs.shape)}, expected {(batch, num)}")
        probs = self._without_missing(probs)
        if self.routing.policy == "full" or (self.routing.policy == "nucleus" and self.routing.p >= 1):
            return probs  # top-p with p = 1 keeps every expert: full routing, without rounding in the cumulative sum
        if self.routing.policy == "sample":
            drawn = torch.multinomial(probs.cpu(), 1, generator=self.generator).squeeze(1)
            return nn.functional.one_hot(drawn.to(x.device), num).double()
        if self.routing.policy in ("topk", "ancestral_then"):
            keep = torch.zeros_like(probs, dtype=torch.bool)
            keep.scatter_(1, probs.topk(self.routing.top_k, dim=1).indices, True)
        else:  # nucleus: the smallest set whose probabilities reach p
            sorted_probs, indices = probs.sort(dim=1, descending=True)
            mass_before = sorted_probs.cumsum(1) - sorted_probs
            keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, indices, mass_before < self.routing.p)
        chosen = probs * keep
        return chosen / chosen.sum(1, keepdim=True)

    def _without_missing(self, probs: Tensor) -> Tensor:
        """The router's probabilities restricted to the available experts (uniform where none is left)."""
        available = self.available.to(device=probs.device, dtype=probs.dtype)
        if available.all():
            return probs
        self.warn_missing()
        probs = probs * available
        total = probs.sum(1, keepdim=True)
        uniform = available / available.sum()
        return torch.where(total > 0, probs / total.clamp_min(1e-300), uniform)

    def warn_missing(self) -> None:
        """One warning per missing expert, the first time the mixture routes around it."""
        if not self._warned_missing:
            for slot in self.slots:
                if not slot.available:
                    warnings.warn(f"{slot.name} {slot.missing}; routing around it", IslandsWarning, stacklevel=3)
            self._warned_missing = True

    def expert(self, k: int, time_range: int | None = None) -> Denoiser:
        """Expert k (its timestep-range expert `time_range`, in a grid), loaded if need be, dropping the least
        recently used beyond `max_loaded`."""
        if k in self._loaded:
            self._loaded.move_to_end(k)
        else:
            if self.max_loaded is not None:
                while len(self._loaded) >= self.max_loaded:
                    self._loaded.popitem(last=False)
            self._loaded[k] = self.slots[k].load()
        expert = self._loaded[k]
        return expert if time_range is None else expert.for_range(time_range)


@dataclass(frozen=True)
class MixtureView:
    """A mixture (one process's or spread over ranks) as a `Denoiser` for one purpose: its experts answering with
    their timestep-range expert `time_range`, and/or each sample of the batch sent to its ancestral expert
    `assigned`; guided like the mixture."""

    mixture: nn.Module
    time_range: int | None = None
    assigned: Tensor | None = None

    @property
    def time_boundaries(self) -> list[float]:
        return [] if self.time_range is not None else self.mixture.time_boundaries

    def for_range(self, i: int) -> Denoiser:
        return replace(self, time_range=i)

    def __call__(self, x: Tensor, t: Tensor, cond: Tensor | None = None) -> Tensor:
        return self.mixture(x, t, cond, time_range=self.time_range, assigned=self.assigned)

    def guided(self, scale: float) -> Denoiser:
        return self.mixture.guided(scale, self.time_range, self.assigned)
