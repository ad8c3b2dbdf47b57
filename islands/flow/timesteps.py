"""Training-time samplers of the path's own time, driven by one uniform number per example.

Taking uniforms from the caller keeps all randomness in the per-example streams (DESIGN.md section 3).
Both distributions are restricted to [t_lo, t_hi) by inverse-CDF sampling, so a timestep-range expert
sees exactly the restricted distribution, with no rejection loop.
"""

import math

import torch
from torch import Tensor

TIME_SAMPLERS = ("uniform", "logit_normal")


class TimeSampler:
    def __init__(self, kind: str = "uniform", t_lo: float = 0.0, t_hi: float = 1.0, mean: float = 0.0, std: float = 1.0):
        if kind not in TIME_SAMPLERS:
            raise ValueError(f"unknown time sampler {kind!r}; choose from {TIME_SAMPLERS}")
        if not 0.0 <= t_lo < t_hi <= 1.0:
            raise ValueError(f"time range [{t_lo}, {t_hi}) must satisfy 0 <= t_lo < t_hi <= 1")
        self.kind, self.t_lo, self.t_hi, self.mean, self.std = kind, t_lo, t_hi, mean, std

    def _normal_cdf_of_logit(self, t: float) -> float:
        if t <= 0.0:
            return 0.0
        if t >= 1.0:
            return 1.0
        z = (math.log(t / (1 - t)) - self.mean) / self.std
        return 0.5 * math.erfc(-z / math.sqrt(2))

    def __call__(self, u: Tensor) -> Tensor:
        """Map uniforms u in [0, 1) to times in [t_lo, t_hi)."""
        if self.kind == "uniform":
            return self.t_lo + u * (self.t_hi - self.t_lo)
        # Logit-normal (Esser et al. 2024, eq. 19): logit(t) ~ N(mean, std^2), restricted to the range.
        lo, hi = self._normal_cdf_of_logit(self.t_lo), self._normal_cdf_of_logit(self.t_hi)
        p = (lo + u.double() * (hi - lo)).clamp(1e-12, 1 - 1e-12)
        t = torch.sigmoid(self.mean + self.std * torch.special.ndtri(p))
        return t.clamp(self.t_lo, self.t_hi).to(u.dtype)
