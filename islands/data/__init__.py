"""Data sources, the Gaussian-mixture source, and the stream-ordered loader."""

from islands.data.clusters import ClusterLabelled, ClusterSubset, read_clusters
from islands.data.conditions import WithCaptionEmbeddings
from islands.data.fingerprint import remembered
from islands.data.gmm import GaussianMixture, GMMSource
from islands.data.registry import build_source
from islands.data.sources import DataError, Source


def build_data(cfg, seed: int, check: bool = False) -> Source:
    """The source a `DataConfig` names, with only the options that source takes, seen through its partition. With
    `check`, a file that would stop a run mid-training stops it now, by name (`Source.check`, once per state of the
    files)."""
    source = _build_source(cfg, seed)
    if check:
        remembered(source, "check", lambda: _passed(source))
    if cfg.partition is None:
        return source
    cluster = read_clusters(cfg.partition, source, data_name(cfg))
    return ClusterLabelled(source, cluster) if cfg.cluster is None else ClusterSubset(source, cluster, cfg.cluster)


def data_name(cfg) -> str:
    """The data a `DataConfig` names, for people: its file or folder, else its kind."""
    return getattr(cfg, "path", None) or f"the {cfg.source} data"


def _passed(source: Source) -> str:
    source.check()
    return "passed"


def judged_on(source: Source) -> Source:
    """The data a model trained on `source` is judged against: a router's or a distilled student's examples carry
    their cluster in the label for training only; samples compare with the data itself."""
    while isinstance(source, ClusterLabelled | WithCaptionEmbeddings):  # and a caption's embedding, for training only
        source = source.source
    return source


def _build_source(cfg, seed: int) -> Source:
    if cfg.source == "gmm":
        return GMMSource(cfg.means, cfg.std, cfg.weights, size=cfg.size, seed=seed)
    from islands.config import COMMON_DATA_KEYS  # config reads the data's folders: not at import

    options = cfg.model_dump(exclude={"source", *COMMON_DATA_KEYS})  # the source's own keys
    if cfg.source == "fashion_mnist" and options["path"] is None:
        del options["path"]  # the source's default place
    return build_source(cfg.source, **options)


__all__ = ["ClusterLabelled", "ClusterSubset", "DataError", "GaussianMixture", "GMMSource", "Source", "build_data",
           "data_name", "judged_on"]
