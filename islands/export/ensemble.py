"""An ensemble as the open DDM checkpoints ship one (`islands export ENSEMBLE OUT/`), sampled by plain diffusers.

OUT/expert_N/ holds expert N as its own diffusers class (`save_pretrained` of the weights the manifest verified, a
text-conditioned one with islands_null_caption.safetensors beside, its learned "no caption", as the forward takes a
caption), or, for Islands' own U-Net and DiT, as IslandsUNet or IslandsDiT, whose code ships in
OUT/islands_networks/ as `islands export RUN` ships it; OUT/router/ the router as `DDMRouter`
(islands/export/diffusers_pipeline.py, whose weights carry Islands' names, so no conversion touches them);
OUT/scheduler/ the rectified-flow scheduler; OUT/partition/ the partition as Islands wrote it (sizes, shares per
class, centroids); OUT/condition_router/ p(cluster | caption) on text; OUT/pipeline.py the pipeline that samples
them by any routing policy, with no Islands installed; OUT/ddm.json names everything, with each file's sha256, the
priors, the sampling defaults and the ensemble's config, which `islands import` reads back.
"""

import shutil
from pathlib import Path

import yaml
from safetensors.torch import save_file

from islands import __version__
from islands.conditions import condition_kind
from islands.config import load_config
from islands.ddm.condition_router import ROUTER_FOLDER, ROUTER_WEIGHTS
from islands.ddm.ensemble import read_manifest, read_verified
from islands.ddm.mixture import DEFAULT_ROUTING
from islands.ddm.partition import ARRAYS_FILE, META_FILE
from islands.ddm.records import VERSION, ConditionRouterRecord, EnsembleManifest, MemberRecord
from islands.ddm.runs import partition_dir
from islands.errors import ConfigError
from islands.export import diffusers_pipeline
from islands.export.records import INDEX, ExportedExpert, ExportedIndex
from islands.export.run import null_caption, own_model, scheduler_for, shipped_source, write_package
from islands.nets import OWN_NETWORK_ARGUMENTS
from islands.nets.diffusers_net import NULL_CAPTION
from islands.nets.diffusers_wrapper import SHIPPED
from islands.rundir import BUILDING_MARKER, built_beside
from islands.untrusted import file_sha256


def _refuse_unless_exportable(root: Path, manifest: EnsembleManifest, cfg) -> None:
    """One line naming what keeps the ensemble from the layout: only finished, rectified-flow, diffusers experts on
    pixels, one per cluster, sample as the pipeline samples."""
    if manifest.t_ranges:
        raise ConfigError(f"ddm.t_ranges: {root} is a grid of timestep-range experts; the open DDM layout holds one "
                          f"expert per cluster")
    if manifest.autoencoder_sha256:
        raise ConfigError(f"data.autoencoder: {root}'s experts learnt latents, and the export ships no autoencoder "
                          f"to decode them")
    for entry in manifest.experts:
        if not entry.trained:
            raise ConfigError(f"{entry.name} of {root} has no finished checkpoint; a published ensemble ships every "
                              f"expert")
        if entry.arch not in ("diffusers", *OWN_NETWORK_ARGUMENTS):
            raise ConfigError(f"model.arch: {entry.name} is a {entry.arch!r}, which has no diffusers "
                              f"counterpart; an ensemble's experts export from model.arch diffusers, unet or dit")
        if (entry.path, entry.prediction) != ("rectified_flow", "velocity"):
            raise ConfigError(f"flow.path: {entry.name} learnt {entry.path} {entry.prediction}; the pipeline "
                              f"mixes rectified-flow velocities")
    scheduler_for(cfg)  # the ensemble's own flow section, the one its samples are drawn with


def _router_arguments(entry: MemberRecord) -> dict:
    spec = entry.spec()
    model = spec.model
    channels, size = entry.shape[0], entry.shape[1]
    return {"sample_size": size, "in_channels": channels, "num_experts": model.outputs,
            "patch_size": model.patch_size, "hidden_size": model.hidden_size or 128,
            "depth": model.depth or 4, "num_heads": model.num_heads or 4, "num_classes": entry.num_classes,
            "pooled_width": spec.text.pooled_width if spec.text else 0}


def export_ensemble(root: Path, out: Path) -> Path:
    """Write the ensemble at `root` in the open DDM layout at `out` (which must not exist, or be an empty folder),
    built beside it and renamed into place."""
    root, out = Path(root), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: already exists and is not an empty folder; export writes a new one")
    manifest = read_manifest(root)
    cfg = load_config(root / "config.yaml")
    _refuse_unless_exportable(root, manifest, cfg)
    condition_kind(cfg.model).check_exportable(cfg)

    with built_beside(out) as building:  # one a killed export left is removed; a person's `.OUT.partial` refused
        experts = []
        for k, entry in enumerate(manifest.experts):
            arch, folder = entry.arch, f"expert_{k}"
            net = entry.network(read_verified(root, entry), "cpu")
            if arch == "diffusers":
                model = net.to_diffusers()
            else:  # Islands' own network, as the diffusers class whose code ships in islands_networks/
                model = own_model(entry.config(), entry.spec(), net)
            model.save_pretrained(building / folder, safe_serialization=True)
            if arch == "diffusers" and net.text is not None:  # its learned "no caption", not among the class's weights
                save_file(null_caption(net), building / folder / NULL_CAPTION)
            experts.append(ExportedExpert(name=entry.name, folder=folder, class_name=type(model).__name__, cluster=k,
                                          size=entry.size, source_sha256=entry.sha256, islands_model=entry.model))
        if any(e.arch != "diffusers" for e in manifest.experts):
            write_package(building, {name: shipped_source(name) for name in SHIPPED})
        first = manifest.experts[0]
        # how a prompt becomes the experts' condition (every expert encodes alike)
        condition = {key: {k: v for k, v in record.items() if k not in ("arguments", "null_caption")}
                     for key, record in condition_kind(cfg.model).export_record(cfg, root / first.run).items()}
        router = manifest.router
        if router.trained:  # without one, only ancestral routing samples it
            model = diffusers_pipeline.DDMRouter(**_router_arguments(router))
            model.load_state_dict(read_verified(root, router))  # strict: every weight under the same name
            model.save_pretrained(building / "router", safe_serialization=True)
        if (spec := manifest.condition_router) is not None:
            (building / ROUTER_FOLDER).mkdir()
            save_file(read_verified(root, spec), building / ROUTER_FOLDER / ROUTER_WEIGHTS)
        scheduler_for(cfg).save_pretrained(building / "scheduler")
        (building / "partition").mkdir()
        for name in (META_FILE, ARRAYS_FILE):
            shutil.copyfile(partition_dir(cfg) / name, building / "partition" / name)
        shutil.copyfile(diffusers_pipeline.__file__, building / "pipeline.py")
        given = {}  # what only some ensembles have is absent from the others' index, not null
        if manifest.prior_by_class:  # the last row: no class, the sizes
            given.update(prior_by_class=manifest.prior_by_class + [manifest.prior])
        if router.trained:
            given.update(router="router")
        if spec is not None:
            given.update(condition_router=ConditionRouterRecord(**spec.sizes,
                                                                weights=f"{ROUTER_FOLDER}/{ROUTER_WEIGHTS}"))
        index = ExportedIndex.read(dict(
            class_name="DDMPipeline", islands_version=__version__, version=VERSION, k=manifest.k, shape=first.shape,
            num_classes=cfg.model.num_classes, condition=cfg.model.condition, prior=manifest.prior, experts=experts,
            **condition, **given,
            sample={"routing": DEFAULT_ROUTING, "steps": cfg.sample.steps, "guidance": cfg.sample.guidance,
                    "time_shift": cfg.sample.time_shift or 1.0},
            islands_config=yaml.safe_load((root / "config.yaml").read_text()),
            files={str(p.relative_to(building)): file_sha256(p) for p in sorted(building.rglob("*"))
                   if p.is_file() and p.name != BUILDING_MARKER}),  # the marker leaves before the rename
            building / INDEX)
        (building / INDEX).write_text(index.dumps())
    return out

