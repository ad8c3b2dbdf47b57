"""Training-time samplers of the path's own time, driven by one uniform number per example.

Taking uniforms from the caller keeps all randomness in the per-example streams (DESIGN.md section 3).
Both distributions are restricted to [t_lo, t_hi) by inverse-CDF sampling, so a timestep-range expert
sees exactly the restricted distribution, with no rejection loop. With `steps = N` (a discrete DDPM schedule)
the sampler draws integer steps n and returns tau = n / N: the steps with n / N in [t_lo, t_hi), each equally
likely for `uniform` (Ho et al. 2020, Algorithm 1), or each with the logit-normal mass of [n / N, (n + 1) / N).
"""

import math

import torch
from torch import Tensor

TIME_SAMPLERS = ("uniform", "logit_normal")


def step_range(t_lo: float, t_hi: float, steps: int) -> tuple[int, int]:
    """The steps n with n / steps in [t_lo, t_hi), as the half-open range [first, end)."""
    # A small tolerance so that a bound written as a decimal (0.3 * 1000 = 300.00000000000006) lands on its step.
    return math.ceil(t_lo * steps - 1e-9), math.ceil(t_hi * steps - 1e-9)


class TimeSampler:
    def __init__(self, kind: str = "uniform", t_lo: float = 0.0, t_hi: float = 1.0, mean: float = 0.0,
                 std: float = 1.0, steps: int | None = None):
        if kind not in TIME_SAMPLERS:
            raise ValueError(f"unknown time sampler {kind!r}; choose from {TIME_SAMPLERS}")
        if not 0.0 <= t_lo < t_hi <= 1.0:
            raise ValueError(f"time range [{t_lo}, {t_hi}) must satisfy 0 <= t_lo < t_hi <= 1")
        if steps is not None:
            first, end = step_range(t_lo, t_hi, steps)
            if first >= end:
                raise ValueError(f"time range [{t_lo}, {t_hi}) holds none of the {steps} steps n / {steps}")
        self.kind, self.t_lo, self.t_hi, self.mean, self.std, self.steps = kind, t_lo, t_hi, mean, std, steps

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
        if self.kind == "uniform":
            return self.t_lo + u * (self.t_hi - self.t_lo)
        return self._logit_normal(u, self.t_lo, self.t_hi).to(u.dtype)

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
