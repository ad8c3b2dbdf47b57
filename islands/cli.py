"""The command line: parse, load config, call one function. No logic of its own."""

import argparse
import contextlib
import os
import signal
import sys
import time
import typing
import warnings
from pathlib import Path

from islands.config import ConfigError, SampleConfig, load_config

EPILOG_TRAIN = """examples:
  islands train configs/mnist5k.yaml
  islands train configs/smoke.yaml train.images=20000 model.arch=unet run_dir=runs/try2
  islands train configs/gmm2d.yaml flow.t_ranges=[0,0.5,1] tstage=1   # one timestep-range expert
Rerunning the same command resumes from the last complete checkpoint."""


class EarlySignals:
    """Installed before the trainer's imports (seconds of them): a preemption signal (Slurm's SIGUSR1, a spot
    instance's SIGTERM) that comes while a rank starts up is remembered, for the trainer's `Preemption` to take over
    (islands/trainer/preemption.py), instead of killing a rank that has written nothing yet."""

    def __init__(self):
        self.received: tuple[int, float] | None = None
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self)

    def __call__(self, signum, frame) -> None:
        if self.received is None:
            self.received = (signum, time.monotonic())


def _train(args) -> int:
    EarlySignals()
    from islands.ddm.runs import config_for_roles, split_roles
    from islands.rundir import run_summary
    from islands.trainer import train

    roles, overrides = split_roles(args.overrides)
    cfg = config_for_roles(load_config(args.config, overrides), roles)
    run_dir = train(cfg, progress=not args.quiet, teacher=_teacher(cfg), fall_back=args.fall_back)
    if _speaks():
        print(run_summary(run_dir))
    return 0


def _speaks() -> bool:
    """Whether this process tells people about the run: one per run, the job's rank 0 (torchrun's RANK)."""
    return os.environ.get("RANK", "0") == "0"


def _sample(args) -> int:
    import torch

    from islands.conditions import SampleRequest
    from islands.ddm.sampling import sample_to_folder

    if args.threads:
        torch.set_num_threads(args.threads)
    options = {"steps": args.steps, "solver": args.solver, "grid": args.grid, "guidance": args.guidance,
               "batch_size": args.batch_size, "precision": args.precision}
    request = SampleRequest(class_label=args.class_label, prompts=tuple(_prompts(args)), images=args.condition_image)
    for line in sample_to_folder(Path(args.run_dir), Path(args.out), args.num, options, request,
                                 args.seed, args.routing, args.max_loaded, not args.no_ema,
                                 args.distributed, progress=not args.quiet, then=[Path(run) for run in args.then]):
        print(line)
    return 0


def _prompts(args) -> list[str]:
    """--prompt (repeatable) and the lines of --prompt-file, in that order; [] for none."""
    prompts = list(args.prompt or [])
    if any(not prompt.strip() for prompt in prompts):  # the null caption is what an unconditional sample draws
        raise ConfigError("--prompt: an empty prompt; to sample without a caption, leave --prompt out")
    if args.prompt_file:
        try:
            lines = Path(args.prompt_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"--prompt-file: cannot read {args.prompt_file}: {err}") from None
        prompts += [line.strip() for line in lines if line.strip()]
        if not prompts:
            raise ConfigError(f"--prompt-file: {args.prompt_file} holds no prompt")
    return prompts


def _partition(args) -> int:
    from islands.ddm.pipeline import run_partition
    from islands.ddm.runs import partition_dir

    cfg = load_config(args.config, args.overrides)
    made = run_partition(cfg, progress=not args.quiet)
    print(f"{made.k} clusters ({made.method}, {made.features_name}) of sizes {made.sizes}")
    print(f"wrote {partition_dir(cfg)} (partition.json, assignments.npz, clusters.png)")
    return 0


def _shard(args) -> int:
    manifest = _write_shards(args)
    if manifest is not None:
        print(f"wrote {args.out}: {manifest['examples']} examples in {len(manifest['shards'])} shards (manifest.json)")
    return 0


def _encode(args) -> int:
    if args.autoencoder is None and args.text_encoder is None:
        raise ConfigError("islands encode: give --autoencoder (latents), --text-encoder (caption embeddings) or both")
    manifest = _write_shards(args, autoencoder=args.autoencoder, text_encoder=args.text_encoder)
    if manifest is not None:
        what = " and ".join(w for w, given in (("the latents", args.autoencoder), ("the caption embeddings",
                                                                                  args.text_encoder)) if given)
        print(f"wrote {args.out}: {what} of {manifest['examples']} examples in {len(manifest['shards'])} shards "
              "(manifest.json)")
    return 0


def _write_shards(args, autoencoder: str | None = None, text_encoder: str | None = None) -> dict | None:
    from islands.data import storage
    from islands.data.write import write_data
    from islands.parallel.launch import close_world, init_world

    cfg = load_config(args.config, args.overrides)
    world = init_world()
    try:
        return write_data(cfg, storage.location(args.out), args.shard_size, autoencoder, text_encoder,
                          getattr(args, "text_tokens", 32), getattr(args, "batch_size", 64), world.rank, world.size,
                          world.barrier, world.device, progress=not args.quiet,
                          shuffle_seed=cfg.seed if args.order == "shuffled" else None)
    finally:
        close_world()


def _index(args) -> int:
    from islands.data import storage
    from islands.data.tar_index import index_tars
    from islands.parallel.launch import close_world, init_world

    world = init_world()
    try:
        tars = str(storage.location(args.tars))  # a file:// URL is its local path, as for OUT
        manifest = index_tars(tars, storage.location(args.out), args.caption_key, args.class_key, world.rank,
                              world.size, world.barrier, progress=not args.quiet)
    finally:
        close_world()
    if manifest is not None:
        print(f"wrote {args.out}: {manifest['examples']} examples of {len(manifest['shards'])} tars indexed where they "
              f"lie, {manifest['left_out_count']} left out (manifest.json)")
    return 0


def _verify(args) -> int:
    from islands.data import storage
    from islands.data.tar_index import verify
    from islands.errors import DataError

    examples, bad = verify(storage.location(args.data), progress=not args.quiet)
    for line in bad:
        print(line)
    if bad:
        raise DataError(f"{args.data}: {len(bad)} of {examples} examples are bad (listed above); the first: {bad[0]}")
    print(f"{args.data}: all {examples} examples good (every member's sha256 and every image checked)")
    return 0


def _ddm(args) -> int:
    from islands.ddm.pipeline import emit_scripts, run_ddm

    cfg = load_config(args.config, args.overrides)
    if args.emit:
        for path in emit_scripts(cfg, args.emit):
            print(f"wrote {path}")
        return 0
    run_ddm(cfg, args.jobs, progress=not args.quiet)
    print(f"ensemble: {cfg.run_dir} (ensemble.json, samples/, metrics.json)")
    return 0


def _teacher(cfg):
    """What a distilled student learns from: the ensemble, built here since training must not import it."""
    if cfg.train.objective != "distill":
        return None
    from islands.ddm.ensemble import distillation_teacher

    return distillation_teacher


def _distill(args) -> int:
    from islands.config import apply_overrides
    from islands.ddm.runs import distill_config
    from islands.eval.evaluate import trusted_features
    from islands.rundir import run_summary
    from islands.trainer import train

    # the folder given is the ensemble, wherever it was trained (islands may move it whole)
    overrides = [*args.overrides, f"run_dir={args.ensemble_dir}"]
    config_file = Path(args.ensemble_dir) / "config.yaml"
    cfg = distill_config(load_config(config_file, overrides), args.teacher)
    if cfg.eval.every:  # the student's evaluations would import a feature module: only one the user names
        named = apply_overrides({}, args.overrides).get("eval", {}).get("feature_net")
        trusted_features(cfg.eval, named, config_file, "eval.feature_net=")
    run_dir = train(cfg, progress=not args.quiet, teacher=_teacher(cfg))
    if _speaks():
        print(run_summary(run_dir))
    return 0


def _eval(args) -> int:
    import torch

    from islands.ddm.pipeline import evaluate
    from islands.eval.evaluate import format_table

    if args.threads:
        torch.set_num_threads(args.threads)
    result, out = evaluate(Path(args.target), args.num, args.steps, args.metrics, args.features, args.batch_size,
                           Path(args.run) if args.run else None, args.routing, args.feature_net, args.feature_weights,
                           progress=not args.quiet)
    print(format_table(result))
    print(f"wrote {out}")
    return 0


def _plan(args) -> int:
    from islands.plan.run import plan

    shape = None
    if args.shape:
        try:
            shape = tuple(int(s) for s in args.shape.split(","))
        except ValueError:
            raise ConfigError(f"--shape: {args.shape!r} is not sizes joined by commas, e.g. 4,32,32") from None
    try:
        every = tuple(int(h) for h in args.sync_every.split(","))
    except ValueError:
        raise ConfigError(f"--sync-every: {args.sync_every!r} is not whole numbers joined by commas") from None
    rows, data, picture = plan(load_config(args.config, args.overrides), args.network,
                               Path(args.out) if args.out else None, Path(args.config).stem, every, shape,
                               args.classes, args.ranks)
    print(rows)
    print(f"plan: {data} and {picture}")
    return 0


def _report(args) -> int:
    from islands.report import write_report

    page = write_report(Path(args.target), Path(args.out) if args.out else None)
    print(f"wrote {page} ({page.stat().st_size / 1e6:.1f} MB)")
    return 0


def _export(args) -> int:
    from islands.export import export

    print(f"wrote {export(Path(args.run_dir), Path(args.out))}")
    return 0


def _import(args) -> int:
    from islands.export import import_ensemble

    out = import_ensemble(Path(args.folder), Path(args.ensemble_dir), [Path(r) for r in args.expert or ()])
    print(f"wrote {out} (ensemble.json); sample it: islands sample {out}")
    return 0


def _ensemble_config_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config with a ddm section; its run_dir is the ensemble directory")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides of config keys")


def _choices(key: str) -> tuple[str, ...]:
    """The values a `sample` key accepts, read from its config field so the two never disagree."""
    return typing.get_args(SampleConfig.model_fields[key].annotation)


def _shard_arguments(p, what: str) -> None:
    """The arguments `islands shard` and `islands encode` share."""
    p.add_argument("config", help=f"a config whose data section names the {what}")
    p.add_argument("out", help="the shard folder to write (absent or empty), or a URL: s3://bucket/prefix, gs://..."
                   " (an empty prefix of a bucket that is there)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides of config keys")
    p.add_argument("--shard-size", type=int, default=4096, help="examples per shard (default 4096)")
    p.add_argument("--order", choices=("shuffled", "given"), default="shuffled",
                   help="the examples' order in the shards: shuffled by the config's seed (the default: a shard, and "
                        "a block of data.order=blocks, is then a random sample even of a source sorted by class) or "
                        "the source's own")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train or resume a model from a YAML config",
                       description="Train a model from a YAML config, or resume the run in its run_dir.",
                       epilog=EPILOG_TRAIN, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML file with sections data, model, flow, train, sample and keys run_dir, seed")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted overrides of config keys, e.g. train.images=20000 model.arch=dit")
    p.add_argument("--fall-back", action="store_true",
                   help="resume from the checkpoint before the latest when one of the latest's files was changed "
                        "since it was written (without it, such a change stops the run)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_train)


def _sample_parser(sub) -> None:
    from islands.ddm.mixture import DEFAULT_ROUTING, ROUTINGS

    p = sub.add_parser("sample", help="generate samples from a trained run",
                       description="Generate samples from a run's latest checkpoint (EMA weights when present). "
                                   "Writes OUT/samples.npz (array x, float32, in data space; y for class labels) "
                                   "and OUT/grid.png (images) or OUT/scatter.png (vectors).")
    p.add_argument("run_dir", help="a run directory written by 'islands train'")
    p.add_argument("--num", type=int, required=True, help="number of samples")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--steps", type=int, help="solver steps (default: the run's sample.steps)")
    p.add_argument("--solver", choices=_choices("solver"), help="ODE solver (default: sample.solver)")
    p.add_argument("--grid", choices=_choices("grid"), help="time grid (default: sample.grid)")
    p.add_argument("--guidance", type=float, help="classifier-free guidance scale; 1 = none (default: sample.guidance)")
    p.add_argument("--seed", type=int, help="noise seed; sample i depends only on (seed, i) (default: the run's seed)")
    p.add_argument("--class", dest="class_label", type=int, help="generate only this class (conditional models)")
    p.add_argument("--prompt", action="append", help="text-conditioned models: sample for this prompt (repeatable; "
                   "samples take the prompts in turn; OUT/prompts.txt says which)")
    p.add_argument("--prompt-file", help="text-conditioned models: a file of prompts, one a line")
    p.add_argument("--condition-image", help="image-conditioned models (super-resolution): an image, or a folder of "
                   "them; samples take them in turn")
    p.add_argument("--then", action="append", default=[], metavar="RUN", help="a cascade: the samples are the "
                   "condition images of RUN, an image-conditioned run, whose samples are written (repeatable)")
    p.add_argument("--batch-size", type=int, help="samples per batch; does not change the samples")
    p.add_argument("--precision", choices=_choices("precision"),
                   help="bf16: the networks under bf16 autocast, the solver in fp32; 1.4-1.5x faster on a CPU with "
                        "avx512_bf16; auto: bf16 if the run trained in bf16 and the CPU has it natively, else fp32 "
                        "(default: sample.precision)")
    p.add_argument("--threads", type=int, help="torch threads")
    p.add_argument("--no-ema", action="store_true", help="use the raw weights instead of the EMA")
    p.add_argument("--routing", help=f"ensembles only: {', '.join(ROUTINGS)} (default {DEFAULT_ROUTING}; "
                                     "oracle and threshold:P are older names of ancestral and nucleus:P)")
    p.add_argument("--max-loaded", type=int, help="ensembles only: keep at most this many experts in memory")
    p.add_argument("--distributed", action="store_true",
                   help="ensembles only, under torchrun: spread the experts over the ranks (each loads its own)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_sample)


def _eval_parser(sub) -> None:
    p = sub.add_parser("eval",
                       help="measure samples against the data (FD, KID, precision/recall, density/coverage, ...)",
                       description="Evaluate a run (generating --num samples from its latest checkpoint) or an "
                                   "existing samples.npz against the run's data. Adds the result to metrics.json "
                                   "beside the target and prints it.")
    p.add_argument("target", help="a run directory, an ensemble directory, or a samples.npz written by 'islands "
                                   "sample'")
    p.add_argument("--num", type=int, help="samples to generate for a run directory (default: eval.num)")
    p.add_argument("--steps", type=int, help="solver steps (default: the run's sample.steps)")
    p.add_argument("--metrics", nargs="+", metavar="METRIC",
                   help="fd kid precision_recall density_coverage, class_balance with classifier features; for "
                        "Gaussian-mixture data also nll swd mode_mass velocity_mse; for captioned images "
                        "prompt_following (default: all that apply)")
    p.add_argument("--features", choices=["classifier", "pixels", "torch", "contrastive"],
                   help="feature network (default: eval.features; for captioned images the prompt judge's image "
                        "tower, a classifier trained on the data for labelled ones, else pixels); torch: the network "
                        "--feature-net builds")
    p.add_argument("--feature-net", metavar="MODULE:FUNCTION",
                   help="torch features: the function that builds the network (implies --features torch). Named "
                        "here only: the module a run's config names is never imported, the run may come from "
                        "another island")
    p.add_argument("--feature-weights", metavar="FILE",
                   help="torch features: the network's weights, a safetensors file (default: eval.feature_weights)")
    p.add_argument("--run", help="the run whose data a samples.npz is compared with (default: the run above it)")
    p.add_argument("--routing", help="an ensemble directory's routing policy (default: ancestral)")
    p.add_argument("--batch-size", type=int, help="samples per batch; does not change the numbers")
    p.add_argument("--threads", type=int, help="torch threads")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_eval)


def _partition_parser(sub) -> None:
    p = sub.add_parser("partition", help="cluster the data for a decentralized model (ddm.k experts)",
                       description="Extract features, cluster the data in two stages (fine centroids, then ddm.k "
                                   "coarse clusters over them) and write RUN_DIR/partition (partition.json, "
                                   "assignments.npz, clusters.png).")
    _ensemble_config_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_partition)


def _shard_parser(sub) -> None:
    p = sub.add_parser("shard", help="write the config's data as webdataset tar shards, for data.source: shards",
                       description="Write the examples of the config's data section, whatever its source, into "
                                   "OUT/shard-NNNNNN.tar (webdataset layout) with an index per shard and "
                                   "OUT/manifest.json; a run reads them with data.source=shards data.path=OUT. Under "
                                   "torchrun each rank writes every W-th shard (OUT on a filesystem all ranks see, "
                                   "or a URL).")
    _shard_arguments(p, "examples")
    p.set_defaults(func=_shard)


def _encode_parser(sub) -> None:
    p = sub.add_parser("encode", help="precompute the latents (and caption embeddings) of the config's data into "
                       "shards",
                       description="Encode every example of the config's data section (and its horizontal flip where "
                                   "the data flips) with an AutoencoderKL folder, and write each posterior's mean and "
                                   "log-variance (float32) into shards as 'islands shard' does; a run trains on them "
                                   "with data.source=shards data.path=OUT data.autoencoder=FOLDER. With "
                                   "--text-encoder, each caption's embedding is stored beside its example, so that a "
                                   "text-conditioned run never runs the encoder. Under torchrun each rank encodes and "
                                   "writes every W-th shard.")
    _shard_arguments(p, "images")
    p.add_argument("--autoencoder", help="the AutoencoderKL folder (config.json + safetensors): store latents")
    p.add_argument("--text-encoder", help="minilm or a transformers folder: store each caption's embedding beside "
                   "its example, for a text-conditioned run (data.text_encoder the same)")
    p.add_argument("--text-tokens", type=int, default=32, help="tokens a caption keeps (model.text_tokens; 32)")
    p.add_argument("--batch-size", type=int, default=64, help="images encoded at a time (default 64)")
    p.set_defaults(func=_encode)


def _index_parser(sub) -> None:
    p = sub.add_parser("index", help="index webdataset tars where they lie, for data.source: shards",
                       description="Write an index per tar (each member's offset, size and sha256) and "
                                   "OUT/manifest.json for tars as img2dataset, webdataset's ShardWriter, GNU tar of a "
                                   "folder or 'islands shard' wrote them, copying no byte; a run reads them with "
                                   "data.source=shards data.path=OUT data.resolution=R. Examples without an image that "
                                   "decodes are left out and counted in the manifest. Under torchrun each rank indexes "
                                   "every W-th tar.")
    p.add_argument("tars", metavar="TARS", help="a folder of .tar files, a glob, or data-{000000..000099}.tar")
    p.add_argument("out", metavar="OUT", help="the index folder to write (absent or empty), or a URL: "
                   "s3://bucket/prefix, gs://...")
    p.add_argument("--caption-key", help="read captions from this key of each example's .json (default: its .txt)")
    p.add_argument("--class-key", help="read classes (integers) from this key of each example's .json (default: its "
                   ".cls)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_index)


def _verify_parser(sub) -> None:
    p = sub.add_parser("verify", help="read every example of a shard folder and check it",
                       description="Read every member of every example of DATA (a folder 'islands index' or 'islands "
                                   "shard' wrote), check it against its sha256 and decode its image: the whole pass a "
                                   "run never makes before its first step. Lists the bad examples; exit 2 if any.")
    p.add_argument("data", metavar="DATA", help="the folder, or its URL (s3://, gs://, http(s)://)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_verify)


def _ddm_parser(sub) -> None:
    p = sub.add_parser("ddm", help="partition, experts, router, samples and metrics of a decentralized model",
                       description="Run every step of a Decentralized Diffusion Model on this machine, skipping "
                                   "steps already complete (rerunning continues), or write launch scripts.")
    _ensemble_config_arguments(p)
    p.add_argument("--jobs", type=int, default=1, help="experts trained at once, the cores split between them")
    p.add_argument("--emit", choices=["torchrun", "slurm"],
                   help="write one launch script per island into RUN_DIR/launch instead of running")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_ddm)


def _distill_parser(sub) -> None:
    p = sub.add_parser("distill", help="distill an ensemble into one model",
                       description="Train one student on the whole data set to match, at every x_t, the expert "
                                   "of its image's own cluster (or the routed mixture). Writes ENSEMBLE_DIR/distilled.")
    p.add_argument("ensemble_dir", help="an ensemble directory written by 'islands ddm'")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted overrides of the ensemble config's keys, e.g. train.images=20000")
    p.add_argument("--teacher", choices=["cluster", "full"], default="cluster",
                   help="the expert of each image's cluster (the paper's recipe) or the full mixture")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_distill)


def _plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="predict the training time of a config for every strategy on a cluster",
                       description="Predict the wall time to train the config's images with ddp, zero1/2, fsdp, "
                                   "pipeline, local_sgd and diloco at several H, and decentralized experts, on a "
                                   "described cluster; prints a table, writes OUT.json and OUT.png.")
    p.add_argument("config", help="a training config")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides of config keys")
    p.add_argument("--network", required=True,
                   help="a preset (nvlink, infiniband, 10gbe, datacenters), a YAML file of islands, nodes_per_island, "
                        "gpus_per_node, gpu_tflops, mfu, overlap and the node/cluster/island links (gbit_s, "
                        "latency_us), or this-machine (measured: processes on this machine joined by gloo)")
    p.add_argument("--ranks", type=int, default=2, help="this-machine: processes (default 2)")
    p.add_argument("--shape", help="the data's shape, e.g. 4,32,32, instead of reading the data")
    p.add_argument("--classes", type=int, help="with --shape: the number of classes (default model.num_classes)")
    p.add_argument("--sync-every", default="10,50,100,200", help="the H of the local-update rows")
    p.add_argument("--out", help="path of the plan without suffix (default plans/CONFIG-NETWORK)")
    p.set_defaults(func=_plan)


def _report_parser(sub) -> None:
    p = sub.add_parser("report", help="one HTML page of what a run or an ensemble produced",
                       description="Write one self-contained HTML page (pictures inlined, no scripts, no requests) "
                                   "of what a run or ensemble folder holds: its description and config, sample "
                                   "grids, the partition, the routers' accuracy and calibration, loss and evaluation "
                                   "curves, every metrics.json entry, the communication ledger, the FLOP accounting "
                                   "and the comparison with the monolith, each where the folder has it.")
    p.add_argument("target", help="a run directory or an ensemble directory")
    p.add_argument("--out", help="the page to write (default TARGET/report.html); only a report written before is "
                                 "replaced")
    p.set_defaults(func=_report)


def _export_parser(sub) -> None:
    p = sub.add_parser("export", help="write a run or an ensemble as a folder diffusers loads without Islands",
                       description="Write the run's network with the latest checkpoint's EMA weights (a model.arch: "
                                   "diffusers network as its own class, Islands' U-Net or DiT as IslandsUNet or "
                                   "IslandsDiT with their code beside), the scheduler of its path, a model_index.json "
                                   "and islands_export.json (the run's config, the files' sha256); or an ensemble in "
                                   "the open DDM layout (expert_N/, router/, partition/, pipeline.py, ddm.json).")
    p.add_argument("run_dir", help="a run directory (model.arch diffusers, unet or dit), or an ensemble directory")
    p.add_argument("out", help="the folder to write; it must not exist or be empty")
    p.set_defaults(func=_export)


def _import_parser(sub) -> None:
    p = sub.add_parser("import", help="read an ensemble exported in the open DDM layout back as an ensemble directory",
                       description="Read FOLDER (expert_N/, router/, partition/, ddm.json, as 'islands export "
                                   "ENSEMBLE' writes it), every file checked against ddm.json's sha256, into "
                                   "ENSEMBLE_DIR, which islands sample, eval, report and distill take. --expert RUN "
                                   "joins a run trained here as one more expert on a cluster of its own data.")
    p.add_argument("folder", help="the exported ensemble (its ddm.json lists every file)")
    p.add_argument("ensemble_dir", help="the ensemble directory to write; it must not exist or be empty")
    p.add_argument("--expert", action="append", metavar="RUN", help="a run directory to join as a further expert "
                   "(repeatable); the routers trained for fewer clusters are set aside")
    p.set_defaults(func=_import)



# The subcommands in the order `islands --help` lists them; each adds its own parser.
COMMANDS = (
    _train_parser, _sample_parser, _eval_parser, _partition_parser, _shard_parser, _encode_parser, _index_parser,
    _verify_parser, _ddm_parser, _distill_parser, _plan_parser, _report_parser, _export_parser, _import_parser,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="islands", description="Train and sample diffusion / flow-matching models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


# Options that count something and must be at least 1, checked before anything runs (argparse's own refusal would
# print its usage on a second line).
COUNTS = ("num", "steps", "batch_size", "max_loaded", "threads", "jobs", "ranks", "shard_size")


def _check_counts(args) -> None:
    for name in COUNTS:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')}: {value} must be at least 1")


@contextlib.contextmanager
def warnings_as_lines():
    """Islands' warnings as one line a person reads (`islands: warning: ...`), not Python's report of a source file
    and line; only the command line does this, so library callers keep the warnings machinery."""
    from islands.errors import IslandsWarning

    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, IslandsWarning):
            print(f"islands: warning: {message}", file=sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from islands.errors import CheckpointError, DataError, MemberFailed, TrainingStopped

    try:
        with warnings_as_lines():
            _check_counts(args)
            return args.func(args)
    except ConfigError as err:
        print(f"islands: config error: {err}", file=sys.stderr)
        return 2
    except (DataError, CheckpointError) as err:
        # Raised in a loader worker, the message carries the worker's traceback: keep its last line.
        message = str(err).strip().splitlines()[-1].split("DataError: ")[-1]
        print(f"islands: {message}", file=sys.stderr)
        return 2
    except (TrainingStopped, MemberFailed) as err:
        print(f"islands: {err}", file=sys.stderr)
        return getattr(err, "exit_status", 1)  # a preempted run's (75) asks to be run again
    except KeyboardInterrupt:
        print("islands: interrupted; rerun the same command to resume from the last checkpoint", file=sys.stderr)
        return 130
