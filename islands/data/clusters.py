"""A data set seen through a partition: one cluster of it (an expert's data), or all of it with each example's
cluster beside its class (the router's data). The partition folder is written by `islands partition`."""

import warnings
from pathlib import Path
from typing import Annotated, ClassVar

import numpy as np
import torch
from pydantic import Field

from islands.data.fingerprint import data_fingerprint
from islands.data.sources import CLUSTER, Source, View
from islands.errors import CheckpointError, DataError, IslandsWarning
from islands.rundir import Record, read_npz


class PartitionRecord(Record):
    """PARTITION/partition.json: everything of a partition but its arrays (assignments.npz), written by
    islands/ddm/partition.py and read here by the data of its clusters."""

    FILE: ClassVar[str] = "partition.json"
    k: int = Field(ge=1)
    method: str
    features_name: str
    data_sha256: str | None = None  # the fingerprint of the data it was made of (None: a partition made before)
    seed: int
    balanced: bool
    sizes: list[Annotated[int, Field(ge=0)]]
    n: int = Field(ge=0)
    sizes_by_class: list[list[Annotated[int, Field(ge=0)]]] | None = None  # [class][cluster] counts

    @classmethod
    def of(cls, partition_dir) -> "PartitionRecord":
        """The record in `partition_dir`, or one line naming the file and the key (a DataError)."""
        try:
            return cls.read(Path(partition_dir) / cls.FILE, "; run 'islands partition' first")
        except CheckpointError as err:
            raise DataError(f"partition: {err}") from None


def read_clusters(partition_dir: str | Path, source: Source, data: str) -> np.ndarray:
    """The cluster of every example of `source` (named `data` in errors), from assignments.npz (read without
    unpickling), once the data is known to be what the partition was made of: the fingerprint in partition.json."""
    path = Path(partition_dir) / "assignments.npz"
    try:
        arrays = read_npz(path, ("cluster",), required=("cluster",))
    except ValueError as err:
        raise DataError(f"cannot read partition {path}: {err}; run 'islands partition' first") from None
    cluster = np.asarray(arrays["cluster"], dtype=np.int64)
    if cluster.shape != (len(source),):
        raise DataError(f"partition {path} assigns {cluster.shape[0]} examples, the data has {len(source)}")
    recorded = (Path(partition_dir) / PartitionRecord.FILE).exists()  # arrays alone: checked by their length
    made_of = PartitionRecord.of(partition_dir).data_sha256 if recorded else None
    if made_of is None:
        warnings.warn(f"partition {partition_dir} records no fingerprint of its data: {data} is checked by its "
                      "length only; partition again to have it checked", IslandsWarning, stacklevel=2)
    elif made_of != data_fingerprint(source):
        raise DataError(f"partition {partition_dir} was made of other data than {data} (the same {len(source)} "
                        "examples in number, not in content); use the data it was made of or partition again")
    return cluster


def read_prior_table(partition_dir: str | Path, num_classes: int) -> torch.Tensor:
    """p(cluster | class) from partition.json, (num_classes + 1, K) float64; the last row is p(cluster), the
    cluster sizes, for samples without a class (and for a class the partition never saw)."""
    path, meta = Path(partition_dir) / PartitionRecord.FILE, PartitionRecord.of(partition_dir)
    sizes = torch.tensor(meta.sizes, dtype=torch.float64)
    by_class = meta.sizes_by_class if num_classes else None
    try:
        rows = torch.tensor(by_class, dtype=torch.float64) if by_class else sizes.expand(num_classes, -1)
    except ValueError as err:  # rows of unequal length
        raise DataError(f"cannot read partition {path}: sizes_by_class: {err}") from None
    if rows.shape != (num_classes, len(sizes)):
        raise DataError(f"partition {path} counts {rows.shape[0]} classes, the model has {num_classes}")
    table = torch.cat([rows, sizes.unsqueeze(0)])
    totals = table.sum(1, keepdim=True)
    return torch.where(totals > 0, table / totals.clamp_min(1), sizes / sizes.sum())


class ClusterSubset(View):
    """The examples of one cluster, in their original order."""

    def __init__(self, source: Source, cluster: np.ndarray, k: int):
        super().__init__(source)
        self.indices = np.flatnonzero(cluster == k)
        if len(self.indices) == 0:
            raise DataError(f"data.cluster: cluster {k} of the partition is empty")

    def __len__(self) -> int:
        return len(self.indices)

    def read(self, indices, fields) -> dict:
        return self.source.read(self.indices[np.asarray(indices, dtype=np.int64)].tolist(), fields)


class ClusterLabelled(View):
    """Every example with its class as it is, and its cluster beside it (the field `cluster`, the loader's
    `Batch.cluster`): the router learns the cluster and may be conditioned on the class."""

    def __init__(self, source: Source, cluster: np.ndarray):
        super().__init__(source)
        self.cluster = torch.from_numpy(cluster)
        self.num_clusters = int(cluster.max()) + 1
        self.holds = source.holds | {CLUSTER}

    def read(self, indices, fields) -> dict:
        got = self.source.read(indices, fields)
        if CLUSTER in fields:
            got[CLUSTER] = self.cluster[torch.as_tensor(np.asarray(indices, dtype=np.int64))]
        return got
