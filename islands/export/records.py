"""The export's records on disk, typed: `islands_export.json` (a run exported, `ExportRecord`) and `ddm.json` (an
ensemble exported, `ExportedIndex`, which `islands import` reads back as untrusted).

Each is a pydantic model with a `version` (a file without one is version 1: `islands_export.json` is written without
it, as before it had a model), validated by its writer before it is written and by its reader when read: a bad value
is refused in one line naming the file and the key (`CheckpointError`). They are written as the JSON they held
before they were typed, byte for byte; the exported `pipeline.py` reads `ddm.json` by its keys, since it imports
nothing of Islands.
"""

import json
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, ValidationInfo, field_validator, model_validator

from islands.ddm.records import VERSION, ConditionRouterRecord, Count, Positive, Record, Shape, check_priors
from islands.errors import CheckpointError

RUN_RECORD, INDEX = "islands_export.json", "ddm.json"


class TextRecord(Record):
    """How a prompt becomes a text network's caption (islands/conditions/text.py `export_record`): the encoder that
    made the run's captions and its files' sha256, the tokenizer's arguments, how the pooled vector is made; for a
    run, also the forward's arguments its class reads and the file of its learned null caption (None: the network
    holds it)."""

    text_encoder: str
    sha256: str | None = None
    tokenizer: dict[str, Any]
    pooling: str
    normalize: bool
    lowercase: bool
    arguments: list[str] | None = None
    null_caption: str | None = None


class ExportRecord(Record):
    """`islands_export.json`: where an exported run came from (its folder, checkpoint, weights file and config with
    its sha256, Islands' version), how a prompt reaches it (`text`), and each shipped file's sha256."""

    version: int = 1
    islands_version: str
    run_dir: str
    checkpoint: str
    weights: str
    config_sha256: str
    config: dict[str, Any]
    text: TextRecord | None = None
    files: dict[str, str]

    def write(self, path: Path) -> Path:
        Path(path).write_text(json.dumps(self.dump(), indent=2))
        return Path(path)

    @classmethod
    def load(cls, path: Path) -> "ExportRecord":
        """The record in `path` (an exported folder's islands_export.json), or one line naming the file and the key."""
        return cls.read(_json(path), path)


class ExportedExpert(Record):
    name: str | None = None
    folder: str
    class_name: str | None = None
    cluster: int | None = None
    size: Count
    source_sha256: str | None = None
    islands_model: Any = None

    @field_validator("folder", mode="before")
    @classmethod
    def _expert_n(cls, value):
        if not isinstance(value, str) or not re.fullmatch(r"expert_\d+", value):
            raise ValueError(f"{value!r} is not expert_N")
        return value


class RouterConfig(Record):
    """An exported ensemble's `router/config.json`, as `DDMRouter.save_pretrained` (islands/export/
    diffusers_pipeline.py) writes it: the sizes `islands import` builds Islands' router from."""

    num_experts: Positive
    num_classes: Count
    hidden_size: Positive
    depth: Positive
    num_heads: Positive
    patch_size: Positive


def _experts(value):
    if not isinstance(value, list) or not value or not all(isinstance(e, (dict, ExportedExpert)) for e in value):
        raise ValueError("not a list of the experts' entries")
    return value


def _config(value):
    if not isinstance(value, dict):
        raise ValueError(f"{value!r} is not a config (a mapping)")
    return value


class ExportedIndex(Record):
    """`ddm.json`: every file of an exported ensemble with its sha256, the priors, the sampling defaults and the
    ensemble's config."""

    class_name: str = Field("DDMPipeline", alias="_class_name")
    islands_version: str | None = None
    version: int = VERSION
    k: int | None = None
    islands_config: Annotated[dict, BeforeValidator(_config)]
    shape: Shape
    num_classes: Count
    condition: str | None = None
    experts: Annotated[list[ExportedExpert], BeforeValidator(_experts)]
    prior: Any = None
    prior_by_class: Any = None
    text: TextRecord | None = None
    text_encoder_sha256: str | None = None
    router: str | None = None
    condition_router: ConditionRouterRecord | None = None
    sample: dict | None = None
    files: dict[str, str]

    @model_validator(mode="before")
    @classmethod
    def _an_index(cls, data, info: ValidationInfo):
        files = data.get("files") if isinstance(data, dict) else None
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
            raise ValueError("not an exported ensemble's index (no files with their sha256)")
        if (allowed := (info.context or {}).get("allowed")) is not None:  # the files of the open DDM layout
            refused = sorted(name for name in files if not allowed.fullmatch(name))
            if refused:
                raise ValueError(f"{refused[0]} is not a file of the open DDM layout; refusing the folder")
        if "islands_config" not in data:
            raise ValueError("has no islands_config, the ensemble's config")
        return data

    @model_validator(mode="after")
    def _usable(self):
        # a row per class, and the last for no class
        check_priors(self, len(self.experts), self.num_classes + 1)
        if self.condition_router is not None:
            self.condition_router.check_clusters(len(self.experts))
        return self

    @classmethod
    def load(cls, path: Path, **context) -> "ExportedIndex":
        """The index in `path` (an exported folder's ddm.json), or one line naming the file and the key."""
        return cls.read(_json(path), path, **context)


def _json(path: Path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: not an exported folder's record ({err})") from None
