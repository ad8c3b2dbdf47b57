"""Sample-based metrics on feature vectors: Frechet distance, KID, precision/recall, class coverage.

Features are [N, D] torch tensors or numpy arrays (Inception activations, a classifier's embedding, or raw
vectors for toy data); everything is computed in float64 on the CPU. Matrix square roots use symmetric
eigendecompositions, so nothing beyond numpy and torch is needed.
"""

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

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
        """Write an .npz at exactly `path` (np.savez would append .npz to a bare name)."""
        with open(path, "wb") as file:
            np.savez(file, mean=self.mean, cov=self.cov, count=np.int64(self.count))

    @classmethod
    def load(cls, path) -> "GaussianStats":
        """Read what `save` wrote; never unpickles. Anything else raises ValueError naming the file."""
        try:
            archive = np.load(path, allow_pickle=False)
            if not isinstance(archive, np.lib.npyio.NpzFile):
                raise ValueError("not an .npz archive")
            with archive:
                mean, cov, count = archive["mean"], archive["cov"], archive["count"]
            dim = mean.shape[0] if mean.ndim == 1 else -1
            if cov.shape != (dim, dim) or count.shape != () or not np.issubdtype(count.dtype, np.integer):
                raise ValueError(f"inconsistent shapes mean {mean.shape}, cov {cov.shape}, count {count.shape}")
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
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
    return (x @ y.T / x.shape[1] + 1) ** 3


def _unbiased_mmd2(x: np.ndarray, y: np.ndarray) -> float:
    """The unbiased MMD^2 U-statistic (Gretton et al. 2012) with the KID kernel."""
    m = x.shape[0]
    kxx, kyy, kxy = _polynomial_kernel(x, x), _polynomial_kernel(y, y), _polynomial_kernel(x, y)
    within = (kxx.sum() - np.trace(kxx) + kyy.sum() - np.trace(kyy)) / (m * (m - 1))
    return float(within - 2 * kxy.mean())


def kid(real, fake, subsets: int = 100, subset_size: int = 1000, seed: int = 0) -> tuple[float, float]:
    """Kernel Inception Distance (Binkowski et al. 2018): unbiased MMD^2 with k(x, y) = (x.y / D + 1)^3.

    Averaged over `subsets` random subsets of min(subset_size, len(real), len(fake)) points of each set.
    Returns (mean, std over subsets / sqrt(subsets)); that error describes the subset draws, so it matches the
    sampling error of the sets only when the subsets barely overlap (subsets * subset_size <~ len).
    """
    x, y = as_features(real), as_features(fake)
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"real and fake features differ in dimension: {x.shape[1]} vs {y.shape[1]}")
    size = min(subset_size, x.shape[0], y.shape[0])
    if size < 2 or subsets < 2:
        raise ValueError(f"need subsets >= 2 of >= 2 points, got {subsets} subsets of {size}")
    rng = np.random.default_rng(seed)
    values = [
        _unbiased_mmd2(x[rng.choice(x.shape[0], size, replace=False)], y[rng.choice(y.shape[0], size, replace=False)])
        for _ in range(subsets)
    ]
    return float(np.mean(values)), float(np.std(values, ddof=1) / np.sqrt(subsets))


def _kth_neighbour_radii(points: torch.Tensor, k: int) -> torch.Tensor:
    """Distance from each point to its k-th nearest other point (the point itself is the 0-th)."""
    if not 0 < k < points.shape[0]:
        raise ValueError(f"k must be in [1, {points.shape[0] - 1}] for {points.shape[0]} points, got {k}")
    return torch.cat([
        torch.cdist(chunk, points).kthvalue(k + 1, dim=1).values for chunk in points.split(DISTANCE_CHUNK)
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


def class_coverage(fake_labels, data_labels, num_classes: int) -> dict:
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
