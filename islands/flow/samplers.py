"""ODE samplers on the canonical path, from t = 1 (noise) to t = 0 (data).

Every solver sees only a `Denoiser` (x, t, cond) -> velocity. It knows nothing of experts, routers or
parallelism. All solvers share one signature, as in k-diffusion.
"""

import math
from collections.abc import Callable

import torch
from torch import Tensor

from islands.flow.denoiser import Denoiser

SOLVERS = ("euler", "heun", "dpm2m")
GRIDS = ("uniform", "edm", "shifted")


def time_grid(steps: int, kind: str = "uniform", shift: float = 3.0, rho: float = 7.0) -> Tensor:
    """A decreasing float64 grid of steps + 1 times from exactly 1 to exactly 0.

    uniform: equal steps in t. edm: Karras et al. 2022 (eq. 5) spacing of sigma = t / (1 - t) between
    80 and 0.002 with rho = 7; the first point is moved to t = 1 so sampling starts from pure noise.
    shifted: Esser et al. 2024 (eq. 23) t' = shift t / (1 + (shift - 1) t), more steps at high noise.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    u = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    if kind == "uniform":
        return u
    if kind == "shifted":
        return shift * u / (1 + (shift - 1) * u)
    if kind == "edm":
        smax, smin = 80.0 ** (1 / rho), 0.002 ** (1 / rho)
        i = torch.arange(steps, dtype=torch.float64)
        frac = i / max(steps - 1, 1)
        sigma = (smax + frac * (smin - smax)) ** rho
        t = torch.cat([sigma / (1 + sigma), torch.zeros(1, dtype=torch.float64)])
        t[0] = 1.0
        return t
    raise ValueError(f"unknown time grid {kind!r}; choose from {GRIDS}")


def guided(denoiser: Denoiser, scale: float) -> Denoiser:
    """Classifier-free guidance (Ho & Salimans 2022): v = v_uncond + scale * (v_cond - v_uncond)."""
    if scale == 1.0:
        return denoiser

    def velocity(x: Tensor, t: Tensor, cond: Tensor | None = None) -> Tensor:
        if cond is None:
            return denoiser(x, t, None)
        v_cond, v_uncond = denoiser(x, t, cond), denoiser(x, t, None)
        return v_uncond + scale * (v_cond - v_uncond)

    return velocity


def _times(t: float, x: Tensor) -> Tensor:
    return torch.full((x.shape[0],), t, dtype=x.dtype, device=x.device)


def euler(v: Callable, x: Tensor, grid: Tensor) -> Tensor:
    for t, t_next in zip(grid[:-1].tolist(), grid[1:].tolist()):
        x = x + (t_next - t) * v(x, _times(t, x))
    return x


def heun(v: Callable, x: Tensor, grid: Tensor) -> Tensor:
    """Second-order Heun (Karras et al. 2022, Algorithm 1); the last step to t = 0 is an Euler step."""
    for t, t_next in zip(grid[:-1].tolist(), grid[1:].tolist()):
        d = v(x, _times(t, x))
        x_euler = x + (t_next - t) * d
        if t_next == 0.0:
            x = x_euler
        else:
            d_next = v(x_euler, _times(t_next, x))
            x = x + (t_next - t) * 0.5 * (d + d_next)
    return x


def dpm2m(v: Callable, x: Tensor, grid: Tensor) -> Tensor:
    """DPM-Solver++(2M) (Lu et al. 2022, Algorithm 2) with alpha = 1 - t, sigma = t.

    The data prediction is x0 = x - t v. The first step (from t = 1, where lambda = -inf) and the last
    (to t = 0) are first order, which there reduces to the exact DDIM update.
    """
    x0_prev, h_prev = None, None
    ts = grid.tolist()
    for t, t_next in zip(ts[:-1], ts[1:]):
        x0 = x - t * v(x, _times(t, x))
        first_or_last = x0_prev is None or t_next == 0.0 or t == 1.0
        h = None if first_or_last else math.log((1 - t_next) / t_next) - math.log((1 - t) / t)
        if first_or_last or h_prev is None:
            d = x0
        else:
            r = h_prev / h
            d = (1 + 1 / (2 * r)) * x0 - (1 / (2 * r)) * x0_prev
        # x_next = (sigma' / sigma) x + (alpha' - alpha sigma' / sigma) D, i.e. sigma'/sigma x - alpha'(e^-h - 1) D.
        ratio = t_next / t
        x = ratio * x + ((1 - t_next) - (1 - t) * ratio) * d
        x0_prev, h_prev = x0, h
    return x


_SOLVERS = {"euler": euler, "heun": heun, "dpm2m": dpm2m}


@torch.no_grad()
def sample(
    denoiser: Denoiser,
    noise: Tensor,
    *,
    steps: int = 32,
    solver: str = "heun",
    grid: str = "uniform",
    guidance: float = 1.0,
    cond: Tensor | None = None,
) -> Tensor:
    """Integrate dx/dt = v(x, t) from noise at t = 1 to t = 0 and return the samples."""
    if solver not in _SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose from {SOLVERS}")
    field = guided(denoiser, guidance)
    ts = time_grid(steps, grid)

    def v(x: Tensor, t: Tensor) -> Tensor:
        return field(x, t, cond).to(x.dtype)

    return _SOLVERS[solver](v, noise, ts)


def evaluations_per_sample(solver: str, steps: int, guidance: float = 1.0) -> int:
    """Network evaluations one sample costs (Heun skips its corrector on the step to t = 0)."""
    per_eval = 1 if guidance == 1.0 else 2
    n = 2 * steps - 1 if solver == "heun" else steps
    return n * per_eval
