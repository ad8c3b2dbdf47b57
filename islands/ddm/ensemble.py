"""The ensemble manifest (`ensemble.json`) and loading a routed `Mixture` from it.

Experts arrive from other islands and are treated as untrusted: the manifest (plain JSON) records each
weights file's sha256, every file must lie inside the ensemble folder, is checked against it and opened as
safetensors before anything runs and again at every load, and nothing is ever unpickled. An expert that is
missing from disk or never finished leaves the ensemble usable: the router renormalises over the experts that
exist, and a warning names the missing one.
"""

import functools
import hashlib
import json
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as safetensors_load

from islands.config import Config, to_dict
from islands.data.captions import recorded_text_encoder
from islands.data.clusters import PartitionRecord
from islands.data.latents import recorded_sha256
from islands.ddm.condition_router import ROUTER_FOLDER, ROUTER_REPORT, ROUTER_WEIGHTS, ConditionRouter, condition_prior
from islands.ddm.mixture import DEFAULT_ROUTING, ExpertSlot, Mixture, PriorRouter, parse_routing
from islands.ddm.records import (
    VERSION,
    ConditionRouterRecord,
    ConditionRouterReport,
    ConditionRouterSizes,
    EnsembleManifest,
    MemberRecord,
    Priors,
)
from islands.ddm.runs import ensemble_dir, expert_dir, expert_runs, partition_dir, router_dir
from islands.ddm.time_gate import TimeGate
from islands.errors import CheckpointError, DataError, IslandsWarning
from islands.flow.denoiser import NetworkDenoiser
from islands.flow.paths import PATH_OPTIONS, build_path
from islands.nets.router import route
from islands.rundir import atomic_write_text, describe_run, latest_checkpoint, weights_file
from islands.untrusted import file_sha256, inside

MANIFEST = "ensemble.json"


def _entry(root: Path, run: Path, name: str) -> dict:
    """One member of the ensemble: where its weights are, their hash, and the conventions it was trained in."""
    entry = {"name": name, "run": str(run.relative_to(root))}
    ckpt = latest_checkpoint(run)
    if ckpt is None:
        return entry  # never finished (or never started): listed, and skipped when sampling
    weights = weights_file(ckpt)
    cfg, info = describe_run(run)
    entry.update(weights=str(weights.relative_to(root)), sha256=file_sha256(weights), images=int(ckpt.name),
                 path=cfg.flow.path, **cfg.flow.path_options(), prediction=cfg.flow.prediction,
                 model=to_dict(cfg)["model"], shape=list(info.shape), num_classes=info.num_classes)
    if (autoencoder := recorded_sha256(run)) is not None:  # it learnt the latents of these weights
        entry["autoencoder_sha256"] = autoencoder
    if (text_encoder := recorded_text_encoder(run)) is not None:  # it read captions these weights encoded
        entry["text_encoder_sha256"] = text_encoder
    return entry


def _one_of(entries: list[dict], key: str, what: str) -> str | None:
    """The sha256 under `key` that every trained member shares (None: none has one); members trained on different
    weights (latents of other autoencoders, captions of other text encoders) cannot be mixed."""
    found = {e.get(key) for e in entries if "weights" in e}
    if len(found) > 1:
        named = ", ".join(f"{e['name']} {str(e.get(key))[:12]}" for e in entries if "weights" in e)
        raise CheckpointError(f"the members trained on different {what} ({named}); they cannot be mixed")
    return found.pop() if found else None


def write_manifest(cfg: Config) -> dict:
    """List the experts and the router of the ensemble that `cfg` describes, as they are on disk now."""
    root = ensemble_dir(cfg)
    partition = PartitionRecord.of(partition_dir(cfg))
    sizes = partition.sizes
    experts = []
    for k in range(cfg.ddm.k):
        if cfg.ddm.t_ranges:  # a cluster x range grid: the cluster's expert is its range experts behind a time gate
            ranges = [_entry(root, run, f"expert{k}.{r}") for r, run in enumerate(expert_runs(cfg, k))]
            described = {key: ranges[0][key] for key in ("shape", "num_classes") if key in ranges[0]}
            entry = {"name": f"expert{k}", **described, "t_ranges": cfg.ddm.t_ranges, "ranges": ranges}
        else:
            entry = _entry(root, expert_dir(cfg, k), f"expert{k}")
        experts.append({**entry, "cluster": k, "size": sizes[k]})
    prior = [s / sum(sizes) for s in sizes]
    manifest = {"k": cfg.ddm.k, "prior": prior, "partition": partition.method,
                "experts": experts, "router": _entry(root, router_dir(cfg), "router")}
    members = [part for e in experts for part in e.get("ranges", [e])] + [manifest["router"]]
    # what sampling decodes with (every member saw the latents) and encodes prompts with, checked at every open
    for key, what in (("autoencoder_sha256", "autoencoders"), ("text_encoder_sha256", "text encoders")):
        if (sha256 := _one_of(members, key, what)) is not None:
            manifest[key] = sha256
    if cfg.ddm.t_ranges:
        manifest["t_ranges"] = cfg.ddm.t_ranges
    weights = root / ROUTER_FOLDER / ROUTER_WEIGHTS
    if weights.exists():  # p(cluster | text), which ancestral routing draws a prompt's expert from
        report = ConditionRouterReport.parse((root / ROUTER_FOLDER / ROUTER_REPORT).read_bytes(),
                                             root / ROUTER_FOLDER / ROUTER_REPORT)
        manifest["condition_router"] = {"name": "condition router", "weights": str(weights.relative_to(root)),
                                        "sha256": file_sha256(weights), **report.sizes}
    if partition.sizes_by_class:  # p(cluster | class), for ancestral routing of class-conditional samples
        manifest["prior_by_class"] = [[c / sum(row) for c in row] if sum(row) else prior
                                      for row in partition.sizes_by_class]
    record = EnsembleManifest.read({"version": VERSION, **manifest}, root / MANIFEST)
    atomic_write_text(root / MANIFEST, record.dumps())
    return record.dump()


def read_manifest(root: Path) -> EnsembleManifest:
    """The manifest, its values checked before anything uses them: an ensemble may have come from another island."""
    root = Path(root)
    try:
        path = inside(root, MANIFEST, "ensemble folder")
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read ensemble manifest {root / MANIFEST}: {err}") from None
    return EnsembleManifest.read(manifest, root / MANIFEST)


def _weights_path(root: Path, entry: MemberRecord | ConditionRouterRecord) -> Path:
    """The entry's weights file, which must lie inside the ensemble folder (islands/untrusted.py's rule): a manifest
    that points elsewhere would have files read that nobody copied in with the ensemble."""
    try:
        return inside(root, entry.weights, "ensemble folder")
    except DataError:
        raise CheckpointError(f"{root / MANIFEST}: {entry.name}'s weights {entry.weights} lie outside {root}; "
                              f"refusing {entry.name}") from None


def read_verified(root: Path, entry: MemberRecord | ConditionRouterRecord) -> dict:
    """The entry's weights, at every load: the bytes that are hashed are the bytes deserialised, so a file swapped
    after the ensemble was opened (or between the check and the read) is never used."""
    path = _weights_path(root, entry)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err}; refusing {entry.name}") from None
    if hashlib.sha256(data).hexdigest() != entry.sha256:
        raise CheckpointError(f"{path}: sha256 does not match {MANIFEST}; refusing {entry.name}")
    try:
        return safetensors_load(data)
    except SafetensorError as err:
        raise CheckpointError(f"{path}: not a valid safetensors file ({err}); refusing {entry.name}") from None


def _verified(root: Path, entry: MemberRecord) -> tuple[bool, str]:
    """Whether the entry's weights are there, checked now so that a bad file stops the run before anything is
    sampled; if not, why (missing or unfinished: the mixture warns when it routes around it)."""
    if not entry.trained:  # an imported ensemble says why it has none (islands/export/imported.py)
        return False, entry.why or f"has no finished checkpoint ({root / entry.run})"
    if not _weights_path(root, entry).is_file():
        return False, f"is missing from disk ({root / entry.weights})"
    read_verified(root, entry)
    return True, ""


def _expert(root: Path, entry: MemberRecord | dict, device) -> NetworkDenoiser:
    """An expert in the canonical frame, whatever path (and schedule) and prediction it was trained with. Manifests
    written before a path took options lack them: the path's defaults apply."""
    entry = MemberRecord.of(entry)
    flow_path = build_path(entry.path, **entry.path_options(PATH_OPTIONS))
    return NetworkDenoiser(entry.network(read_verified(root, entry), device), flow_path, entry.prediction)


def _gated(root: Path, entry: MemberRecord, device) -> TimeGate:
    """A cluster's range experts behind their gate by t."""
    return TimeGate([_expert(root, part, device) for part in entry.ranges], entry.t_ranges)


def _router_network(root: Path, entry: MemberRecord, device) -> torch.nn.Module:
    weights = read_verified(root, entry)
    if "anchor.log_prior" not in weights:  # its logits were not anchored: read as anchored they would be wrong
        raise CheckpointError(f"{root / entry.weights}: this router was trained before routers were anchored at "
                              "the prior; retrain it: islands train ENSEMBLE/config.yaml router")
    return entry.network(weights, device)


class LearnedRouter:
    def __init__(self, net: torch.nn.Module):
        self.net = net

    def __call__(self, x, t, cond=None):
        # a router that reads no condition (an unconditional one beside class-conditional experts) routes on x_t
        return route(self.net, x, t, cond if self.net.condition is not None else None)


def load_ensemble(root: Path, routing: str = DEFAULT_ROUTING, max_loaded: int | None = None, seed: int = 0,
                  device="cpu", call_batch: int | None = None) -> tuple[Mixture, EnsembleManifest]:
    """The ensemble as one `Denoiser`: every file verified now, and again each time an expert's network is built
    (when first needed, and after `max_loaded` dropped it); no expert call larger than `call_batch` samples."""
    root = Path(root)
    manifest = read_manifest(root)
    slots = []
    for entry in manifest.experts:
        if entry.ranges is not None:  # its range experts, gated by t: all of them, or the cluster's expert is missing
            checked = [_verified(root, part) for part in entry.ranges]
            missing = next((f"{part.name} {why}" for part, (found, why) in zip(entry.ranges, checked,
                                                                             strict=True) if not found), "")
            load = None if missing else functools.partial(_gated, root, entry, device)
        else:
            found, missing = _verified(root, entry)
            load = functools.partial(_expert, root, entry, device) if found else None
        slots.append(ExpertSlot(entry.name, load, missing))
    if not any(slot.available for slot in slots):
        raise CheckpointError(f"{root}: no expert of the ensemble is available")
    router = None  # ancestral routing asks no router: it is not even read
    if parse_routing(routing).needs_router:
        found, router_missing = _verified(root, manifest.router)
        if not found:
            warnings.warn(f"the router {router_missing}; routing by the cluster sizes alone", IslandsWarning,
                          stacklevel=2)
        router = (LearnedRouter(_router_network(root, manifest.router, device)) if found
                  else PriorRouter(manifest.prior))
    mixture = Mixture(slots, router, routing=routing, max_loaded=max_loaded, seed=seed,
                      time_boundaries=(manifest.t_ranges or [0, 1])[1:-1], call_batch=call_batch)
    return mixture, manifest


def distillation_teacher(cfg: Config, device) -> Mixture:
    """The teacher of a distilled student (train.teacher): each image's own cluster's expert (ancestral routing,
    the image's cluster assigned), or the whole routed mixture."""
    routing = "ancestral" if cfg.train.teacher == "cluster" else "full"
    return load_ensemble(Path(cfg.data.partition).parent, routing, seed=cfg.seed, device=device)[0]


def condition_router_of(spec: ConditionRouterSizes | dict, weights: dict, what: str) -> ConditionRouter:
    """The condition router of `spec`'s sizes holding `weights`, its shapes compared before it is built: sizes from a
    manifest that its weights do not have are refused in one line, never allocated."""
    if isinstance(spec, dict):  # its sizes alone
        spec = ConditionRouterSizes.read(spec, what)
    width, clusters, hidden = spec.width, spec.clusters, spec.hidden
    wanted = {"net.0.weight": (hidden, width), "net.0.bias": (hidden,), "net.2.weight": (clusters, hidden),
              "net.2.bias": (clusters,)}
    if {name: tuple(value.shape) for name, value in weights.items()} != wanted:
        raise CheckpointError(f"{what}: its weights are not those of a condition router of width {width}, "
                              f"{hidden} hidden and {clusters} clusters")
    router = ConditionRouter(width, clusters, hidden)
    router.load_state_dict(weights)
    return router.eval()


def load_condition_prior(root: Path, manifest: EnsembleManifest | dict):
    """The ensemble's condition router as labels -> p(cluster | text) (its weights verified), or None without one."""
    if isinstance(manifest, dict):
        manifest = EnsembleManifest.read(manifest, Path(root) / MANIFEST)
    entry = manifest.condition_router
    if entry is None:
        return None
    router = condition_router_of(entry, read_verified(Path(root), entry), f"{Path(root) / entry.weights}")
    return condition_prior(router, entry.width)


def ancestral_clusters(manifest: EnsembleManifest | Priors | dict, seed: int, first: int, num: int,
                       labels: torch.Tensor | None = None,
                       available: torch.Tensor | None = None, condition_prior=None):
    """Sample i's cluster, drawn by its own stream (the same at any batch size) from the cluster sizes, or, for a
    class-conditional sample, from p(cluster | its class): a trouser must go to an expert that has seen trousers.
    Label `num_classes` (no label) draws from the sizes; a prompt (a packed caption) from `condition_prior`,
    p(cluster | text), where the ensemble has a condition router, else from the sizes. With `available` (K
    booleans), missing experts' shares are given to the others in proportion (evenly where a class has nothing
    else)."""
    from islands.data import streams

    # the stream keeps the name of the policy's first release, so earlier samples are drawn again exactly
    priors = Priors.of(manifest)
    u = streams.uniform(seed, list(range(first, first + num)), "oracle").double()
    prior = torch.tensor(priors.prior, dtype=torch.float64).expand(num, -1)
    # a class's own table; a prompt (a packed caption, not an index) its condition router's estimate
    if labels is not None and labels.dim() == 1 and priors.prior_by_class:
        table = torch.tensor(priors.prior_by_class + [priors.prior], dtype=torch.float64)
        prior = table[torch.as_tensor(labels, dtype=torch.long).cpu()]
    elif labels is not None and labels.dim() > 1 and condition_prior is not None:
        prior = condition_prior(labels)
    if available is not None and not available.all():
        prior = prior * available.double()
        prior = torch.where(prior.sum(1, keepdim=True) > 0, prior, available.double().expand_as(prior))
    edges = prior.cumsum(1)
    drawn = torch.searchsorted(edges, (u * edges[:, -1]).unsqueeze(1), right=True).squeeze(1)
    return drawn.clamp(max=prior.shape[1] - 1)


def ancestral_assignment(mixture: Mixture, manifest: EnsembleManifest | Priors | dict, seed: int, drawn_by=None,
                         condition_prior=None):
    """For `generate(for_batch=...)`: the mixture (or `drawn_by`, the same mixture spread over ranks) with every
    sample of the batch sent to its expert as ancestral routing draws it, around missing experts (None when the
    policy needs no assignment)."""
    if not mixture.routing.needs_assignment:
        return None

    def for_batch(lo, hi, labels):
        mixture.warn_missing()
        return (drawn_by or mixture).assigned(ancestral_clusters(manifest, seed, lo, hi - lo, labels,
                                                                 mixture.available, condition_prior))

    return for_batch
