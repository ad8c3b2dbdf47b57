"""The exact cluster posterior p(k | x_t, t) of a finite training set: the truth a router is measured against.

The training set {x_i} with clusters {k_i} is a finite mixture; on the canonical path x_t = (1 - t) x_0 + t eps
each point becomes N((1 - t) x_i, t^2 I), so

    p(k | x_t, t) = sum_{i: k_i = k} N(x_t; (1 - t) x_i, t^2 I) / sum_i N(x_t; (1 - t) x_i, t^2 I),

which is what a router trained by cross-entropy on noised training points converges to (McAllister et al. 2025,
section 3.2). With a class c the sums run over the points of class c. Dropping the terms common to every i,
the log-weight of point i is ((1 - t) <x_t, x_i> - (1 - t)^2 |x_i|^2 / 2) / t^2.
"""

import torch
from torch import Tensor

from islands.data.sources import CLUSTER, LABEL, X

CHUNK = 4096  # training points per matmul: bounds the (batch, chunk) block of log-weights
EXACT_POSTERIOR_LIMIT = 60_000 * 784  # numbers in the training set; above it the exact posterior is too costly


class ExactPosterior:
    """p(k | x_t, t [, class]) of the training points `x` (N, ...) in clusters `clusters` (N,), a router.

    `classes` (N,) enables conditioning: `cond` equal to `num_classes` (the null label) or None means no class.
    """

    def __init__(self, x: Tensor, clusters: Tensor, k: int, classes: Tensor | None = None, num_classes: int = 0):
        self.points = torch.as_tensor(x).detach().flatten(1).double()
        self.clusters = torch.as_tensor(clusters, dtype=torch.long)
        if self.clusters.shape != (self.points.shape[0],) or (self.clusters < 0).any() or (self.clusters >= k).any():
            raise ValueError(f"clusters must give each of the {self.points.shape[0]} points a cluster in [0, {k})")
        self.k, self.num_classes = k, num_classes
        self.classes = None if classes is None else torch.as_tensor(classes, dtype=torch.long)
        self.half_sq_norms = 0.5 * self.points.square().sum(1)
        self.one_hot = torch.nn.functional.one_hot(self.clusters, k).double()

    def log_posterior(self, x: Tensor, t: Tensor, cond: Tensor | None = None) -> Tensor:
        """log p(k | x_t, t), float64 (B, K); -inf for clusters with no point of the sample's class."""
        x = torch.as_tensor(x).detach().flatten(1).double().cpu()
        t = torch.as_tensor(t, dtype=torch.float64).expand(x.shape[0]).reshape(-1, 1).cpu()
        if (t <= 0).any() or (t > 1).any():
            raise ValueError("the exact posterior needs 0 < t <= 1 (at t = 0 it is the nearest point's cluster)")
        if cond is not None and self.classes is not None:
            cond = torch.as_tensor(cond, dtype=torch.long).cpu()
        else:
            cond = None
        # log sum_{i in k} exp(a_i) per cluster, chunk by chunk, each chunk shifted by its own maximum
        out = torch.full((x.shape[0], self.k), -torch.inf, dtype=torch.float64)
        for lo in range(0, self.points.shape[0], CHUNK):
            points = self.points[lo:lo + CHUNK]
            a = ((1 - t) * (x @ points.T) - (1 - t) ** 2 * self.half_sq_norms[lo:lo + CHUNK]) / t**2
            if cond is not None:  # only the points of the sample's class, or all of them for the null label
                allowed = (cond[:, None] == self.classes[None, lo:lo + CHUNK]) | (cond[:, None] == self.num_classes)
                a = a.masked_fill(~allowed, -torch.inf)
            top = a.amax(1, keepdim=True).clamp_min(-1e300)  # a row may be all -inf: no point of its class here
            sums = (a - top).exp() @ self.one_hot[lo:lo + CHUNK]  # (B, K) sums of exp(a_i - top) per cluster
            out = torch.logaddexp(out, sums.log() + top)
        return out - torch.logsumexp(out, dim=1, keepdim=True)

    def __call__(self, x: Tensor, t: Tensor, cond: Tensor | None = None) -> Tensor:
        return self.log_posterior(x, t, cond).exp().to(torch.as_tensor(x).dtype)


def exact_cluster_posterior(source, k: int, num_classes: int = 0) -> ExactPosterior:
    """The exact posterior of a source seen through its partition (islands.data.clusters.ClusterLabelled)."""
    got = source.read(range(len(source)), (X, LABEL, CLUSTER))
    return ExactPosterior(got[X], got[CLUSTER], k, got.get(LABEL) if num_classes else None, num_classes)
