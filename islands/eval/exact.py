"""Exact metrics for Gaussian-mixture data (islands.data.gmm.GaussianMixture), where the truth is known.

The mixture's density, posterior over components and velocity field are available in closed form, so a
model's samples can be scored by exact likelihood and mode masses, and a denoiser by its velocity error.
"""

import torch
from torch import Tensor

from islands.data.gmm import GaussianMixture
from islands.flow.denoiser import Denoiser

VELOCITY_BATCH = 1024


def _as_float64(x) -> Tensor:
    return torch.as_tensor(x).detach().cpu().double()


def mean_nll(gmm: GaussianMixture, x) -> float:
    """The mean of -log p(x) under the mixture, in nats per sample (a cross-entropy estimate)."""
    return float(-gmm.log_prob(_as_float64(x), 0.0).mean())


def _quantiles_at(sorted_rows: Tensor, count: int) -> Tensor:
    """Linear interpolation of sorted rows [P, N] at the levels (i + 0.5) / count, i < count."""
    n = sorted_rows.shape[1]
    levels = (torch.arange(count, dtype=torch.float64) + 0.5) / count
    position = (levels * n - 0.5).clamp(0, n - 1)
    below = position.floor().long()
    above = (below + 1).clamp(max=n - 1)
    frac = position - below
    return (1 - frac) * sorted_rows[:, below] + frac * sorted_rows[:, above]


def sliced_wasserstein(x, y, projections: int = 256, seed: int = 0) -> float:
    """Sliced Wasserstein-2 distance (Rabin et al. 2011; Bonneel et al. 2015): sqrt of E_u W2^2(u.x, u.y).

    Directions u are uniform on the sphere. In 1-D, W2^2 is the mean squared difference of sorted values; sets
    of different sizes are compared at the smaller set's quantile levels (i + 0.5) / n.
    """
    x, y = _as_float64(x), _as_float64(y)
    if x.dim() != 2 or y.dim() != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y must be [N, D] with the same D, got {tuple(x.shape)} and {tuple(y.shape)}")
    generator = torch.Generator().manual_seed(seed)
    directions = torch.randn(projections, x.shape[1], dtype=torch.float64, generator=generator)
    directions = directions / directions.norm(dim=1, keepdim=True)
    sorted_x, sorted_y = (directions @ x.T).sort(1).values, (directions @ y.T).sort(1).values
    count = min(x.shape[0], y.shape[0])
    sorted_x, sorted_y = _quantiles_at(sorted_x, count), _quantiles_at(sorted_y, count)
    return float((sorted_x - sorted_y).square().mean().sqrt())


def mode_mass(gmm: GaussianMixture, x) -> dict:
    """The share of samples assigned to each component (highest posterior at t = 0) against the true weights."""
    x = _as_float64(x)
    component = gmm.posterior(x, torch.zeros(x.shape[0], dtype=torch.float64)).argmax(1)
    mass = torch.bincount(component, minlength=gmm.num_components).double() / x.shape[0]
    error = (mass - gmm.weights).abs()
    return {
        "mass": mass.tolist(),
        "weights": gmm.weights.tolist(),
        "max_abs_error": float(error.max()),
        "total_variation": float(0.5 * error.sum()),
    }


@torch.no_grad()
def velocity_error(denoiser: Denoiser, gmm: GaussianMixture, num: int = 4096, times: int = 16, seed: int = 0,
                   cond=None, *, dtype: torch.dtype = torch.float64, device="cpu") -> float:
    """E_t E |denoiser(x_t, t, cond) - u(x_t, t)|^2 against the mixture's exact velocity u on the canonical path.

    The flow-matching objective L_FM (Lipman et al. 2023, eq. 5), which the trained conditional loss (eq. 9)
    equals up to a constant. x0 and eps are drawn once from a Generator seeded by `seed`, whatever the denoiser;
    t runs over the midpoints (k + 0.5) / times. cond is None, one value for every sample, or one per sample.
    x_t and t reach the denoiser in `dtype` on `device`; the error is computed in float64.
    """
    generator = torch.Generator().manual_seed(seed)
    x0, _ = gmm.sample(num, generator)
    eps = torch.randn(num, gmm.dim, dtype=torch.float64, generator=generator)
    if cond is not None:
        cond = torch.as_tensor(cond, device=device)
        cond = cond.expand(num) if cond.dim() == 0 else cond
        if cond.shape[0] != num:
            raise ValueError(f"cond must be one value or {num} values, got shape {tuple(cond.shape)}")
    total = 0.0
    for k in range(times):
        t = (k + 0.5) / times
        for start in range(0, num, VELOCITY_BATCH):
            stop = min(start + VELOCITY_BATCH, num)
            x_t = (1 - t) * x0[start:stop] + t * eps[start:stop]
            t_batch = torch.full((stop - start,), t, dtype=torch.float64)
            batch_cond = None if cond is None else cond[start:stop]
            predicted = denoiser(x_t.to(device, dtype), t_batch.to(device, dtype), batch_cond)
            exact = gmm.velocity(x_t, t_batch)
            total += float((predicted.detach().cpu().double() - exact).square().sum())
    return total / (num * times)
