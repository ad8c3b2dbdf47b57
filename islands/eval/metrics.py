"""Sample-based metrics on feature vectors: Frechet distance, KID, precision/recall, density/coverage, class balance.

Features are [N, D] torch tensors or numpy arrays (Inception activations, a classifier's embedding, or raw
vectors for toy data); everything is computed in float64 on the CPU. Matrix square roots use symmetric
eigendecompositions, so nothing beyond numpy and torch is needed.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from islands.rundir import atomic_write, read_npz

# Rows of the query set per torch.cdist call: 1024 x 10k distances are 80 MB in float64.
DISTANCE_CHUNK = 1024


def as_features(features) -> np.ndarray:
    """A float64 numpy array [N, D] from a tensor or array."""
    if isinstance(features, torch.Tensor):
        features = features.detach().cpu().numpy()
    array = np.asarray(features, dtype=np.float64)
    if array.ndim != 2:
        raise ValueError(f"features must have shape [N, D], got {array.shape}")
    return array


@dataclass
class GaussianStats:
    """Mean, unbiased covariance and sample count of a feature set (what FID compares)."""

    mean: np.ndarray
    cov: np.ndarray
    count: int

    def save(self, path) -> None:
        """Write an .npz at exactly `path` (np.savez would append .npz to a bare name), whole or not at all."""
        atomic_write(path, lambda file: np.savez(file, mean=self.mean, cov=self.cov, count=np.int64(self.count)))

    @classmethod
    def load(cls, path) -> "GaussianStats":
        """Read what `save` wrote; never unpickles. Anything else raises ValueError naming the file."""
        try:
            arrays = read_npz(path, ("mean", "cov", "count"), required=("mean", "cov", "count"))
            mean, cov, count = arrays["mean"], arrays["cov"], arrays["count"]
            dim = mean.shape[0] if mean.ndim == 1 else -1
            if cov.shape != (dim, dim) or count.shape != () or not np.issubdtype(count.dtype, np.integer):
                raise ValueError(f"inconsistent shapes mean {mean.shape}, cov {cov.shape}, count {count.shape}")
        except ValueError as err:
            reason = " ".join(f"{type(err).__name__}: {err}".split())
            raise ValueError(f"cannot read Gaussian stats from {Path(path)}: {reason}") from None
        return cls(mean.astype(np.float64), cov.astype(np.float64), int(count))


def feature_stats(features) -> GaussianStats:
    """Mean and unbiased (N - 1) covariance of [N, D] features."""
    x = as_features(features)
    if x.shape[0] < 2:
        raise ValueError(f"need at least 2 feature vectors for a covariance, got {x.shape[0]}")
    return GaussianStats(x.mean(0), np.cov(x, rowvar=False).reshape(x.shape[1], x.shape[1]), x.shape[0])


class StatsAccumulator:
    """`feature_stats` over batches, without keeping them.

    Keeps n, the mean and the centred scatter sum (x - mean)(x - mean)^T, merged batch by batch with Chan et
    al.'s (1979) pairwise update: the same numbers as sum x and sum x x^T, without their cancellation when the
    features sit far from the origin.
    """

    def __init__(self):
        self.count = 0
        self.mean: np.ndarray | None = None
        self.scatter: np.ndarray | None = None

    def add(self, batch) -> None:
        x = as_features(batch)
        if x.shape[0] == 0:
            return
        batch_mean = x.mean(0)
        centred = x - batch_mean
        batch_scatter = centred.T @ centred
        if self.mean is None:
            self.count, self.mean, self.scatter = x.shape[0], batch_mean, batch_scatter
            return
        if x.shape[1] != self.mean.shape[0]:
            raise ValueError(f"batch has {x.shape[1]} features, earlier batches had {self.mean.shape[0]}")
        total = self.count + x.shape[0]
        delta = batch_mean - self.mean
        self.scatter = self.scatter + batch_scatter + np.outer(delta, delta) * (self.count * x.shape[0] / total)
        self.mean = self.mean + delta * (x.shape[0] / total)
        self.count = total

    def stats(self) -> GaussianStats:
        if self.count < 2:
            raise ValueError(f"need at least 2 feature vectors for a covariance, got {self.count}")
        return GaussianStats(self.mean.copy(), self.scatter / (self.count - 1), self.count)


def _psd_sqrt(matrix: np.ndarray) -> np.ndarray:
    """The symmetric PSD square root, from eigh with tiny negative eigenvalues clipped to 0."""
    values, vectors = np.linalg.eigh(0.5 * (matrix + matrix.T))
    return (vectors * np.sqrt(np.clip(values, 0.0, None))) @ vectors.T


def frechet_distance(a: GaussianStats, b: GaussianStats) -> float:
    """|mu_a - mu_b|^2 + tr Sa + tr Sb - 2 tr (Sa^1/2 Sb Sa^1/2)^1/2 (Heusel et al. 2017)."""
    if a.mean.shape != b.mean.shape:
        raise ValueError(f"stats of different dimensions: {a.mean.shape} vs {b.mean.shape}")
    root_a = _psd_sqrt(a.cov)
    middle = root_a @ b.cov @ root_a
    cross = np.sqrt(np.clip(np.linalg.eigvalsh(0.5 * (middle + middle.T)), 0.0, None)).sum()
    distance = np.sum((a.mean - b.mean) ** 2) + np.trace(a.cov) + np.trace(b.cov) - 2 * cross
    return max(float(distance), 0.0)


def _polynomial_kernel(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """(x.y / D + 1)^3, in place: the blocks are large and allocating them costs more than the arithmetic."""
    base = x @ y.T
    base /= x.shape[1]
    base += 1
    cube = np.multiply(base, base)
    cube *= base
    return cube


def _kernel_sums(x: np.ndarray, y: np.ndarray, same: bool) -> tuple[np.ndarray, np.ndarray, float]:
    """Row sums, column sums and the sum of squares of the kernel matrix k(x_i, y_j), its diagonal left out when
    y is x; computed DISTANCE_CHUNK rows at a time, so that the whole matrix is never held."""
    rows, cols, squares = np.zeros(x.shape[0]), np.zeros(y.shape[0]), 0.0
    for lo in range(0, x.shape[0], DISTANCE_CHUNK):
        block = _polynomial_kernel(x[lo:lo + DISTANCE_CHUNK], y)
        if same:
            index = np.arange(block.shape[0])
            block[index, lo + index] = 0.0
        rows[lo:lo + block.shape[0]] = block.sum(1)
        cols += block.sum(0)
        squares += float(np.vdot(block, block))
    return rows, cols, squares


def _falling(m: int, j: int) -> float:
    """m (m - 1) ... (m - j + 1): the number of ordered j-tuples of distinct indices out of m."""
    return float(np.prod(np.arange(m - j + 1, m + 1, dtype=np.float64)))


def _mmd2_and_variance_terms(x: np.ndarray, y: np.ndarray) -> tuple[float, dict]:
    """The unbiased MMD^2 with the KID kernel, and unbiased estimates of the five terms of its variance over
    independent draws of both sets (m real points x, n fake points y).

    MMD^2 = mean_{i != j} k(x_i, x_j) + mean_{i != j} k(y_i, y_j) - 2 mean_{i, j} k(x_i, y_j) (Gretton et al. 2012)
    is a two-sample U-statistic, so Hoeffding's (1948) decomposition gives its variance exactly, as a sum of
    variances of orthogonal projections; Sutherland et al. (2017, "Generative Models and Model Criticism via
    Optimized Maximum Mean Discrepancy", section 2 and appendix) work it out for m = n, here for any m and n.
    With the mean embeddings mu_P(z) = E_x k(z, x), mu_Q(z) = E_y k(z, y) and the witness f = mu_P - mu_Q:
      first_order_real   = 4 Var_x f(x) / m
      first_order_fake   = 4 Var_y f(y) / n
      second_order_real  = 2 Var[k(x, x') - mu_P(x) - mu_P(x')] / (m (m - 1))
      second_order_fake  = 2 Var[k(y, y') - mu_Q(y) - mu_Q(y')] / (n (n - 1))
      second_order_cross = 4 Var[k(x, y) - mu_Q(x) - mu_P(y)] / (m n)
    Each moment in them is estimated without bias by a sum over distinct indices, written with the kernel matrices'
    row sums as Sutherland et al. do; so the sum of the five is an unbiased estimate of Var MMD^2.
    """
    m, n = x.shape[0], y.shape[0]
    rx, _, sxx = _kernel_sums(x, x, same=True)  # rx_i = sum_{j != i} k(x_i, x_j); sxx = sum_{i != j} k(x_i, x_j)^2
    ry, _, syy = _kernel_sums(y, y, same=True)
    cx, cy, sxy = _kernel_sums(x, y, same=False)  # cx_i = sum_j k(x_i, y_j), cy_j = sum_i k(x_i, y_j)
    total_xx, total_yy, total_xy = rx.sum(), ry.sum(), cx.sum()
    mmd2 = total_xx / _falling(m, 2) + total_yy / _falling(n, 2) - 2 * total_xy / (m * n)

    def within(r, squares, total, size):
        """Var_x mu(x) and Var k(x, x'), from E k12 k13, E k12^2 and (E k)^2 = E k12 k34 over distinct indices."""
        disjoint = (total**2 - 4 * np.dot(r, r) + 2 * squares) / _falling(size, 4)
        return (np.dot(r, r) - squares) / _falling(size, 3) - disjoint, squares / _falling(size, 2) - disjoint

    def embeddings_covariance(r, c, total, size, other):
        """Cov_z(mu_own(z), mu_other(z)) over one set: E k(z1, z2) k(z1, w) - E k(z, z') E k(z, w)."""
        joint = np.dot(r, c) / (_falling(size, 2) * other)
        return joint - (total * total_xy - 2 * np.dot(r, c)) / (_falling(size, 3) * other)

    var_mu_p_x, var_k_xx = within(rx, sxx, total_xx, m)  # Var_x mu_P(x), Var k(x, x')
    var_mu_q_y, var_k_yy = within(ry, syy, total_yy, n)
    disjoint_xy = (total_xy**2 - np.dot(cx, cx) - np.dot(cy, cy) + sxy) / (_falling(m, 2) * _falling(n, 2))
    var_k_xy = sxy / (m * n) - disjoint_xy
    var_mu_q_x = (np.dot(cx, cx) - sxy) / (m * _falling(n, 2)) - disjoint_xy  # Var_x mu_Q(x)
    var_mu_p_y = (np.dot(cy, cy) - sxy) / (_falling(m, 2) * n) - disjoint_xy
    var_f_x = var_mu_p_x + var_mu_q_x - 2 * embeddings_covariance(rx, cx, total_xx, m, n)
    var_f_y = var_mu_q_y + var_mu_p_y - 2 * embeddings_covariance(ry, cy, total_yy, n, m)
    terms = {
        "first_order_real": 4 * var_f_x / m,
        "first_order_fake": 4 * var_f_y / n,
        "second_order_real": 2 * (var_k_xx - 2 * var_mu_p_x) / (m * (m - 1)),
        "second_order_fake": 2 * (var_k_yy - 2 * var_mu_q_y) / (n * (n - 1)),
        "second_order_cross": 4 * (var_k_xy - var_mu_q_x - var_mu_p_y) / (m * n),
    }
    return float(mmd2), {name: float(value) for name, value in terms.items()}


def kid(real, fake) -> tuple[float, float]:
    """Kernel Inception Distance (Binkowski et al. 2018): unbiased MMD^2 with k(x, y) = (x.y / D + 1)^3.

    Computed once over the whole sets, not averaged over random subsets as Binkowski et al. do: the same
    expectation (the population MMD^2), a lower variance, and a closed-form error. Returns (KID, its standard
    error). The standard error is that of this estimate over independent draws of both sets, real and fake, from
    their distributions (it is not the spread of subsets): the square root of the sum of the variance terms of
    `_mmd2_and_variance_terms`, each a variance and so set to 0 where its unbiased estimate comes out negative.
    Far from the data that changes nothing; for samples nearly indistinguishable from the data, where the
    first-order terms are near 0 and their estimates noisy, it errs high (by up to ~30% in our checks), not low.
    """
    x, y = as_features(real), as_features(fake)
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"real and fake features differ in dimension: {x.shape[1]} vs {y.shape[1]}")
    if min(x.shape[0], y.shape[0]) < 4:
        raise ValueError(f"KID's standard error needs at least 4 real and 4 fake points, got {x.shape[0]} and "
                         f"{y.shape[0]}")
    mmd2, terms = _mmd2_and_variance_terms(x, y)
    return mmd2, float(np.sqrt(sum(max(term, 0.0) for term in terms.values())))


def _kth_neighbour_radii(points: torch.Tensor, k: int) -> torch.Tensor:
    """Distance from each point to its k-th nearest other point (the point itself is the 0-th)."""
    if not 0 < k < points.shape[0]:
        raise ValueError(f"k must be in [1, {points.shape[0] - 1}] for {points.shape[0]} points, got {k}")
    return torch.cat([  # topk: the value of kthvalue(k + 1), several times faster
        torch.cdist(chunk, points).topk(k + 1, dim=1, largest=False).values[:, k]
        for chunk in points.split(DISTANCE_CHUNK)
    ])


def _share_inside_balls(queries: torch.Tensor, centres: torch.Tensor, radii: torch.Tensor) -> float:
    """The share of queries within radius of at least one centre."""
    inside = sum(
        int((torch.cdist(chunk, centres) <= radii[None]).any(1).sum()) for chunk in queries.split(DISTANCE_CHUNK)
    )
    return inside / queries.shape[0]


def precision_recall(real, fake, k: int = 3) -> tuple[float, float]:
    """Improved precision and recall (Kynkaanniemi et al. 2019), with k-NN balls as the manifolds.

    Precision: the share of fake points inside some real point's ball (radius: its k-th real neighbour);
    recall: the share of real points inside some fake point's ball (radius: its k-th fake neighbour).
    """
    x, y = torch.from_numpy(as_features(real)), torch.from_numpy(as_features(fake))
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"real and fake features differ in dimension: {x.shape[1]} vs {y.shape[1]}")
    precision = _share_inside_balls(y, x, _kth_neighbour_radii(x, k))
    recall = _share_inside_balls(x, y, _kth_neighbour_radii(y, k))
    return precision, recall


def density_coverage(real, fake, k: int = 5) -> tuple[float, float]:
    """Density and coverage (Naeem et al. 2020, "Reliable Fidelity and Diversity Metrics for Generative Models"),
    with k-NN balls around the real points alone: B_i of radius NND_k(X_i), the distance from X_i to its k-th
    nearest real neighbour (k = 5, their recommendation).

    density = 1 / (k M) sum_j sum_i 1[Y_j in B_i]: the real balls that hold a fake point, over k, on average; 1 in
    expectation when fake and real come from one distribution, above 1 where fakes crowd the dense regions.
    coverage = 1 / N sum_i 1[some Y_j in B_i]: the share of real balls that hold at least one fake point.
    """
    x, y = torch.from_numpy(as_features(real)), torch.from_numpy(as_features(fake))
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"real and fake features differ in dimension: {x.shape[1]} vs {y.shape[1]}")
    radii = _kth_neighbour_radii(x, k)
    balls_holding = sum(int((torch.cdist(chunk, x) <= radii[None]).sum()) for chunk in y.split(DISTANCE_CHUNK))
    covered = sum(
        int((torch.cdist(chunk, y).min(1).values <= chunk_radii).sum())
        for chunk, chunk_radii in zip(x.split(DISTANCE_CHUNK), radii.split(DISTANCE_CHUNK), strict=True)
    )
    return balls_holding / (k * y.shape[0]), covered / x.shape[0]


def class_balance(fake_labels, data_labels, num_classes: int) -> dict:
    """Each class's share of the generated samples (as a classifier labels them) against its share of the data.

    total_variation = 0.5 sum_c |fake_c - data_c|; worst_class / worst_ratio: the smallest fake_c / data_c
    over the classes present in the data.
    """
    shares = []
    for name, labels in (("fake_labels", fake_labels), ("data_labels", data_labels)):
        labels = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels).reshape(-1)
        if labels.size == 0 or not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"{name} must be a non-empty array of integers, got {labels.dtype} of size {labels.size}")
        if labels.min() < 0 or labels.max() >= num_classes:
            raise ValueError(f"{name} must lie in [0, {num_classes}), got [{labels.min()}, {labels.max()}]")
        shares.append(np.bincount(labels, minlength=num_classes) / labels.size)
    fake_share, data_share = shares
    present = np.flatnonzero(data_share > 0)
    ratios = fake_share[present] / data_share[present]
    return {
        "fake_share": fake_share.tolist(),
        "data_share": data_share.tolist(),
        "total_variation": float(0.5 * np.abs(fake_share - data_share).sum()),
        "worst_class": int(present[ratios.argmin()]),
        "worst_ratio": float(ratios.min()),
    }
