"""Probability paths x_tau = alpha(tau) * x0 + sigma(tau) * eps, each in its own time tau in [0, 1].

tau = 0 is data and tau = 1 is (almost) pure noise for every path. The canonical frame of the library
is the rectified-flow path (alpha = 1 - t, sigma = t). Any other path maps onto it exactly: a point
x_tau of path P equals (alpha + sigma) * x_rf at canonical time t = sigma / (alpha + sigma), because
dividing x_tau by (alpha + sigma) leaves weights (1 - t, t) on (x0, eps). `canonical_time` and
`own_time` are that map and its inverse.
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
    """Variance-preserving cosine path alpha = cos(pi tau / 2), sigma = sin(pi tau / 2) (Nichol & Dhariwal 2021)."""

    name = "cosine"

    def alpha(self, tau):
        return torch.cos(0.5 * math.pi * tau)

    def sigma(self, tau):
        return torch.sin(0.5 * math.pi * tau)

    def d_alpha(self, tau):
        return -0.5 * math.pi * torch.sin(0.5 * math.pi * tau)

    def d_sigma(self, tau):
        return 0.5 * math.pi * torch.cos(0.5 * math.pi * tau)

    def own_time(self, t):
        # tan(pi tau / 2) = t / (1 - t)
        return torch.atan2(t, 1 - t) * (2 / math.pi)


PATHS = {"rectified_flow": RectifiedFlow, "vp_linear": VPLinear, "cosine": Cosine}


def build_path(name: str) -> Path:
    return PATHS[name]()
