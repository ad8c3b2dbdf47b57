"""A whole Decentralized Diffusion Model from one config: partition, experts, router, manifest, samples, metrics.

`islands ddm CONFIG` runs every step on this machine, skipping what is already complete, so rerunning
continues. `--jobs J` trains J experts at once, the cores split between them. `--emit torchrun|slurm`
writes one launch script per island instead, for islands that share only a storage location.
"""

import json
import math
import os
import sys
from pathlib import Path

import torch

from islands.conditions import condition_kind
from islands.config import Config, ConfigError, load_config, revalidate
from islands.data import build_data
from islands.data.latents import open_data_space
from islands.data.sources import CAPTION_EMBEDDING, Source, X
from islands.ddm.condition_router import ROUTER_FOLDER, ROUTER_REPORT, fit_condition_router, save_condition_router
from islands.ddm.ensemble import MANIFEST, file_sha256, write_manifest
from islands.ddm.members import Member, run_members
from islands.ddm.mixture import DEFAULT_ROUTING
from islands.ddm.partition import Partition, partition, save_cluster_picture
from islands.ddm.runs import (
    ensemble_dir,
    expert_runs,
    member_configs,
    monolith_config,
    monolith_dir,
    partition_dir,
    router_dir,
)
from islands.ddm.sampling import open_sampler
from islands.eval.evaluate import (
    Evaluator,
    build_features,
    entry_key,
    evaluate_sampler,
    evaluate_target,
    format_table,
    generated,
    record,
    timed,
    trusted_features,
)
from islands.eval.features import Features, Pixels
from islands.flow.samplers import evaluations_per_sample
from islands.generate import open_run
from islands.images import save_samples_picture, save_side_by_side
from islands.rundir import describe_run, latest_checkpoint, prepare_run_dir, read_state, trained_below
from islands.train.flops import FlopsRecord, flops_per_image
from islands.train.objectives import build_objective


def whole_data(cfg: Config):
    """The data set itself, not seen through any partition."""
    return build_data(cfg.data.model_copy(update={"partition": None, "cluster": None}), cfg.seed)


def run_partition(cfg: Config, progress: bool = True) -> Partition:
    """Write ENSEMBLE/partition (once: an existing partition of other settings is never overwritten)."""
    if cfg.ddm.k < 2:
        raise ConfigError(f"ddm.k: {cfg.ddm.k}; a decentralized model needs at least 2 experts")
    out, p = partition_dir(cfg), cfg.ddm.partition
    source = whole_data(cfg)
    if (out / "partition.json").exists():
        done = Partition.load(out)
        if (done.k, done.method, done.seed) != (cfg.ddm.k, p.method, cfg.seed):
            raise ConfigError(f"ddm.partition: {out} holds another partition (k={done.k}, {done.method}); "
                              "use a new run_dir")
        done.check(source)
        return done
    # On latents, 'pixels' are what the source holds (images, or stored latents' means: no decoder pass over the data);
    # other features are of images (stored latents' means decoded, as metrics see them).
    space = open_data_space(cfg, out)
    images = space.reference(source)
    features, seen, blocks = SeenThrough(Pixels(), space.examples_of), None, None
    if p.method == "kmeans" and p.features in ("text", "both"):  # what the captions say (and the images show)
        kind = condition_kind(cfg.model)
        if kind.field != CAPTION_EMBEDDING:
            raise ConfigError(f"ddm.partition.features: {p.features} clusters captions; model.condition is "
                              f"{cfg.model.condition!r}, not text")
        seen = PooledCaptions(kind.source(cfg, out, source), cfg.model.text_pooled_width)
        features = CaptionVectors()
        if p.features == "both":
            seen = PixelsBesideCaptions(source, space.examples_of, seen)
            features, blocks = PixelsAndText(), seen.blocks
    elif p.method == "kmeans" and p.features != "pixels":
        built = build_features(revalidate(cfg.eval, "eval", features=p.features), images, cfg.seed, progress)
        features = SeenThrough(built, space.images_of)
    made = partition(source, cfg.ddm.k, p.method, features, p.pca_dim, p.fine, p.balanced, cfg.seed, progress,
                     seen=seen, blocks=blocks)
    made.save(out)
    save_cluster_picture(made, images, out / "clusters.png")
    return made


class CaptionVectors(Pixels):
    """The pooled caption embeddings themselves, named for what they are."""

    name = "text"


class PooledCaptions(Source):
    """Each example as its caption's pooled embedding (`ddm.partition.features: text`), read from the embeddings a
    text-conditioned run gives it (its kind's `source`), without reading the images."""

    def __init__(self, conditioned: Source, width: int):
        self.source, self.shape, self.num_classes = conditioned, (width,), 0

    def __len__(self) -> int:
        return len(self.source)

    def read(self, indices, fields) -> dict:
        if X not in fields:
            return {}
        return {X: self.source.read(indices, (CAPTION_EMBEDDING,))[CAPTION_EMBEDDING][:, 0, :self.shape[0]]}


class PixelsAndText(Pixels):
    """Pixels and the caption's pooled embedding side by side, as `PixelsBesideCaptions` gives them."""

    name = "pixels+text"


class PixelsBesideCaptions(Source):
    """Each example as its pixels (what the source holds through `view`: stored latents' means) flattened, then its
    caption's pooled embedding (`ddm.partition.features: both`); `blocks` are the two widths, which the partition
    standardises each on its own."""

    def __init__(self, source: Source, view, captions: PooledCaptions):
        self.source, self.view, self.captions, self.num_classes = source, view, captions, 0
        self.blocks = (math.prod(view(source.get([0])[0]).shape[1:]), captions.shape[0])
        self.shape = (sum(self.blocks),)

    def __len__(self) -> int:
        return len(self.source)

    def read(self, indices, fields) -> dict:
        if X not in fields:
            return {}
        pixels = self.view(self.source.get(indices)[0]).flatten(1).float()
        return {X: torch.cat([pixels, self.captions.get(indices)[0].float()], 1)}


class SeenThrough(Features):
    """`features` of a batch as `view` turns it from what the source holds (a latent space's means or images)."""

    def __init__(self, features: Features, view):
        self.features, self.view, self.name = features, view, features.name

    def __call__(self, x):
        return self.features(self.view(x))


def _save_ensemble_config(cfg: Config) -> None:
    """ENSEMBLE/config.yaml: the resolved config every member is trained from. An ensemble with other settings whose
    members have trained (a complete checkpoint) is refused, not overwritten; one whose members all failed before
    their first checkpoint takes the corrected config. The yardstick may be added later."""
    prepare_run_dir(cfg, holds="an ensemble", may_change=("ddm.monolith",), bound=trained_below(ensemble_dir(cfg)))


def _finished(run: Path, images: int) -> bool:
    ckpt = latest_checkpoint(run)
    return ckpt is not None and read_state(ckpt).progress["images"] >= images


def ensemble_training_flops(cfg: Config) -> float:
    """What the experts and the router cost to train together, from their flops.json."""
    experts = [run for k in range(cfg.ddm.k) for run in expert_runs(cfg, k)]
    return sum(training_flops(run) for run in [*experts, router_dir(cfg)])


def monolith_images(cfg: Config) -> int:
    """The monolith's run length at the trained ensemble's whole cost, router included: the members' FLOPs (from
    their flops.json) over the monolith's FLOPs per image. At compute parity the experts alone cost the config's
    train.images; the router buys the monolith a few percent more."""
    mono = monolith_config(cfg)
    info = describe_run(expert_runs(cfg, 0)[0])[1]
    shape, num_classes = info.shape, info.num_classes
    micro = mono.train.batch_size // mono.train.accumulate
    # a latent monolith encodes its images as the experts did
    encoder = FlopsRecord.read(expert_runs(cfg, 0)[0] / FlopsRecord.FILE).encoder_flops_per_image
    per_image = encoder + flops_per_image(mono.model, shape, num_classes, build_objective(mono), micro,
                                          checkpointing=mono.train.activation_checkpointing)
    return max(cfg.train.images, math.ceil(ensemble_training_flops(cfg) / per_image))


def train_members(cfg: Config, jobs: int = 1, progress: bool = True) -> None:
    """Experts (J at a time, each in its own process with its share of the cores), then the router, then (with
    ddm.monolith) the monolith at the ensemble's FLOPs; members already trained are skipped."""
    root, cores = ensemble_dir(cfg), os.cpu_count() or 1
    members = member_configs(cfg)
    experts = []
    for k in range(cfg.ddm.k):
        for r, run in enumerate(expert_runs(cfg, k)):  # in a cluster x range grid, each range is a member
            name, tstage = (f"expert{k}", ()) if not cfg.ddm.t_ranges else (f"expert{k}.{r}", (f"tstage={r}",))
            experts.append(Member(name, f"expert={k}", run, members[name].train.images, tstage))
    pending = [m for m in experts if not _finished(m.run_dir, m.images)]
    while pending:
        batch, pending = pending[:jobs], pending[jobs:]
        run_members(root, batch, max(1, cores // jobs), progress)
    router = Member("router", "router", router_dir(cfg), members["router"].train.images)
    if not _finished(router.run_dir, router.images):
        run_members(root, [router], cores, progress)
    if cfg.ddm.monolith:
        images = monolith_images(cfg)  # needs the members' measured FLOPs
        monolith = Member("monolith", "monolith", monolith_dir(cfg), images, (f"train.images={images}",))
        if not _finished(monolith.run_dir, images):
            if progress:
                print(f"the monolith: the same config as one model, {images} images (the ensemble's FLOPs)",
                      flush=True)
            run_members(root, [monolith], cores, progress)


def backdrop(source):
    """Vectors: the data's first 2000 examples (or all of a smaller set), drawn behind the samples; images: none."""
    return source.get(list(range(min(2000, len(source)))))[0] if len(source.shape) == 1 else None


def picture_name(routing: str) -> str:
    """A file name for a policy's sample grid: ancestral_then:topk:2@0.5 -> ancestral_then-topk-2-at-0.5."""
    return routing.replace(":", "-").replace("@", "-at-")


def sample_and_evaluate(cfg: Config, routing: str = DEFAULT_ROUTING, progress: bool = True) -> dict:
    """The ensemble's sample grid and its metrics against the whole data set (ENSEMBLE/metrics.json)."""
    root = ensemble_dir(cfg)
    # ancestral: each sample keeps one expert, drawn by its own stream from p(cluster | class) or the cluster sizes
    sampler = open_sampler(root, cfg.sample.model_dump(), routing=routing, seed=cfg.seed)  # `cfg`'s, not the folder's
    mixture = sampler.denoiser
    source = whole_data(cfg)
    evaluator = Evaluator(sampler.space.reference(source), cfg.eval, cfg.seed, progress)
    mixture.reset_counts()
    sampling = {}

    def counted(batches):
        yield from timed(batches, sampling)
        # before the metrics call the mixture themselves
        sampling["evaluations"], sampling["router"] = mixture.evaluations, mixture.router_evaluations

    request = condition_kind(cfg.model).evaluation_request(evaluator, cfg.eval.num)
    batches = generated(sampler, cfg.eval.num, progress, seed=cfg.seed, request=request)
    # the velocity error needs a field of (x, t); ancestral routing is one only along each sample's own path
    result = evaluator(counted(batches), None if mixture.routing.needs_assignment else mixture,
                       list(request.prompts) or None)
    result["seconds_per_sample"] = sampling["seconds"] / cfg.eval.num
    result["expert_evaluations_per_sample"] = sampling["evaluations"] / cfg.eval.num
    result["router_evaluations_per_sample"] = sampling["router"] / cfg.eval.num
    grid = next(generated(sampler, min(64, cfg.sample.num), seed=cfg.seed))[0]
    save_samples_picture(grid, root / "samples" / f"{picture_name(routing)}.png", backdrop(source),
                         f"ensemble, {routing} routing")
    # the manifest's hash names the members and their checkpoints
    subject = f"ensemble manifest={file_sha256(root / MANIFEST)[:16]} routing={routing}"
    return record(root / "metrics.json", entry_key(subject, evaluator, cfg.eval.num, sampler.opts), result)


def evaluate_ensemble(root: Path, routing: str = DEFAULT_ROUTING, options: dict | None = None,
                      feature_net: str | None = None, progress: bool = True) -> tuple[dict, Path]:
    """`islands eval ENSEMBLE`: the ensemble (trained here or imported) sampled under `routing` and evaluated as
    `islands ddm` evaluates it, its config's eval and sample keys replaced by `options` (dotted keys, None: the
    config's).
    The feature module its config names is imported only if the user names it too (the folder may come from
    elsewhere)."""
    overrides = [f"{key}={value}" for key, value in (options or {}).items() if value is not None]
    cfg = load_config(Path(root) / "config.yaml", [*overrides, f"run_dir={root}"])
    cfg = cfg.model_copy(update={"eval": trusted_features(cfg.eval, feature_net, Path(root) / "config.yaml",
                                                          "--feature-net ")})
    return sample_and_evaluate(cfg, routing, progress), Path(root) / "metrics.json"


def training_flops(run: Path) -> float:
    record = FlopsRecord.of(run)
    return float("nan") if record is None else record.training_flops


def compare_with_monolith(cfg: Config, ensemble: dict, progress: bool = True) -> dict:
    """The monolith evaluated exactly like the ensemble, a side-by-side grid and a table of both."""
    root, mono = ensemble_dir(cfg), monolith_config(cfg)
    sampler = open_run(Path(mono.run_dir), cfg.sample.model_dump())  # sampled as the ensemble was
    source = whole_data(cfg)
    clock, opts = {}, sampler.opts
    evaluator = Evaluator(sampler.space.reference(source), cfg.eval, cfg.seed, progress)
    monolith = evaluate_sampler(evaluator, sampler, cfg.eval.num, progress, seed=cfg.seed, clock=clock)
    monolith["seconds_per_sample"] = clock["seconds"] / cfg.eval.num
    monolith["expert_evaluations_per_sample"] = evaluations_per_sample(
        cfg.sample.solver, cfg.sample.steps, cfg.sample.guidance if condition_kind(cfg.model).field else 1.0)
    ensemble = {**ensemble, "training_flops": ensemble_training_flops(cfg)}
    monolith["training_flops"] = training_flops(Path(mono.run_dir))
    subject = f"monolith images={int(latest_checkpoint(Path(mono.run_dir)).name)}"
    record(root / "metrics.json", entry_key(subject, evaluator, cfg.eval.num, opts), monolith)
    num = min(64, cfg.sample.num)
    grids = {f"ensemble ({DEFAULT_ROUTING})": root / "samples" / f"{picture_name(DEFAULT_ROUTING)}.png"}
    mono_grid = next(generated(sampler, num, seed=cfg.seed))[0]
    grids["monolith"] = save_samples_picture(mono_grid, root / "samples" / "monolith.png", backdrop(source))
    save_side_by_side(grids, root / "comparison.png", "the experts and the router together cost what the monolith "
                      "costs; the same noise for both")
    names = [k for k, v in ensemble.items() if isinstance(v, (int, float)) and k in monolith]
    table = {name: {"ensemble": ensemble[name], "monolith": monolith[name]} for name in names}
    (root / "comparison.json").write_text(json.dumps(table, indent=1))
    return table


def format_comparison(table: dict) -> str:
    width = max(len(k) for k in table)
    lines = [f"{'':<{width}}  {'ensemble':>12}  {'monolith':>12}"]
    for name, row in table.items():
        lines.append(f"{name:<{width}}  {row['ensemble']:>12.5g}  {row['monolith']:>12.5g}")
    return "\n".join(lines)


def build_ensemble(cfg: Config, jobs: int = 1, progress: bool = True) -> dict:
    """Partition, (for captions) the condition router, experts, router (and the monolith with ddm.monolith), then the
    manifest; skips what is done."""
    member_configs(cfg)  # every member's config error, before anything is written or trained
    _save_ensemble_config(cfg)
    run_partition(cfg, progress)
    run_condition_router(cfg)
    train_members(cfg, jobs, progress)
    return write_manifest(cfg)


def run_condition_router(cfg: Config) -> Path | None:
    """ENSEMBLE/condition_router of a text-conditioned ensemble, p(cluster | text) from the partition and every
    caption's pooled embedding (once; None for any other condition)."""
    folder, kind = ensemble_dir(cfg) / ROUTER_FOLDER, condition_kind(cfg.model)
    if kind.field != CAPTION_EMBEDDING or (folder / ROUTER_REPORT).exists():
        return folder if kind.field == CAPTION_EMBEDDING else None
    made = Partition.load(partition_dir(cfg))
    captions = kind.source(cfg, partition_dir(cfg), whole_data(cfg))  # encoded once, or as stored
    width, n = cfg.model.text_pooled_width, len(captions)
    pooled = torch.cat([PooledCaptions(captions, width).get(range(lo, min(n, lo + 4096)))[0]
                        for lo in range(0, n, 4096)])
    router, report = fit_condition_router(pooled, torch.from_numpy(made.cluster), cfg.ddm.k, cfg.seed)
    return save_condition_router(router, ensemble_dir(cfg), report)


def run_ddm(cfg: Config, jobs: int = 1, progress: bool = True) -> dict:
    build_ensemble(cfg, jobs, progress)
    result = sample_and_evaluate(cfg, DEFAULT_ROUTING, progress)
    if cfg.ddm.monolith:
        table = compare_with_monolith(cfg, result, progress)
        print(format_comparison(table))
        print(f"pictures: {ensemble_dir(cfg) / 'comparison.png'}")
    elif progress:
        print(format_table(result))
    return result


SLURM_HEADER = """#!/bin/bash
#SBATCH --job-name=islands-{name}
#SBATCH --nodes=1
#SBATCH --gpus-per-node=${{GPUS:-8}}
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
"""


def emit_scripts(cfg: Config, kind: str) -> list[Path]:
    """One script per island (partition first, then any expert in any order or place, the router, the
    manifest); each island needs the data and the shared ENSEMBLE folder, nothing else. Every script trains
    from ENSEMBLE/config.yaml, written here, and takes ENSEMBLE and PYTHON from the environment where the
    folder or the interpreter lives elsewhere (slurm runs a copy of the script, so it cannot find itself)."""
    member_configs(cfg)
    _save_ensemble_config(cfg)
    root = ensemble_dir(cfg).resolve()
    out = root / "launch"
    out.mkdir(parents=True, exist_ok=True)
    prelude = (f'set -euo pipefail\nENSEMBLE="${{ENSEMBLE:-{root}}}"\n'
               f'PYTHON="${{PYTHON:-{sys.executable}}}"\n')
    launcher = ('"$PYTHON" -m torch.distributed.run --nproc_per_node=${NPROC:-1}' if kind == "torchrun" else
                'srun "$PYTHON" -m torch.distributed.run --nproc_per_node=${GPUS:-8}')
    config, run_dir = '"$ENSEMBLE/config.yaml"', 'run_dir="$ENSEMBLE"'
    steps = {"0_partition": f'"$PYTHON" -m islands partition {config} {run_dir} "$@"'}
    ranges = range(len(cfg.ddm.t_ranges) - 1) if cfg.ddm.t_ranges else [None]
    for k in range(cfg.ddm.k):
        for r in ranges:
            name, tstage = (f"expert{k}", "") if r is None else (f"expert{k}.{r}", f" tstage={r}")
            steps[f"1_{name}"] = f'{launcher} -m islands train {config} expert={k}{tstage} {run_dir} "$@"'
    steps["2_router"] = f'{launcher} -m islands train {config} router {run_dir} "$@"'
    steps["3_ensemble"] = f'"$PYTHON" -m islands ddm {config} {run_dir} "$@"'
    written = []
    for name, command in steps.items():
        path = out / f"{name}.sh"
        header = SLURM_HEADER.format(name=name) if kind == "slurm" else "#!/bin/bash\n"
        path.write_text(header + prelude + command + "\n")
        path.chmod(0o755)
        written.append(path)
    return written


def evaluate(target: Path, num: int | None = None, steps: int | None = None, metrics: list[str] | None = None,
             features: str | None = None, batch_size: int | None = None, run: Path | None = None,
             routing: str | None = None, feature_net: str | None = None, feature_weights: str | None = None,
             progress: bool = True) -> tuple[dict, Path]:
    """`islands eval` as a function: an ensemble directory sampled under `routing` and evaluated as `islands ddm`
    does, or a run directory or a samples.npz as `eval.evaluate.evaluate_target` evaluates it. -> (the metrics, the
    metrics.json they were added to)."""
    target = Path(target)
    if (target / MANIFEST).exists():
        options = {"eval.num": num, "eval.metrics": metrics and f"[{','.join(metrics)}]",
                   "eval.features": features or ("torch" if feature_net else None),
                   "eval.feature_weights": feature_weights, "sample.steps": steps, "sample.batch_size": batch_size}
        return evaluate_ensemble(target, routing or DEFAULT_ROUTING, options, feature_net, progress=progress)
    if routing:
        raise ConfigError(f"--routing: {target} is not an ensemble directory (no {MANIFEST})")
    return evaluate_target(target, num, steps, metrics, features, batch_size, run, progress=progress,
                           feature_net=feature_net, feature_weights=feature_weights)
