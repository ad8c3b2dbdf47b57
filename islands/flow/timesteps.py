"""Training-time samplers of the path's own time, driven by one uniform number per example.

Taking uniforms from the caller keeps all randomness in the per-example streams (DESIGN.md section 3).
Both distributions are restricted to [t_lo, t_hi) by inverse-CDF sampling, so a timestep-range expert
sees exactly the restricted distribution, with no rejection loop. With `steps = N` (a discrete DDPM schedule)
the sampler draws integer steps n and returns tau = n / N: the steps with n / N in [t_lo, t_hi), each equally
likely for `uniform` (Ho et al. 2020, Algorithm 1), or each with the logit-normal mass of [n / N, (n + 1) / N).

A `shift` moves the drawn times towards noise as SD3 does for larger images (`shift_time`); 1 leaves them as they are.
"""

import math

import torch
from torch import Tensor

TIME_SAMPLERS = ("uniform", "logit_normal")


def shift_time(t, shift: float):
    """SD3's resolution-dependent shift (Esser et al. 2024, eq. 23): t_m = a t_n / (1 + (a - 1) t_n) with
    a = sqrt(m / n) for m pixels against the n the schedule was made for. It multiplies the noise-to-signal ratio
    t / (1 - t) of the rectified-flow path by a, so that a picture with a times the side is as destroyed at t_m as
    the smaller one at t_n; 0 and 1 stay where they are, and shifting by 1 / a undoes it."""
    return shift * t / (1 + (shift - 1) * t)


def step_range(t_lo: float, t_hi: float, steps: int) -> tuple[int, int]:
    """The steps n with n / steps in [t_lo, t_hi), as the half-open range [first, end)."""
    # A small tolerance so that a bound written as a decimal (0.3 * 1000 = 300.00000000000006) lands on its step.
    return math.ceil(t_lo * steps - 1e-9), math.ceil(t_hi * steps - 1e-9)


class TimeSampler:
    def __init__(self, kind: str = "uniform", t_lo: float = 0.0, t_hi: float = 1.0, mean: float = 0.0,
                 std: float = 1.0, steps: int | None = None, shift: float = 1.0):
        if kind not in TIME_SAMPLERS:
            raise ValueError(f"unknown time sampler {kind!r}; choose from {TIME_SAMPLERS}")
        if not 0.0 <= t_lo < t_hi <= 1.0:
            raise ValueError(f"time range [{t_lo}, {t_hi}) must satisfy 0 <= t_lo < t_hi <= 1")
        if steps is not None:
            first, end = step_range(t_lo, t_hi, steps)
            if first >= end:
                raise ValueError(f"time range [{t_lo}, {t_hi}) holds none of the {steps} steps n / {steps}")
        if shift <= 0 or (shift != 1 and steps is not None):
            raise ValueError(f"time shift {shift} must be positive, and 1 on a schedule of steps")
        self.kind, self.t_lo, self.t_hi, self.mean, self.std, self.steps = kind, t_lo, t_hi, mean, std, steps
        self.shift = shift

    def _normal_cdf_of_logit(self, t: float) -> float:
        if t <= 0.0:
            return 0.0
        if t >= 1.0:
            return 1.0
        z = (math.log(t / (1 - t)) - self.mean) / self.std
        return 0.5 * math.erfc(-z / math.sqrt(2))

    def _logit_normal(self, u: Tensor, t_lo: float, t_hi: float) -> Tensor:
        # Logit-normal (Esser et al. 2024, eq. 19): logit(t) ~ N(mean, std^2), restricted to the range.
        lo, hi = self._normal_cdf_of_logit(t_lo), self._normal_cdf_of_logit(t_hi)
        p = (lo + u.double() * (hi - lo)).clamp(1e-12, 1 - 1e-12)
        t = torch.sigmoid(self.mean + self.std * torch.special.ndtri(p))
        return t.clamp(t_lo, t_hi)

    def __call__(self, u: Tensor) -> Tensor:
        """Map uniforms u in [0, 1) to times in [t_lo, t_hi)."""
        if self.steps is not None:
            return self._step(u)
        if self.shift != 1:  # the unshifted draw restricted to the range that the shift maps onto [t_lo, t_hi)
            lo, hi = shift_time(self.t_lo, 1 / self.shift), shift_time(self.t_hi, 1 / self.shift)
            return shift_time(self._draw(u.double(), lo, hi), self.shift).clamp(self.t_lo, self.t_hi).to(u.dtype)
        return self._draw(u, self.t_lo, self.t_hi)

    def _draw(self, u: Tensor, t_lo: float, t_hi: float) -> Tensor:
        if self.kind == "uniform":
            return t_lo + u * (t_hi - t_lo)
        return self._logit_normal(u, t_lo, t_hi).to(u.dtype)

    def _step(self, u: Tensor) -> Tensor:
        first, end = step_range(self.t_lo, self.t_hi, self.steps)
        if self.kind == "uniform":
            n = first + torch.floor(u.double() * (end - first))
        else:  # the continuous draw on the steps' span, rounded down to its step
            n = torch.floor(self._logit_normal(u, first / self.steps, end / self.steps) * self.steps)
        return (n.clamp(first, end - 1) / self.steps).to(u.dtype)

    def strata(self, count: int) -> list[float]:
        """`count` fixed times spread evenly over the range (midpoints of equal shares; on a step grid, the step
        each midpoint falls in): the validation probe's times."""
        if self.steps is None:
            return [self.t_lo + (self.t_hi - self.t_lo) * (k + 0.5) / count for k in range(count)]
        first, end = step_range(self.t_lo, self.t_hi, self.steps)
        return [(first + math.floor((end - first) * (k + 0.5) / count)) / self.steps for k in range(count)]
