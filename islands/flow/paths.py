"""Probability paths x_tau = alpha(tau) * x0 + sigma(tau) * eps, each in its own time tau in [0, 1].

tau = 0 is data and tau = 1 is (almost) pure noise for every continuous path; the discrete DDPM schedule
puts its N steps at tau = n / N instead (`VPDiscrete`). The canonical frame of the library is the
rectified-flow path (alpha = 1 - t, sigma = t). Any other path maps onto it exactly: a point x_tau of
path P equals (alpha + sigma) * x_rf at canonical time t = sigma / (alpha + sigma), because dividing
x_tau by (alpha + sigma) leaves weights (1 - t, t) on (x0, eps). `canonical_time` and `own_time` are
that map and its inverse.
"""

import math
from abc import ABC, abstractmethod

import torch
from torch import Tensor


class Path(ABC):
    """Coefficients of one path. Subclasses give alpha, sigma, their derivatives and own_time."""

    name = "path"

    @abstractmethod
    def alpha(self, tau: Tensor) -> Tensor: ...

    @abstractmethod
    def sigma(self, tau: Tensor) -> Tensor: ...

    @abstractmethod
    def d_alpha(self, tau: Tensor) -> Tensor: ...

    @abstractmethod
    def d_sigma(self, tau: Tensor) -> Tensor: ...

    @abstractmethod
    def own_time(self, t: Tensor) -> Tensor:
        """The path time tau whose signal-to-noise ratio matches canonical time t."""

    def canonical_time(self, tau: Tensor) -> Tensor:
        a, s = self.alpha(tau), self.sigma(tau)
        return s / (a + s)

    def scale(self, tau: Tensor) -> Tensor:
        """alpha + sigma: x_tau = scale * x_rf."""
        return self.alpha(tau) + self.sigma(tau)


class RectifiedFlow(Path):
    """Straight line from data to noise (Liu et al. 2022; Lipman et al. 2022): the canonical frame."""

    name = "rectified_flow"

    def alpha(self, tau):
        return 1 - tau

    def sigma(self, tau):
        return tau

    def d_alpha(self, tau):
        return -torch.ones_like(tau)

    def d_sigma(self, tau):
        return torch.ones_like(tau)

    def own_time(self, t):
        return t


class VPLinear(Path):
    """Variance preserving with linear betas: the continuous limit of DDPM (Song et al. 2021, eq. 33).

    beta(tau) = beta_min + tau * (beta_max - beta_min) with beta_min = 0.1, beta_max = 20 matches
    DDPM's 1000 betas from 1e-4 to 0.02. alpha^2 = exp(-B(tau)), B = integral of beta, sigma^2 = 1 - alpha^2.
    """

    name = "vp_linear"

    def __init__(self, beta_min: float = 0.1, beta_max: float = 20.0):
        self.beta_min, self.beta_max = beta_min, beta_max

    def _integral(self, tau):
        return 0.5 * tau**2 * (self.beta_max - self.beta_min) + tau * self.beta_min

    def _beta(self, tau):
        return self.beta_min + tau * (self.beta_max - self.beta_min)

    def alpha(self, tau):
        return torch.exp(-0.5 * self._integral(tau))

    def sigma(self, tau):
        return torch.sqrt(-torch.expm1(-self._integral(tau)))

    def d_alpha(self, tau):
        return -0.5 * self._beta(tau) * self.alpha(tau)

    def d_sigma(self, tau):
        # d/dtau sqrt(1 - alpha^2) = -alpha * alpha' / sigma
        return 0.5 * self._beta(tau) * self.alpha(tau) ** 2 / self.sigma(tau)

    def own_time(self, t):
        # sigma^2 / alpha^2 = exp(B) - 1 = (t / (1 - t))^2  ->  solve the quadratic B(tau) = log(1 + r^2).
        r = t / (1 - t)
        b = torch.log1p(r**2)
        d = self.beta_max - self.beta_min
        return (-self.beta_min + torch.sqrt(self.beta_min**2 + 2 * d * b)) / d


class Cosine(Path):
    """The cosine schedule of Nichol & Dhariwal 2021, eq. 17, offset included.

    alpha^2 = alpha_bar(tau) = f(tau) / f(0) with f(tau) = cos^2(phi), phi = (pi / 2) (tau + s) / (1 + s), s = 0.008:
    the offset keeps the noise at the data end from being too small to learn (their section 3.2). It is the
    continuous schedule whose discretisation is diffusers' `squaredcos_cap_v2` (see `VPDiscrete`). sigma grows
    like sqrt(tau) at tau = 0, so d_sigma is infinite there.
    """

    name = "cosine"
    offset = 0.008

    def __init__(self):
        self.phi0 = 0.5 * math.pi * self.offset / (1 + self.offset)
        self.rate = 0.5 * math.pi / (1 + self.offset)  # d phi / d tau

    def alpha(self, tau):
        return torch.cos(self.phi0 + self.rate * tau) / math.cos(self.phi0)

    def sigma(self, tau):
        # 1 - alpha^2 = (sin^2 phi - sin^2 phi0) / cos^2 phi0 = sin(phi - phi0) sin(phi + phi0) / cos^2 phi0,
        # which keeps its precision where alpha is close to 1.
        phi = self.phi0 + self.rate * tau
        return torch.sqrt(torch.sin(self.rate * tau) * torch.sin(phi + self.phi0)) / math.cos(self.phi0)

    def d_alpha(self, tau):
        return -self.rate * torch.sin(self.phi0 + self.rate * tau) / math.cos(self.phi0)

    def d_sigma(self, tau):
        # d/dtau sqrt(1 - alpha^2) = -alpha * alpha' / sigma
        return -self.alpha(tau) * self.d_alpha(tau) / self.sigma(tau)

    def alpha_bar(self, tau):
        return self.alpha(tau) ** 2

    def own_time(self, t):
        # With alpha : sigma = (1 - t) : t, cos(phi) = alpha cos(phi0) and
        # sin(phi) = sqrt(sigma^2 + alpha^2 sin^2 phi0), both up to the same positive factor.
        phi = torch.atan2(torch.sqrt(t**2 + ((1 - t) * math.sin(self.phi0)) ** 2), (1 - t) * math.cos(self.phi0))
        return (phi - self.phi0) / self.rate


class VPDiscrete(Path):
    """The discrete schedule of DDPM (Ho et al. 2020), as DDPM's code and diffusers' `DDPMScheduler` define it.

    N steps n = 0 .. N - 1 with alpha_bar_n = prod_{i <= n} (1 - beta_i), and betas either linear from 1e-4 to 0.02
    (Ho et al., section 4) or `cosine`: beta_i = min(1 - alpha_bar((i + 1) / N) / alpha_bar(i / N), 0.999) of the
    `Cosine` path (Nichol & Dhariwal 2021, eq. 17 and the clipping below it; diffusers' `squaredcos_cap_v2`), so that
    alpha_bar_n = alpha_bar((n + 1) / N) up to step N - 2; the clipping bites at step N - 1 only, whose alpha_bar
    is alpha_bar_{N-2} * 0.001 instead of 0.

    Step n sits at own time tau = n / N, so an Islands network (which embeds 1000 tau) sees the integer n when
    N = 1000, as a DDPM network does. Between steps log alpha_bar is linear in tau: monotone, exact at the steps
    and inverted in closed form by `own_time`. Its derivative jumps at every step, so velocity prediction is not
    trained on this path. The path spans tau in [0, (N - 1) / N] and reaches neither end of the canonical frame:
    step 0 still holds noise sqrt(beta_0) and step N - 1 a trace of the data. `own_time` clamps canonical times
    outside the steps' range to the end steps, and tau outside [0, (N - 1) / N] is evaluated at the nearest end.
    """

    name = "vp_discrete"

    def __init__(self, beta_schedule: str = "linear", train_steps: int = 1000):
        if train_steps < 2:
            raise ValueError(f"train_steps must be at least 2, got {train_steps}")
        steps = torch.arange(train_steps + 1, dtype=torch.float64) / train_steps
        if beta_schedule == "linear":
            betas = torch.linspace(1e-4, 0.02, train_steps, dtype=torch.float64)
        elif beta_schedule == "cosine":
            alpha_bar = Cosine().alpha_bar(steps)
            betas = (1 - alpha_bar[1:] / alpha_bar[:-1]).clamp(max=0.999)
        else:
            raise ValueError(f"unknown beta_schedule {beta_schedule!r}; choose from {BETA_SCHEDULES}")
        self.beta_schedule, self.steps, self.betas = beta_schedule, train_steps, betas
        self.alphas_cumprod = torch.cumprod(1 - betas, 0)
        self._log_alpha_bar = torch.log(self.alphas_cumprod)
        self._tables = {}  # log alpha_bar per (device, dtype), copied once

    def _table(self, like: Tensor) -> Tensor:
        key = (like.device, like.dtype)
        if key not in self._tables:
            self._tables[key] = self._log_alpha_bar.to(device=like.device, dtype=like.dtype)
        return self._tables[key]

    def _interpolate(self, tau: Tensor) -> tuple[Tensor, Tensor]:
        """log alpha_bar and its derivative in tau, linear between steps (the last interval's at step N - 1)."""
        table = self._table(tau)
        position = (tau * self.steps).clamp(0, self.steps - 1)
        n = position.floor().clamp(max=self.steps - 2).long()
        lo, hi = table[n], table[n + 1]
        return lo + (position - n) * (hi - lo), (hi - lo) * self.steps

    def alpha(self, tau):
        return torch.exp(0.5 * self._interpolate(tau)[0])

    def sigma(self, tau):
        return torch.sqrt(-torch.expm1(self._interpolate(tau)[0]))

    def d_alpha(self, tau):
        log_alpha_bar, slope = self._interpolate(tau)
        return 0.5 * slope * torch.exp(0.5 * log_alpha_bar)

    def d_sigma(self, tau):
        log_alpha_bar, slope = self._interpolate(tau)
        return -0.5 * slope * torch.exp(log_alpha_bar) / torch.sqrt(-torch.expm1(log_alpha_bar))

    def own_time(self, t):
        # alpha_bar = (1 - t)^2 / ((1 - t)^2 + t^2), and (1 - t)^2 + t^2 = 1 - 2 t (1 - t).
        target = 2 * torch.log1p(-t) - torch.log1p(-2 * t * (1 - t))
        descending = self._table(t)
        n = (torch.searchsorted(-descending, -target.reshape(-1), right=True) - 1).reshape(target.shape)
        n = n.clamp(0, self.steps - 2)
        lo, hi = descending[n], descending[n + 1]
        return (n + ((target - lo) / (hi - lo)).clamp(0, 1)) / self.steps


BETA_SCHEDULES = ("linear", "cosine")
PATHS = {"rectified_flow": RectifiedFlow, "vp_linear": VPLinear, "cosine": Cosine, "vp_discrete": VPDiscrete}
PATH_OPTIONS = ("beta_schedule", "train_steps")  # what `build_path` takes beyond the name (vp_discrete's only)


def build_path(name: str, **options) -> Path:
    """The path `name`; `options` (from PATH_OPTIONS) configure vp_discrete and are refused by the other paths."""
    if name not in PATHS:
        raise ValueError(f"unknown path {name!r}; choose from {sorted(PATHS)}")
    if options and name != "vp_discrete":
        raise ValueError(f"{', '.join(sorted(options))}: not used by path {name!r}")
    return PATHS[name](**options)
