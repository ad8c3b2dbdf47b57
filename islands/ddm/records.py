"""The ensemble's records on disk, typed: the manifest (`ensemble.json`) and its member entries (experts, range
experts, the router, the condition router); the exported ensemble's index (`ddm.json`) builds on them
(islands/export/records.py).

Each is a pydantic model with a `version` (files written before it had one read as version 1), validated on read:
an ensemble may have come from another island, so every value sampling or import uses is checked before anything
uses it, and a bad one is refused in one line naming the file and the key (`CheckpointError`). A member's network
is built from its record (`MemberRecord.network`).
"""

import json
import math
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    ValidationError,
    field_validator,
    model_validator,
)

from islands.errors import CheckpointError
from islands.rundir import one_line

VERSION = 1
PRIOR_TOLERANCE = 1e-6  # a prior's shares, written as sizes / their sum, sum to 1 within rounding


def _whole(value, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{value!r} is not a whole number of at least {least}")
    return value


def count(value, what: str, least: int = 0) -> int:
    """A whole number of at least `least` (not a bool, a float or a string), or one line naming `what`."""
    try:
        return _whole(value, least)
    except ValueError as err:
        raise CheckpointError(f"{what}: {err}") from None


def _shape(value):
    if not isinstance(value, list) or not 1 <= len(value) <= 4:
        raise ValueError(f"{value!r} is not the shape of one example")
    return value


Count = Annotated[int, BeforeValidator(lambda v: _whole(v, 0))]
Positive = Annotated[int, BeforeValidator(lambda v: _whole(v, 1))]
Shape = Annotated[list[Positive], BeforeValidator(_shape)]


def _prior(value, k: int) -> list[float]:
    """A distribution over k clusters: k finite, non-negative numbers summing to 1."""
    if not isinstance(value, list) or len(value) != k:
        raise ValueError(f"{value!r} is not a list of {k} shares, one per cluster")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
               for v in value):
        raise ValueError(f"{value!r} holds a share that is not a finite number of at least 0")
    if abs(sum(value) - 1) > PRIOR_TOLERANCE:
        raise ValueError(f"{value!r} does not sum to 1 (its sum is {sum(value)})")
    return value


def check_priors(record, k: int, classes: int) -> None:
    """`record.prior` over k clusters and, if any, `record.prior_by_class`: at least `classes` rows of them; a
    ValueError naming the key."""
    try:
        _prior(record.prior, k)
    except ValueError as err:
        raise ValueError(f"prior: {err}") from None
    if record.prior_by_class:
        if not isinstance(record.prior_by_class, list) or len(record.prior_by_class) < classes:
            raise ValueError(f"prior_by_class: not a list of at least {classes} rows, one per class")
        for c, row in enumerate(record.prior_by_class):
            try:
                _prior(row, k)
            except ValueError as err:
                raise ValueError(f"prior_by_class[{c}]: {err}") from None


class Record(BaseModel):
    """What every record shares: keys it does not name are kept (written back as they came), and it is written as
    the JSON it was read from, less nothing and plus its version."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    @field_validator("version", check_fields=False)
    @classmethod
    def _known(cls, version):
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= VERSION:
            raise ValueError(f"{version!r} is not a version this Islands reads (1 to {VERSION})")
        return version

    @classmethod
    def read(cls, data, path, **context):
        """`data` (parsed JSON) as this record, or one line naming `path` and the key."""
        try:
            return cls.model_validate(data, context=context)
        except ValidationError as err:
            raise CheckpointError(one_line(err, path)) from None

    @classmethod
    def parse(cls, data: bytes, path, **context):
        """The record in `data`, the bytes of `path`, or one line naming the file and the key."""
        try:
            return cls.model_validate_json(data, context=context)
        except ValidationError as err:
            raise CheckpointError(one_line(err, path)) from None

    def dump(self) -> dict:
        return self.model_dump(mode="json", exclude_unset=True, by_alias=True)

    def dumps(self) -> str:
        return json.dumps(self.dump(), indent=1)


class MemberRecord(Record):
    """One member of an ensemble: an expert, a range expert, a cluster's range experts (`ranges`, `t_ranges`), or the
    router. Without `weights` it never finished (or was not published, `why`), and is skipped when sampling."""

    name: str
    run: str | None = None
    weights: str | None = None
    sha256: str | None = None
    images: int | None = None
    path: str | None = None
    prediction: str | None = None
    model: dict | None = None
    shape: Shape | None = None
    num_classes: Count | None = None
    autoencoder_sha256: str | None = None
    text_encoder_sha256: str | None = None
    t_ranges: list[float] | None = None
    ranges: list["MemberRecord"] | None = None
    cluster: int | None = None
    size: Count | None = None
    why: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _an_entry(cls, data):
        if not isinstance(data, dict):
            raise ValueError(f"{data!r} is not a member's entry")
        return data

    @model_validator(mode="after")
    def _buildable(self):
        if self.trained:  # what its network is built from
            if self.shape is None:
                raise ValueError("shape: None is not the shape of one example")
            if self.num_classes is None:
                raise ValueError("num_classes: None is not a whole number of at least 0")
        return self

    @classmethod
    def of(cls, entry) -> "MemberRecord":
        """An entry as a record (a dict is validated)."""
        return entry if isinstance(entry, cls) else cls.model_validate(entry)

    @property
    def trained(self) -> bool:
        return self.weights is not None

    @property
    def arch(self) -> str | None:
        return (self.model or {}).get("arch")

    @property
    def parts(self) -> list["MemberRecord"]:
        """Its range experts, or itself."""
        return self.ranges if self.ranges is not None else [self]

    def path_options(self, keys) -> dict:
        """The options of its path among `keys` (a manifest written before paths took options has none)."""
        extra = self.model_extra or {}
        return {key: extra[key] for key in keys if key in extra}

    def config(self):
        """The model section as a config (its flow, data and the rest at their defaults)."""
        from islands.config import validate

        return validate({"run_dir": ".", "model": self.model})

    def spec(self):
        """What this member's network is built for (islands.nets.NetworkSpec)."""
        from islands.conditions import network_spec

        return network_spec(self.config().model, self.shape, self.num_classes)

    def network(self, weights: dict, device):
        """The network this record describes, holding `weights`; built only as large as they are (an ensemble
        folder copied from elsewhere may name any size), checked on the meta device first."""
        from islands.generate import network_with_weights
        from islands.nets import build_network
        from islands.untrusted import check_fits

        spec = self.spec()
        check_fits(lambda: build_network(spec), sum(w.numel() for w in weights.values()), f"the model of {self.name}")
        return network_with_weights(spec, weights, device)


class ConditionRouterSizes(Record):
    """What a condition router p(cluster | text) is built at: the pooled caption's width, the clusters, its hidden
    width."""

    width: Positive
    clusters: Positive
    hidden: Positive

    @model_validator(mode="before")
    @classmethod
    def _an_entry(cls, data):
        if not isinstance(data, dict):
            raise ValueError(f"{data!r} is not a condition router's entry")
        return data

    @property
    def sizes(self) -> dict:
        return {"width": self.width, "clusters": self.clusters, "hidden": self.hidden}

    def check_clusters(self, k: int) -> None:
        if self.clusters != k:
            raise ValueError(f"condition_router.clusters: {self.clusters} but the ensemble has {k} clusters")


class ConditionRouterRecord(ConditionRouterSizes):
    """p(cluster | text) in an ensemble's manifest: its weights and its sizes."""

    name: str = "condition router"
    weights: str
    sha256: str | None = None


class Calibration(BaseModel):
    """A condition router measured on held-out examples (ddm/condition_router.py's `fit_condition_router`): its
    numbers by name (accuracy, log-loss, ECE, ...), and each cluster's predicted and held-out share (an imported
    router has none)."""

    model_config = ConfigDict(extra="allow")
    shares_predicted: list[float] | None = None
    shares_empirical: list[float] | None = None


class ConditionRouterReport(ConditionRouterSizes):
    """ENSEMBLE/condition_router/condition_router.json (ddm/condition_router.py): the router's sizes and its held-out
    calibration (the report page's table)."""

    model_config = ConfigDict(extra="forbid")
    version: int = VERSION
    calibration: Calibration = Calibration()


class Priors(BaseModel):
    """What ancestral routing draws from: the cluster sizes' shares, and per class (the last row: no class)."""

    model_config = ConfigDict(extra="ignore", from_attributes=True)

    prior: list[float]
    prior_by_class: list[list[float]] | None = None

    @classmethod
    def of(cls, record) -> "Priors":
        return cls.model_validate(record, from_attributes=not isinstance(record, dict))


class EnsembleManifest(Record):
    """`ensemble.json`: the experts (one per cluster), the router, the priors, and the sha256 of what every member
    trained on."""

    version: int = VERSION
    k: Positive
    prior: Any = None
    partition: str | None = None
    experts: list[MemberRecord]
    router: MemberRecord
    autoencoder_sha256: str | None = None
    text_encoder_sha256: str | None = None
    t_ranges: list[float] | None = None
    condition_router: ConditionRouterRecord | None = None
    prior_by_class: Any = None
    imported_from: dict | None = None

    @model_validator(mode="before")
    @classmethod
    def _a_manifest(cls, data):
        if not isinstance(data, dict) or not isinstance(data.get("experts"), list) or not data["experts"]:
            raise ValueError("not an ensemble manifest (no list of experts)")
        return data

    @model_validator(mode="after")
    def _usable(self):
        k = len(self.experts)
        if self.k != k:
            raise ValueError(f"k: {self.k} but {k} experts are listed")
        classes = 0
        if self.prior_by_class:
            classes = next((e.num_classes for e in self.experts if e.num_classes is not None), None)
            if classes is None:
                raise ValueError("prior_by_class: no expert says how many classes there are")
        check_priors(self, k, classes)
        if self.condition_router is not None:
            self.condition_router.check_clusters(k)
        return self

    @property
    def members(self) -> list[MemberRecord]:
        """Every network: the experts (each range expert of a grid) and the router."""
        return [part for e in self.experts for part in e.parts] + [self.router]

    @property
    def shape(self) -> tuple:
        """The examples' shape (load_ensemble ensures a trained member)."""
        return next(tuple(e.shape) for e in self.experts if e.shape is not None)
