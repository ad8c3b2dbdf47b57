"""Split a data set into K clusters, one per expert of a Decentralized Diffusion Model.

The recipe of McAllister et al. (arXiv 2501.05450, Decentralized Diffusion Models): embed every example (they
use DINOv2 features), run k-means into 1024 fine centroids, then cluster those centroids (weighted by how many
examples each holds) into K coarse clusters with balanced k-means, so that the experts see similar amounts of
data; an example belongs to the coarse cluster of its fine centroid. Here the features are any `Features`
(`Pixels` by default), optionally reduced by PCA first; several blocks of them side by side (pixels beside caption
embeddings) are reduced and standardised each on its own (`Reduction`). Two baselines sit beside it: a seeded random
split and the oracle split by class label.

Data whose features do not fit in memory (more than `sample` examples): two-stage on a sample. The PCA and the
fine centroids are fitted on a seeded sample of `sample` examples; then one streaming pass over the data, in
chunks, gives every example its nearest fine centroid and each centroid its count, which weights the coarse
stage. Only the sample's features, the centroids and one integer per example are ever held.

On disk a partition is `partition.json` (everything but arrays) and `assignments.npz` (cluster of every example,
fine and coarse centroids, fine assignment), each written to a temporary file and renamed into place, and read
back with allow_pickle=False.
"""

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from islands.config import ConfigError
from islands.data.clusters import PartitionRecord
from islands.data.fingerprint import data_fingerprint
from islands.data.sources import Source
from islands.errors import CheckpointError, DataError
from islands.eval.features import BATCH as FEATURE_BATCH
from islands.eval.features import Features, Pixels
from islands.images import save_grid
from islands.rundir import atomic_write, atomic_write_text, read_npz

METHODS = ("kmeans", "random", "label")
META_FILE, ARRAYS_FILE = "partition.json", "assignments.npz"
META_KEYS = ("k", "method", "features_name", "data_sha256", "seed", "balanced", "sizes")
ARRAY_NAMES = ("cluster", "fine_centroids", "coarse_centroids", "fine_assignment")
READ_BATCH = 4096


class PartitionError(DataError):
    """A saved partition is missing, unreadable or inconsistent, or belongs to other data (one line, exit status 2)."""


# --- k-means ------------------------------------------------------------------------------------------------------

def _chunk_rows(k: int) -> int:
    """Rows per distance block, so one block holds about 4M distances whatever k is."""
    return max(1, (1 << 22) // k)


def _sq_distances(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Squared Euclidean distances [n, k], clamped at 0 against rounding."""
    d = (x * x).sum(1, keepdim=True) - 2 * x @ centroids.T + (centroids * centroids).sum(1)
    return d.clamp_(min=0)


def _nearest(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centroid of every point, computed in blocks of rows."""
    step = _chunk_rows(len(centroids))
    half_norms = 0.5 * (centroids * centroids).sum(1)  # |x - c|^2 / 2 - |x|^2 / 2 orders the centroids alike
    return torch.cat([torch.addmm(half_norms, x[lo:lo + step], centroids.T, alpha=-1).argmin(1)
                      for lo in range(0, len(x), step)])


def _balanced_assign(x: torch.Tensor, centroids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Capacity-constrained greedy assignment; see `kmeans`."""
    n, k = len(x), len(centroids)
    if k == 1:
        return torch.zeros(n, dtype=torch.int64)
    step = _chunk_rows(k)
    regret = torch.cat([_sq_distances(x[lo:lo + step], centroids).topk(2, dim=1, largest=False).values.diff(dim=1)[:, 0]
                        for lo in range(0, n, step)])
    order = np.argsort(-regret.numpy(), kind="stable")
    w = weights.double().numpy()
    capacity = w.sum() / k * (1 + 1e-9)
    load = np.zeros(k)
    assignment = np.full(n, -1, dtype=np.int64)
    for lo in range(0, n, step):
        block = order[lo:lo + step]
        for i, row in zip(block, _sq_distances(x[block], centroids).numpy(), strict=True):
            room = load + w[i] <= capacity
            if room.any():
                j = int(np.where(room, row, np.inf).argmin())
                assignment[i], load[j] = j, load[j] + w[i]
    leftover = np.flatnonzero(assignment < 0)
    leftover = leftover[np.argsort(-w[leftover], kind="stable")]  # heaviest first
    for i, row in zip(leftover, _sq_distances(x[leftover], centroids).numpy(), strict=True):
        j = int(np.where(load == load.min(), row, np.inf).argmin())
        assignment[i], load[j] = j, load[j] + w[i]
    return torch.from_numpy(assignment)


def _draw(mass: np.ndarray, gen: torch.Generator) -> int:
    """One index drawn with probability proportional to `mass` (not all zero)."""
    cumulative = np.cumsum(mass)
    u = float(torch.rand(1, dtype=torch.float64, generator=gen)) * cumulative[-1]
    return min(int(np.searchsorted(cumulative, u, side="right")), len(mass) - 1)


def _kmeans_plus_plus(x: torch.Tensor, k: int, weights: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """k-means++ seeding: each new centroid is drawn with probability proportional to weight x squared distance.
    The per-step vector work is numpy's: k small steps should not each wake torch's thread pool."""
    weights = weights.double().numpy()
    norms = (x * x).sum(1).double().numpy()
    chosen = [_draw(weights, gen)]
    closest = np.full(len(x), np.inf)
    for _ in range(1, k):
        c = x[chosen[-1]]
        closest = np.minimum(closest, np.maximum(norms - 2.0 * (x @ c).numpy() + float(c @ c), 0))
        mass = weights * closest
        chosen.append(_draw(mass if mass.sum() > 0 else weights, gen))
    return x[chosen].clone()


def _update(x: torch.Tensor, weights: torch.Tensor, assignment: torch.Tensor, centroids: torch.Tensor, k: int):
    """Weighted means of the clusters; an empty cluster takes the point farthest from its own centroid (among
    clusters of two or more). -> (assignment, centroids), every cluster non-empty."""
    assignment = assignment.clone()
    counts = torch.bincount(assignment, minlength=k)
    if (counts == 0).any():
        spread = ((x - centroids[assignment]) ** 2).sum(1)
        for empty in torch.nonzero(counts == 0)[:, 0].tolist():
            spread[counts[assignment] < 2] = -1
            far = int(spread.argmax())
            counts[assignment[far]] -= 1
            counts[empty] += 1
            assignment[far] = empty
            spread[far] = -1
    mass = torch.zeros(k, dtype=x.dtype).index_add_(0, assignment, weights)
    sums = torch.zeros_like(centroids).index_add_(0, assignment, x * weights[:, None])
    return assignment, sums / mass[:, None]


def kmeans(x: torch.Tensor, k: int, seed: int, iters: int = 50, weights: torch.Tensor | None = None,
           balanced: bool = False, progress: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means with k-means++ seeding from a generator seeded by `seed`: deterministic for a seed.

    x [N, D]; weights [N] > 0 (default 1) weight the means and, when balanced, the cluster sizes. Iterates until
    the assignment stops changing or `iters` rounds; every cluster stays non-empty (an empty one is re-seeded with
    the point farthest from its centroid). Returns (centroids [k, D] float32, assignment [N] int64), the centroids
    being the weighted means of their clusters.

    balanced=True replaces the nearest-centroid step by a capacity-constrained greedy assignment: points go in
    order of regret (second-nearest minus nearest distance, largest first), each to its nearest centroid whose
    load (sum of weights) stays within total / k; the few points that fit nowhere then go, heaviest first, to the
    least-loaded cluster (nearest among ties). With unit weights the sizes differ by at most 1; with other weights
    (the coarse stage's fine-cluster counts) the loads come out near total / k, off by about one point's weight.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"kmeans: k must be a positive int, got {k!r}")
    if x.dim() != 2 or len(x) < k:
        raise ValueError(f"kmeans: k={k} clusters for points of shape {tuple(x.shape)}")
    if iters < 1:
        raise ValueError(f"kmeans: iters must be >= 1, got {iters}")
    weights = torch.ones(len(x)) if weights is None else torch.as_tensor(weights, dtype=torch.float32)
    if weights.shape != (len(x),) or not (weights > 0).all():
        raise ValueError(f"kmeans: weights must be {len(x)} positive numbers")
    x = x.float()
    offset = x.mean(0)
    x = x - offset  # centred: the expanded distance formula loses less to cancellation
    centroids = _kmeans_plus_plus(x, k, weights, torch.Generator().manual_seed(seed))
    assignment = None
    for _ in tqdm(range(iters), disable=not progress, desc=f"k-means into {k}", unit="iter"):
        new = _balanced_assign(x, centroids, weights) if balanced else _nearest(x, centroids)
        if assignment is not None and torch.equal(new, assignment):
            break
        assignment, centroids = _update(x, weights, new, centroids, k)
    return centroids + offset, assignment


def pca(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Centre x [N, D] and project it onto its `dim` leading principal axes -> [N, dim] float32.

    The axes are eigenvectors of the covariance (float64, accumulated in blocks), each signed so that its entry of
    largest magnitude is positive: the same data always gives the same projection.
    """
    return project(x, *pca_axes(x, dim))


def pca_axes(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean [D] and the `dim` leading principal axes [D, dim] of x [N, D], float64, as `pca` uses them."""
    n, d = x.shape
    if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= d:
        raise ValueError(f"pca: dim must be an int in 1..{d}, got {dim!r}")
    mean = sum(x[lo:lo + READ_BATCH].double().sum(0) for lo in range(0, n, READ_BATCH)) / n
    cov = torch.zeros(d, d, dtype=torch.float64)
    for lo in range(0, n, READ_BATCH):
        centred = x[lo:lo + READ_BATCH].double() - mean
        cov += centred.T @ centred
    _, vectors = torch.linalg.eigh(cov)
    axes = vectors[:, -dim:].flip(1)  # eigh sorts eigenvalues ascending
    axes *= torch.sign(axes.gather(0, axes.abs().argmax(0, keepdim=True)))
    return mean, axes


def project(x: torch.Tensor, mean: torch.Tensor, axes: torch.Tensor) -> torch.Tensor:
    """x [N, D] centred and projected onto `axes` -> [N, dim] float32."""
    return torch.cat([(x[lo:lo + READ_BATCH].double() - mean) @ axes for lo in range(0, len(x), READ_BATCH)]).float()


class Reduction:
    """What k-means clusters, fitted on features z [N, D] and applied to any chunk of them.

    One block (blocks None): z's PCA to `pca_dim` where z is wider, else z as it is. Several blocks side by side
    (widths `blocks`: image features beside caption embeddings) are each reduced the same way, centred, and scaled to
    unit total variance before they are joined. k-means weighs each coordinate by its share of the squared distance,
    so joined raw, the wider or louder block (3,072 pixels against 384 caption dimensions, of other scales) would
    decide the clusters alone; at unit total variance each block adds the same expected squared distance between two
    examples, so they count equally. Not whitened: unit variance on every axis would give the noise of a block's
    last axes the weight of its leading ones."""

    def __init__(self, z: torch.Tensor, pca_dim: int | None, blocks: tuple[int, ...] | None = None):
        self.parts, reduced = None, False  # (columns, mean, axes) of each block; None: z as it is
        if blocks is None and pca_dim and z.shape[1] > pca_dim:
            self.parts, reduced = [(slice(None), *pca_axes(z, pca_dim))], True
        elif blocks is not None:
            if sum(blocks) != z.shape[1]:
                raise ValueError(f"blocks {blocks} do not add up to the features' width {z.shape[1]}")
            self.parts, edges = [], np.cumsum([0, *blocks]).tolist()
            for lo, hi in zip(edges[:-1], edges[1:], strict=True):
                block = z[:, lo:hi]
                if pca_dim and hi - lo > pca_dim:
                    mean, axes = pca_axes(block, pca_dim)
                    reduced = True
                else:
                    mean, axes = block.double().mean(0), torch.eye(hi - lo, dtype=torch.float64)
                total = float(project(block, mean, axes).double().pow(2).sum()) / len(block)  # its total variance
                self.parts.append((slice(lo, hi), mean, axes / math.sqrt(total) if total > 0 else axes))
        self.suffix = (f"+pca{pca_dim}" if reduced else "") + ("+standardised" if blocks is not None else "")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.parts is None:
            return x
        return torch.cat([project(x[:, columns], mean, axes) for columns, mean, axes in self.parts], 1)


# --- the partition ------------------------------------------------------------------------------------------------

def _empty(dtype, ndim: int) -> np.ndarray:
    return np.zeros((0,) * ndim, dtype=dtype)


@dataclass
class Partition:
    cluster: np.ndarray  # [N] int64: the cluster of every example
    sizes: list[int]
    k: int
    method: str
    features_name: str
    data_sha256: str
    seed: int
    balanced: bool
    fine_centroids: np.ndarray = field(default_factory=lambda: _empty(np.float32, 2))
    coarse_centroids: np.ndarray = field(default_factory=lambda: _empty(np.float32, 2))
    fine_assignment: np.ndarray = field(default_factory=lambda: _empty(np.int64, 1))
    sizes_by_class: list[list[int]] | None = None  # [class][cluster] counts, for labelled data

    def __post_init__(self):
        totals = None if self.sizes_by_class is None else [sum(col) for col in zip(*self.sizes_by_class, strict=True)]
        if totals is not None and totals != list(self.sizes):
            raise PartitionError(f"sizes_by_class does not add up to the cluster sizes {self.sizes}")

    def members(self, index: int) -> np.ndarray:
        """Sorted indices of the examples in cluster `index`."""
        if not 0 <= index < self.k:
            raise ValueError(f"cluster {index} out of range: the partition has {self.k} clusters")
        return np.flatnonzero(self.cluster == index)

    def check(self, source: Source) -> None:
        """Refuse a source other than the one this partition was made of."""
        found = data_fingerprint(source)
        if found != self.data_sha256:
            raise PartitionError(f"partition was made for other data: {len(self.cluster)} examples with sha256 "
                                 f"{self.data_sha256[:16]}..., this source has {len(source)} with {found[:16]}...")

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        arrays = {name: getattr(self, name) for name in ARRAY_NAMES}
        meta = PartitionRecord(**{key: getattr(self, key) for key in META_KEYS}, n=len(self.cluster),
                               sizes_by_class=self.sizes_by_class)
        atomic_write(directory / ARRAYS_FILE, lambda f: np.savez(f, **arrays))
        atomic_write_text(directory / META_FILE, meta.model_dump_json(indent=1, exclude_none=True))
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> "Partition":
        directory = Path(directory)
        meta_path, arrays_path = directory / META_FILE, directory / ARRAYS_FILE
        try:
            meta = PartitionRecord.read(meta_path)
        except CheckpointError as err:
            raise PartitionError(f"cannot read {err}") from None
        if meta.data_sha256 is None:
            raise PartitionError(f"cannot read {meta_path}: data_sha256: missing (made before partitions recorded "
                                 "their data's fingerprint); partition again")
        fields = {key: getattr(meta, key) for key in (*META_KEYS, "sizes_by_class")}
        n = meta.n
        try:
            arrays = read_npz(arrays_path, ARRAY_NAMES, required=ARRAY_NAMES)
        except ValueError as err:
            raise PartitionError(f"cannot read {arrays_path}: {err}") from None
        cluster, k, sizes = arrays["cluster"], fields["k"], fields["sizes"]
        if not (cluster.dtype == np.int64 and cluster.shape == (n,) and isinstance(k, int) and (cluster >= 0).all()
                and np.bincount(cluster, minlength=k).tolist() == sizes):
            raise PartitionError(f"{arrays_path} does not match {meta_path}: expected the clusters of {n} examples "
                                 f"with sizes {sizes}")
        try:
            return cls(**fields, **arrays)
        except (PartitionError, TypeError) as err:
            raise PartitionError(f"{meta_path}: {err}") from None


def _labels(source: Source) -> np.ndarray:
    return np.concatenate([source.get(np.arange(lo, min(len(source), lo + READ_BATCH)))[1].numpy()
                           for lo in range(0, len(source), READ_BATCH)])


def _deal_classes(labels: np.ndarray, k: int) -> np.ndarray:
    """Whole classes to clusters, largest class first to the least-loaded cluster: -> cluster of every example."""
    classes, counts = np.unique(labels, return_counts=True)
    if k > len(classes):
        raise ConfigError(f"ddm.k: {k} clusters for {len(classes)} classes (method 'label' deals whole classes)")
    load = np.zeros(k, dtype=np.int64)
    cluster_of_class = {}
    for c in np.argsort(-counts, kind="stable"):
        target = int(load.argmin())
        cluster_of_class[int(classes[c])] = target
        load[target] += counts[c]
    return np.array([cluster_of_class[int(y)] for y in labels], dtype=np.int64)


def partition(source: Source, k: int, method: str = "kmeans", features: Features | None = None,
              pca_dim: int | None = 64, fine: int = 1024, balanced: bool = True, seed: int = 0,
              progress: bool = False, sample: int = 65_536, seen: Source | None = None,
              blocks: tuple[int, ...] | None = None) -> Partition:
    """Split `source` into k clusters.

    kmeans: features (default `Pixels()`), PCA to pca_dim when they are wider, k-means into min(fine, N) fine
    centroids, then k-means over those centroids weighted by their sizes into k coarse clusters (balanced or not).
    Beyond `sample` examples, PCA and fine centroids are fitted on a seeded sample of that many and every example
    is assigned to its nearest fine centroid in one streaming pass (the module's docstring). `seen` (the same
    examples in the same order, another view of them: their captions' embeddings) is what the features are computed
    from, where given; the partition records `source`'s fingerprint. `blocks`: the widths of the feature blocks side
    by side (image features, caption embeddings), each reduced and standardised on its own (`Reduction`).
    random: a seeded shuffle dealt round-robin, so sizes differ by at most 1. label: whole classes dealt to clusters,
    largest first to the least-loaded one.
    """
    n = len(source)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"ddm.k: must be a positive int, got {k!r}")
    if k > n:
        raise ConfigError(f"ddm.k: {k} clusters for {n} examples")
    if method not in METHODS:
        raise ConfigError(f"ddm.partition.method: unknown method {method!r}; choose from {', '.join(METHODS)}")
    if method == "label" and not source.num_classes:
        raise ConfigError(f"ddm.partition.method: 'label' needs labelled data; {source!r} has none")
    if method == "kmeans" and fine < k:
        raise ConfigError(f"ddm.partition.fine: {fine} fine centroids for {k} clusters; need at least k")
    if method == "kmeans" and pca_dim is not None and (isinstance(pca_dim, bool) or not isinstance(pca_dim, int)
                                                       or pca_dim < 1):
        raise ConfigError(f"ddm.partition.pca_dim: must be a positive int or null, got {pca_dim!r}")

    labels = _labels(source) if source.num_classes else None

    def made(cluster: np.ndarray, features_name: str, **centroids) -> Partition:
        by_class = None
        if labels is not None:  # what oracle routing of a class-conditional ensemble draws from: p(cluster | class)
            by_class = np.zeros((source.num_classes, k), dtype=np.int64)
            np.add.at(by_class, (labels, cluster), 1)
            by_class = by_class.tolist()
        return Partition(cluster, np.bincount(cluster, minlength=k).tolist(), k, method, features_name,
                         data_fingerprint(source), seed, balanced, **centroids, sizes_by_class=by_class)

    if method == "random":
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
        cluster = np.empty(n, dtype=np.int64)
        cluster[order] = np.arange(n) % k
        return made(cluster, "none")
    if method == "label":
        return made(_deal_classes(labels, k), "labels")

    features, seen = features or Pixels(), seen or source
    sampled = n > sample
    if sampled:
        fitted_on = np.sort(torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:sample].numpy())
        z = torch.cat(list(_feature_chunks(features, seen, fitted_on, progress)))
    else:
        z = features.of_source(seen, progress=progress).float()
    reduce = Reduction(z, pca_dim, blocks)
    name, z = features.name + reduce.suffix, reduce(z)
    fine_centroids, fine_assignment = kmeans(z, min(fine, len(z)), seed, progress=progress)
    if sampled:  # the whole data, in one streaming pass: each example to its nearest fine centroid
        del z
        fine_assignment = torch.cat([_nearest(reduce(chunk), fine_centroids)
                                     for chunk in _feature_chunks(features, seen, np.arange(n), progress)])
        used = torch.unique(fine_assignment)  # sorted; a centroid of the sample may be no example's nearest
        fine_centroids, fine_assignment = fine_centroids[used], torch.searchsorted(used, fine_assignment)
    counts = torch.bincount(fine_assignment, minlength=len(fine_centroids))
    coarse_centroids, coarse_of_fine = kmeans(fine_centroids, k, seed, weights=counts.float(), balanced=balanced,
                                              progress=progress)
    return made(coarse_of_fine[fine_assignment].numpy(), name, fine_centroids=fine_centroids.numpy(),
                coarse_centroids=coarse_centroids.numpy(), fine_assignment=fine_assignment.numpy())


def _feature_chunks(features: Features, source: Source, indices: np.ndarray, progress: bool):
    """The features of `source`'s examples `indices`, in the batches `Features.of_source` reads."""
    for lo in tqdm(range(0, len(indices), FEATURE_BATCH), disable=not progress, desc=f"{features.name} features",
                   unit="batch"):
        yield features(source.get(indices[lo:lo + FEATURE_BATCH])[0]).float()


# --- a picture of the clusters ------------------------------------------------------------------------------------

def save_cluster_picture(partition: Partition, source: Source, path: str | Path, per_cluster: int = 8) -> Path:
    """Images: one row per cluster of `per_cluster` of its examples, evenly spread over its members (blank where
    a cluster has fewer). Vectors: their first two coordinates, coloured by cluster."""
    if len(partition.cluster) != len(source):
        raise PartitionError(f"partition of {len(partition.cluster)} examples, source of {len(source)}")
    if len(source.shape) == 3:
        grid = torch.ones(partition.k * per_cluster, *source.shape)  # +1 is white, like the grid's border
        for c in range(partition.k):
            members = partition.members(c)
            picked = members[np.linspace(0, len(members) - 1, min(per_cluster, len(members))).round().astype(int)]
            grid[c * per_cluster: c * per_cluster + len(picked)] = source.get(picked)[0]
        return save_grid(grid, path, nrow=per_cluster)
    if len(source.shape) == 1 and source.shape[0] >= 2:
        return _save_cluster_scatter(partition, source, Path(path))
    raise ValueError(f"cannot picture examples of shape {source.shape}: need images (C, H, W) or vectors (d >= 2)")


def _save_cluster_scatter(partition: Partition, source: Source, path: Path, most: int = 20_000) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = np.unique(np.linspace(0, len(source) - 1, min(most, len(source))).round().astype(np.int64))
    x = source.get(shown)[0].float().numpy()
    fig, ax = plt.subplots(figsize=(5, 5), dpi=100)
    ids = partition.cluster[shown]
    if partition.k <= 20:
        colours = plt.get_cmap("tab10" if partition.k <= 10 else "tab20")(ids)
    else:
        colours = plt.get_cmap("turbo")(ids / (partition.k - 1))
    ax.scatter(x[:, 0], x[:, 1], s=2, c=colours)
    ax.set_aspect("equal")
    ax.set_title(f"{partition.k} clusters ({partition.method}, {partition.features_name})")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path
