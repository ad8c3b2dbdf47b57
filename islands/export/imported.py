"""An ensemble published in the open DDM layout, read back (`islands import FOLDER ENSEMBLE/`).

The folder (written by `islands export ENSEMBLE`, islands/export/ensemble.py) arrives from elsewhere and is read as
untrusted: only the files of an exact allow-list are read, each inside the folder and hashing to what its ddm.json
says; weights are safetensors, expert classes one of the adapters', and its pipeline.py is never imported. What it
becomes is an ordinary ensemble directory: config.yaml (the publisher's, its run_dir this one), partition/,
experts/N/ and router/ weights under Islands' names, condition_router/ on text, and ensemble.json listing them with
their sha256, so that `islands sample`, `islands eval`, `islands report` and `islands distill` take it as they take
one trained here.

`--expert RUN` extends it: each run's latest weights join as one more expert, its data one more cluster. The prior
becomes the new sizes (and shares per class, counted from the run's data); the router and the condition router,
trained for the K clusters before, are left out of the manifest, so that router-based policies route by the sizes
until a router is trained for K + 1 and ancestral routing is exact.
"""

import functools
import hashlib
import json
import re
import warnings
from pathlib import Path

import numpy as np
import yaml

from islands.config import to_dict, validate
from islands.data import build_data
from islands.data.clusters import PartitionRecord
from islands.ddm.condition_router import ROUTER_FOLDER, ROUTER_REPORT, ROUTER_WEIGHTS
from islands.ddm.ensemble import MANIFEST, condition_router_of
from islands.ddm.partition import ARRAYS_FILE, META_FILE
from islands.ddm.records import VERSION, ConditionRouterRecord, EnsembleManifest, MemberRecord
from islands.errors import CheckpointError, ConfigError, DataError, IslandsWarning
from islands.export.records import INDEX, ExportedExpert, ExportedIndex, RouterConfig
from islands.generate import uninitialised_network
from islands.nets import OWN_NETWORK_ARGUMENTS
from islands.nets.diffusers_net import ADAPTERS, NULL_CAPTION, DiffusersNetwork
from islands.nets.diffusers_wrapper import EXPORTED_CLASS, PACKAGE, SHIPPED
from islands.rundir import (
    atomic_write_text,
    built_beside,
    describe_run,
    latest_checkpoint,
    load_weights,
    save_weights,
    weights_file,
)
from islands.untrusted import check_fits, file_sha256, inside

# Islands' own networks as the export names them; the folder carries their code (PACKAGE) for plain diffusers, and
# Islands never imports it: it has the networks' code itself
OWN_ARCH = {cls.__name__: arch for arch, cls in EXPORTED_CLASS.items()}
# every file an exported ensemble may hold, and nothing else is read
ALLOWED = re.compile(rf"(expert_\d+/(config\.json|diffusion_pytorch_model\.safetensors|{re.escape(NULL_CAPTION)})"
                     rf"|{PACKAGE}/({'|'.join([*SHIPPED, '__init__'])})\.py"
                     r"|router/(config\.json|diffusion_pytorch_model\.safetensors)|scheduler/scheduler_config\.json"
                     rf"|partition/({re.escape(META_FILE)}|{re.escape(ARRAYS_FILE)})"
                     rf"|{ROUTER_FOLDER}/{re.escape(ROUTER_WEIGHTS)}|pipeline\.py)")
# the torch feature network of eval: a module imported by name and its weights, both on the publisher's machine; a
# config from another island never names code that this one runs (islands/eval/features.py's allow-list is the other
# guard)
TORCH_FEATURE_KEYS = ("feature_net", "feature_weights", "feature_size", "feature_channels")


class _Folder:
    """The exported folder: its index, and its files' bytes, each checked against the index when read."""

    def __init__(self, root: Path):
        self.root = Path(root)
        # a link out of the folder is not its index
        self.index_path = inside(self.root, INDEX, "ensemble folder")
        try:
            self.index = json.loads(self.index_path.read_text())
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{self.root / INDEX}: not an exported ensemble's index ({err})") from None
        self.index = ExportedIndex.read(self.index, self.root / INDEX, allowed=ALLOWED)
        self.files = self.index.files

    def path(self, name: str) -> Path:
        """A file the index lists, inside the folder (not hashed: for its header alone)."""
        if name not in self.files:
            raise CheckpointError(f"{self.root / INDEX}: lists no {name}")
        return inside(self.root, name, "ensemble folder")

    def read(self, name: str) -> bytes:
        path = self.path(name)
        try:
            data = path.read_bytes()
        except OSError as err:
            raise CheckpointError(f"cannot read {path}: {err}") from None
        if hashlib.sha256(data).hexdigest() != self.files[name]:
            raise CheckpointError(f"{path}: sha256 does not match {INDEX}; refusing the folder")
        return data

    def json(self, name: str) -> dict:
        try:
            data = json.loads(self.read(name))
        except ValueError as err:
            raise CheckpointError(f"{self.root / name}: not JSON ({err})") from None
        if not isinstance(data, dict):
            raise CheckpointError(f"{self.root / name}: not a JSON object")
        return data

    def weights(self, name: str) -> dict:
        from safetensors import SafetensorError
        from safetensors.torch import load

        try:
            return load(self.read(name))
        except SafetensorError as err:
            raise CheckpointError(f"{self.root / name}: not a valid safetensors file ({err})") from None


def without_code(config: dict, path: Path) -> dict:
    """The publisher's config less what would import code by name here (eval's torch feature network), with a
    warning: retraining an expert must not run a module that another island named."""
    section = config.get("eval")
    if not isinstance(section, dict) or not (section.get("features") == "torch" or section.get("feature_net")):
        return config
    named = section.get("feature_net")
    kept = {k: v for k, v in section.items() if k not in TORCH_FEATURE_KEYS and (k, v) != ("features", "torch")}
    warnings.warn(f"{path}: islands_config's eval.feature_net {named!r} names code to import: left out of the "
                  f"imported config.yaml with the rest of its torch features (name your own to use them)",
                  IslandsWarning, stacklevel=3)
    return {**config, "eval": kept}


def _fits(folder: _Folder, build, names: list[str], what: str) -> None:
    """The network `build()` makes, built on the meta device only as large as the listed weights files hold: a
    config that names more (channels: 20000) is refused before anything is allocated."""
    check_fits(build, [folder.path(name) for name in names], what)


def _expert_model(folder: _Folder, expert: ExportedExpert, cfg) -> dict:
    """The model section of an expert folder: a diffusers class and its constructor arguments, with the ensemble's
    condition; or Islands' own network's section as the index gives it, which must build what its config.json says."""
    name = expert.folder
    config = folder.json(f"{name}/config.json")
    class_name = config.get("_class_name")
    if class_name in OWN_ARCH:
        model = expert.islands_model
        if not isinstance(model, dict) or model.get("arch") != OWN_ARCH[class_name]:
            raise CheckpointError(f"{folder.root / INDEX}: {name} is a {class_name} without its islands_model")
        record = _member(model, folder.index)
        arguments = OWN_NETWORK_ARGUMENTS[record.arch](record.spec())
        arguments["text"] = None if arguments["text"] is None else vars(arguments["text"])
        given = {k: v for k, v in config.items() if not k.startswith("_") and k != "num_train_timesteps"}
        if json.loads(json.dumps(arguments)) != given:
            raise CheckpointError(f"{folder.root / name}/config.json: not the {class_name} its islands_model builds")
        return model
    if class_name not in ADAPTERS:
        raise CheckpointError(f"{folder.root / name}/config.json: {class_name!r} is not one of "
                              f"{', '.join([*ADAPTERS, *OWN_ARCH])}")
    model = to_dict(cfg)["model"]
    return {**model, "arch": "diffusers", "class_name": class_name, "pretrained": None,
            "config": {k: v for k, v in config.items() if not k.startswith("_")}}


def _load(net, folder: _Folder, name: str) -> None:
    """The expert folder's weights into Islands' network: a diffusers class's renamed (and its null caption read
    back into the network), Islands' own under the wrapper's `net.` prefix."""
    weights = folder.weights(f"{name}/diffusion_pytorch_model.safetensors")
    if not isinstance(net, DiffusersNetwork):
        if not all(key.startswith("net.") for key in weights):
            raise ValueError("its weights are not an Islands network's (net.*)")
        net.load_state_dict({key.removeprefix("net."): value for key, value in weights.items()})
        return
    net.load_diffusers_state_dict(weights)
    if net.text is not None:  # the null caption as the forward takes it: its first token row, its pooled vector
        null = folder.weights(f"{name}/{NULL_CAPTION}")
        own = {"null_token": null["encoder_hidden_states"][0, 0]}
        if "pooled_projections" in null:
            own["null_pooled"] = null["pooled_projections"][0]
        net.text.load_state_dict(own)


def _write(weights: dict, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_weights(weights, path)
    return file_sha256(path)


def _member(model: dict, index: ExportedIndex, name: str = "a member") -> MemberRecord:
    """A network of the index's examples that `model` describes, as a member's record."""
    return MemberRecord(name=name, model=model, shape=index.shape, num_classes=index.num_classes)


def _expert_entry(k: int, model: dict, shape: list, num_classes: int, path: str, prediction: str, size: int,
                  weights: str, sha256: str, **extra) -> MemberRecord:
    return MemberRecord(name=f"expert{k}", run=f"experts/{k}", weights=weights, sha256=sha256, path=path,
                        prediction=prediction, model=model, shape=shape, num_classes=num_classes, cluster=k, size=size,
                        **extra)


def _imported_experts(folder: _Folder, cfg, building: Path) -> list[MemberRecord]:
    index, entries = folder.index, []
    for k, expert in enumerate(index.experts):
        name = expert.folder  # expert_N (ExportedIndex)
        model = _expert_model(folder, expert, cfg)
        spec = _member(model, index).spec()
        weights = [f"{name}/{file}" for file in ("diffusion_pytorch_model.safetensors", NULL_CAPTION)
                   if f"{name}/{file}" in folder.files]  # the null caption: the network's own "no caption"
        _fits(folder, functools.partial(uninitialised_network, spec, "meta"), weights,
              f"{folder.root / name}/config.json")
        net = uninitialised_network(spec)
        try:
            _load(net, folder, name)
        except (ValueError, RuntimeError) as err:
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise CheckpointError(f"{folder.root / name}: {reason}") from None
        weights = f"experts/{k}/ema.safetensors"
        entries.append(_expert_entry(k, model, index.shape, index.num_classes, "rectified_flow", "velocity",
                                     int(expert.size), weights, _write(net.state_dict(), building / weights),
                                     images=0))
    return entries


def _imported_router(folder: _Folder, cfg, building: Path) -> MemberRecord:
    if folder.index.router is None:
        return MemberRecord(name="router", run="router", why="was not published with the ensemble")
    config = RouterConfig.read(folder.json("router/config.json"), folder.root / "router" / "config.json")
    if config.num_experts != len(folder.index.experts):
        raise CheckpointError(f"{folder.root / 'router'}/config.json: num_experts: {config.num_experts!r} but "
                              f"the ensemble has {len(folder.index.experts)} experts")
    model = {"arch": "router", "num_classes": config.num_classes, "outputs": config.num_experts,
             "condition": cfg.model.condition, "text_tokens": cfg.model.text_tokens, "text_width": cfg.model.text_width,
             "text_pooled_width": cfg.model.text_pooled_width, "hidden_size": config.hidden_size,
             "depth": config.depth, "num_heads": config.num_heads, "patch_size": config.patch_size}
    entry = MemberRecord(name="router", run="router", model=model, shape=folder.index.shape,
                         num_classes=config.num_classes)
    spec = entry.spec()
    _fits(folder, lambda: uninitialised_network(spec, "meta"),
          ["router/diffusion_pytorch_model.safetensors"], f"{folder.root / 'router'}/config.json")
    weights = folder.weights("router/diffusion_pytorch_model.safetensors")
    try:
        entry.network(weights, "cpu")  # strict: Islands' router under the same names
    except RuntimeError as err:
        raise CheckpointError(f"{folder.root / 'router'}: not the router its config.json describes "
                              f"({str(err).splitlines()[0]})") from None
    return MemberRecord(name="router", run="router", model=model, shape=folder.index.shape,
                        num_classes=config.num_classes, weights="router/ema.safetensors",
                        sha256=_write(weights, building / "router" / "ema.safetensors"))


def _joined_expert(run: Path, k: int, shape: list, num_classes: int,
                   building: Path) -> tuple[MemberRecord, list[int] | None]:
    """A run trained here joining as expert k: its latest weights, its data's size (and count per class)."""
    cfg, info = describe_run(run)
    ckpt = latest_checkpoint(run)
    if ckpt is None:
        raise CheckpointError(f"--expert: {run} has no complete checkpoint yet")
    if list(info.shape) != list(shape) or info.num_classes != num_classes:
        raise ConfigError(f"--expert: {run} learnt examples of shape {list(info.shape)} with {info.num_classes} "
                          f"classes; the ensemble's are {shape} with {num_classes}")
    source = build_data(cfg.data, cfg.seed)
    counts = None
    if num_classes:
        counts = np.zeros(num_classes, dtype=np.int64)
        for lo in range(0, len(source), 4096):
            counts += np.bincount(source.get(np.arange(lo, min(len(source), lo + 4096)))[1], minlength=num_classes)
    weights = f"experts/{k}/ema.safetensors"
    entry = _expert_entry(k, to_dict(cfg)["model"], list(info.shape), num_classes, cfg.flow.path, cfg.flow.prediction,
                          len(source), weights, _write(load_weights(weights_file(ckpt)), building / weights),
                          images=int(ckpt.name), **cfg.flow.path_options(), joined_from=str(run))
    return entry, None if counts is None else counts.tolist()


def import_ensemble(source: Path, out: Path, runs: list[Path] = ()) -> Path:
    """The ensemble folder `source` (open DDM layout) as an Islands ensemble directory at `out` (which must not exist,
    or be empty), with the runs `runs` joined as further experts; built beside it and renamed into place."""
    source, out = Path(source), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: already exists and is not an empty folder; import writes a new one")
    folder = _Folder(source)
    index = folder.index
    config = {**without_code(index.islands_config, source / INDEX), "run_dir": str(out)}
    try:
        cfg = validate(config)
    except (ValueError, ConfigError) as err:
        raise CheckpointError(f"{source / INDEX}: islands_config: {str(err).splitlines()[0]}") from None

    try:
        with built_beside(out) as building:  # removed if it fails; a `.OUT.partial` of a person's is refused
            _write_ensemble(building, folder, cfg, config, runs)
    except (ConfigError, DataError, CheckpointError):
        raise
    except (KeyError, TypeError, ValueError) as err:  # an index that lacks what it names, or names it wrongly
        raise CheckpointError(f"{source / INDEX}: not the index of an ensemble Islands exported "
                              f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
    return out


def _write_ensemble(building: Path, folder: _Folder, cfg, config: dict, runs: list[Path]) -> None:
    """The ensemble directory of `folder`, written into `building`: the experts' and router's weights under Islands'
    names, the partition, the condition router, the runs joined, config.yaml and ensemble.json."""
    index = folder.index
    experts = _imported_experts(folder, cfg, building)
    router = _imported_router(folder, cfg, building)
    (building / "partition").mkdir()
    for name in (META_FILE, ARRAYS_FILE):
        (building / "partition" / name).write_bytes(folder.read(f"partition/{name}"))
    partition = PartitionRecord.parse(folder.read(f"partition/{META_FILE}"), folder.root / "partition" / META_FILE)
    given = {}  # what only some ensembles have is absent from the others' manifest, not null
    if index.prior_by_class:
        given.update(prior_by_class=index.prior_by_class[:-1])
    if index.text_encoder_sha256:
        given.update(text_encoder_sha256=index.text_encoder_sha256)
    if index.condition_router is not None:
        weights = folder.weights(f"{ROUTER_FOLDER}/{ROUTER_WEIGHTS}")
        sizes = index.condition_router.sizes
        condition_router_of(sizes, weights, f"{folder.root / ROUTER_FOLDER}")  # the sizes its weights have
        path = building / ROUTER_FOLDER / ROUTER_WEIGHTS
        given.update(condition_router=ConditionRouterRecord(
            name="condition router", weights=f"{ROUTER_FOLDER}/{ROUTER_WEIGHTS}", sha256=_write(weights, path),
            **sizes))
        atomic_write_text(building / ROUTER_FOLDER / ROUTER_REPORT, json.dumps({**sizes, "calibration": {}}))
    manifest = dict(version=VERSION, k=len(experts), prior=index.prior, partition=partition.method,
                    experts=experts, router=router,
                    imported_from={"folder": str(folder.root), "ddm_sha256": file_sha256(folder.index_path)},
                    **given)
    if runs:  # the routers and the shares per class were for fewer clusters: set aside
        manifest = {k: v for k, v in manifest.items() if k not in ("condition_router", "prior_by_class")}
        manifest.update(_join(experts, partition, runs, building))
    manifest = EnsembleManifest.read(manifest, building / MANIFEST)
    config.setdefault("ddm", {})["k"] = manifest.k
    (building / "config.yaml").write_text(yaml.safe_dump(config))
    atomic_write_text(building / MANIFEST, manifest.dumps())


def _join(experts: list[MemberRecord], partition: PartitionRecord, runs: list[Path], building: Path) -> dict:
    """Runs trained here as experts K, K + 1, ... (appended to `experts`): the manifest's new sizes and priors; the
    routers trained for fewer clusters are set aside."""
    shape, num_classes = experts[0].shape, experts[0].num_classes
    sizes = [e.size for e in experts]
    # [class][cluster] counts; unconditional experts draw no sample by its class
    by_class = partition.sizes_by_class if num_classes else None  # counts >= 0 (the record's types)
    if by_class is not None and (len(by_class) != num_classes or not all(len(row) == len(sizes) for row in by_class)):
        raise CheckpointError(f"partition/{META_FILE}: sizes_by_class is not {num_classes} rows of {len(sizes)} "
                              f"counts, one per class")
    for run in runs:
        entry, counts = _joined_expert(Path(run), len(experts), shape, num_classes, building)
        experts.append(entry)
        sizes.append(entry.size)
        if by_class is not None and counts is not None:
            by_class = [row + [counts[c]] for c, row in enumerate(by_class)]
    prior = [s / sum(sizes) for s in sizes]
    why = f"was trained for {len(sizes) - len(runs)} clusters, not the {len(sizes)} the joined experts make"
    joined = dict(k=len(experts), prior=prior, router=MemberRecord(name="router", run="router", why=why))
    if by_class is not None:
        joined.update(prior_by_class=[[c / sum(row) for c in row] if sum(row) else prior for row in by_class])
    return joined
