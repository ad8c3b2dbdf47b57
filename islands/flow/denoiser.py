"""The one interface everything samples from: a canonical rectified-flow velocity field.

A `Denoiser` maps (x, t, cond) to dx/dt on the canonical path x_t = (1 - t) x0 + t eps, whose velocity
is eps - x0. `NetworkDenoiser` wraps a network trained on any path with any prediction target and
converts exactly: canonical (x, t) -> its own (x_tau, tau) -> its output -> (x0, eps) -> eps - x0.
"""

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from islands.flow.paths import Path, RectifiedFlow, build_path

PREDICTIONS = ("velocity", "epsilon", "x0")

# Epsilon and x0 predictions divide by alpha or sigma, which vanish at the ends of the path: the adapter keeps t
# 1e-5 away from both ends. An epsilon network's x0 = (x - sigma eps) / alpha multiplies any error of its eps by
# sigma / alpha, which is 1e5 at t = 1 - 1e-5; so, like EDM's samplers of VP networks (sigma_max = 80, Karras et
# al. 2022), an epsilon network is evaluated no nearer pure noise than sigma / alpha = 80, canonical t = 80 / 81,
# where x_t is noise to within 1.2% of its scale.
_EDGE = 1e-5
EPSILON_T_MAX = 80 / 81


class Denoiser(Protocol):
    """(x, t, cond) -> the canonical velocity. Any such callable samples; a denoiser may also say more of itself
    to the samplers, by the optional parts below (`GuidesItself`, `SplitInTime`)."""

    def __call__(self, x: Tensor, t: Tensor, cond: Tensor | None = None) -> Tensor: ...


@runtime_checkable
class GuidesItself(Denoiser, Protocol):
    """A denoiser that does its own classifier-free guidance (a mixture guides inside each expert, so that a
    sample's guidance direction is always one expert's)."""

    def guided(self, scale: float) -> Denoiser:
        """The guided velocity field at `scale`."""
        ...


@runtime_checkable
class SplitInTime(Denoiser, Protocol):
    """A denoiser made of timestep-range experts: the samplers put its boundaries into their time grids and
    integrate range i (counted from t = 0) with `for_range(i)` alone, so that no solver step mixes two experts."""

    time_boundaries: list[float]  # the canonical times where one range expert hands over to the next

    def for_range(self, i: int) -> Denoiser:
        """The denoiser that answers inside range i."""
        ...


def broadcast(coef: Tensor, x: Tensor) -> Tensor:
    """Shape a per-sample coefficient (B,) so that it multiplies x of shape (B, ...)."""
    return coef.reshape(-1, *([1] * (x.dim() - 1))).to(x.dtype)


def prediction_target(path: Path, prediction: str, x0: Tensor, noise: Tensor, tau: Tensor) -> Tensor:
    """What a network with this prediction target should output at x_tau."""
    if prediction == "velocity":
        return broadcast(path.d_alpha(tau), x0) * x0 + broadcast(path.d_sigma(tau), x0) * noise
    if prediction == "epsilon":
        return noise
    if prediction == "x0":
        return x0
    raise ValueError(f"unknown prediction {prediction!r}; choose from {PREDICTIONS}")


def x0_and_noise(path: Path, prediction: str, x: Tensor, out: Tensor, tau: Tensor) -> tuple[Tensor, Tensor]:
    """Invert x = alpha x0 + sigma eps given the network output, in the path's own frame."""
    a, s = broadcast(path.alpha(tau), x), broadcast(path.sigma(tau), x)
    if prediction == "velocity":
        # Solve [alpha sigma; alpha' sigma'] [x0; eps] = [x; v].
        da, ds = broadcast(path.d_alpha(tau), x), broadcast(path.d_sigma(tau), x)
        det = a * ds - s * da
        return (ds * x - s * out) / det, (a * out - da * x) / det
    if prediction == "epsilon":
        return (x - s * out) / a, out
    if prediction == "x0":
        return out, (x - a * out) / s
    raise ValueError(f"unknown prediction {prediction!r}; choose from {PREDICTIONS}")


class NetworkDenoiser(nn.Module):
    """A network trained on (path, prediction), seen as a canonical velocity field."""

    def __init__(self, net: nn.Module, path: str | Path = "rectified_flow", prediction: str = "velocity"):
        super().__init__()
        if prediction not in PREDICTIONS:
            raise ValueError(f"unknown prediction {prediction!r}; choose from {PREDICTIONS}")
        self.net = net
        self.path = build_path(path) if isinstance(path, str) else path
        self.prediction = prediction
        self.identity = isinstance(self.path, RectifiedFlow) and prediction == "velocity"

    def forward(self, x: Tensor, t: Tensor, cond: Tensor | None = None) -> Tensor:
        t = torch.as_tensor(t, dtype=x.dtype, device=x.device).expand(x.shape[0])
        if self.identity:  # the canonical frame itself: nothing to convert
            return self._net(x, t, cond)
        t_max = EPSILON_T_MAX if self.prediction == "epsilon" else 1 - _EDGE
        tau = self.path.own_time(t.clamp(_EDGE, t_max)).clamp(0, 1)
        x_own = broadcast(self.path.scale(tau), x) * x
        out = self._net(x_own, tau, cond)
        x0, eps = x0_and_noise(self.path, self.prediction, x_own, out, tau)
        return eps - x0

    def _net(self, x: Tensor, t: Tensor, cond: Tensor | None) -> Tensor:
        """The network in its own precision; the frame conversion stays in the caller's (float64 for metrics)."""
        dtype = next(self.net.parameters(), x).dtype
        return self.net(x.to(dtype), t.to(dtype), cond).to(x.dtype)
