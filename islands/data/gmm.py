"""Isotropic Gaussian mixtures: data whose probability path is known in closed form.

On the canonical path x_t = (1 - t) x0 + t eps, component k stays Gaussian:
x_t | k ~ N((1 - t) mu_k, v(t) I) with v(t) = (1 - t)^2 s^2 + t^2. Hence the exact posterior
p(k | x_t), the exact per-component velocities u_k = E[eps - x0 | x_t, k], and the exact marginal
velocity u = sum_k p(k | x_t) u_k (the factorisation Decentralized Diffusion Models rest on).
"""

import math

import numpy as np
import torch
from torch import Tensor

from islands.data.sources import LABEL, Source, X


class GaussianMixture:
    def __init__(self, means, std: float, weights=None):
        self.means = torch.as_tensor(np.asarray(means, dtype=np.float64))
        if self.means.dim() != 2:
            raise ValueError(f"means must be a list of vectors, got shape {tuple(self.means.shape)}")
        k = self.means.shape[0]
        w = torch.ones(k, dtype=torch.float64) / k if weights is None else torch.as_tensor(weights, dtype=torch.float64)
        if w.shape != (k,) or (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"weights must be {k} non-negative numbers, got {weights}")
        if std <= 0:
            raise ValueError(f"std must be > 0, got {std}")
        self.weights = w / w.sum()
        self.std = float(std)

    @property
    def dim(self) -> int:
        return self.means.shape[1]

    @property
    def num_components(self) -> int:
        return self.means.shape[0]

    def sample(self, n: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """n draws (float64) and their component labels."""
        k = torch.multinomial(self.weights, n, replacement=True, generator=generator)
        eps = torch.randn(n, self.dim, dtype=torch.float64, generator=generator)
        return self.means[k] + self.std * eps, k

    def mean(self) -> Tensor:
        return self.weights @ self.means

    def covariance(self) -> Tensor:
        mu = self.mean()
        centred = self.means - mu
        between = (self.weights[:, None] * centred).T @ centred
        return between + self.std**2 * torch.eye(self.dim, dtype=torch.float64)

    # --- the path, in closed form -------------------------------------------------------------
    def _component_log_density(self, x: Tensor, t: Tensor) -> Tensor:
        """log w_k + log N(x; (1 - t) mu_k, v(t) I), shape (B, K)."""
        x, t = x.double(), t.double().reshape(-1, 1)
        var = (1 - t) ** 2 * self.std**2 + t**2  # (B, 1)
        sq = ((x[:, None, :] - (1 - t)[:, :, None] * self.means[None]) ** 2).sum(-1)
        return self.weights.log()[None] - 0.5 * sq / var - 0.5 * self.dim * torch.log(2 * math.pi * var)

    def log_prob(self, x: Tensor, t: Tensor | float = 0.0) -> Tensor:
        """Exact log density of x_t (t = 0: the data), shape (B,)."""
        t = torch.as_tensor(t, dtype=torch.float64).expand(x.shape[0])
        return torch.logsumexp(self._component_log_density(x, t), dim=1)

    def posterior(self, x: Tensor, t: Tensor) -> Tensor:
        """p(k | x_t), shape (B, K)."""
        return torch.softmax(self._component_log_density(x, t), dim=1)

    def component_velocity(self, x: Tensor, t: Tensor) -> Tensor:
        """u_k(x, t) = E[eps - x0 | x_t = x, k], shape (B, K, d)."""
        x, t = x.double(), t.double().reshape(-1, 1, 1)
        var = (1 - t) ** 2 * self.std**2 + t**2
        resid = x[:, None, :] - (1 - t) * self.means[None]  # x_t minus its component mean
        e_x0 = self.means[None] + (1 - t) * self.std**2 / var * resid
        e_eps = t / var * resid
        return e_eps - e_x0

    def velocity(self, x: Tensor, t: Tensor) -> Tensor:
        """The exact marginal velocity sum_k p(k | x_t) u_k, shape (B, d)."""
        t = torch.as_tensor(t, dtype=torch.float64).expand(x.shape[0])
        p = self.posterior(x, t)
        return (p[:, :, None] * self.component_velocity(x, t)).sum(1)

    def score(self, x: Tensor, t: Tensor) -> Tensor:
        """grad_x log p_t(x) = sum_k p(k | x_t) (-(x - (1 - t) mu_k) / v(t)), shape (B, d)."""
        t = torch.as_tensor(t, dtype=torch.float64).expand(x.shape[0])
        p = self.posterior(x, t)
        tt = t.reshape(-1, 1, 1)
        var = (1 - tt) ** 2 * self.std**2 + tt**2
        resid = x.double()[:, None, :] - (1 - tt) * self.means[None]
        return (p[:, :, None] * (-resid / var)).sum(1)

    def denoiser(self):
        """The exact velocity field as a `Denoiser` (cond is ignored), returning x's dtype."""

        def velocity(x: Tensor, t: Tensor, cond: Tensor | None = None) -> Tensor:
            return self.velocity(x, t).to(x.dtype)

        return velocity


class GMMSource(Source):
    """A fixed training set drawn from a mixture; labels are the component ids."""

    flip = False

    def __init__(self, means, std: float, weights=None, size: int = 50_000, seed: int = 0):
        self.mixture = GaussianMixture(means, std, weights)
        x, k = self.mixture.sample(size, torch.Generator().manual_seed(seed))
        self.x, self.y = x.float(), k
        self.shape = (self.mixture.dim,)
        self.num_classes = self.mixture.num_components

    def __len__(self) -> int:
        return self.x.shape[0]

    holds = frozenset({X, LABEL})

    def read(self, indices, fields) -> dict:
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        return {name: values[idx] for name, values in ((X, self.x), (LABEL, self.y)) if name in fields}
