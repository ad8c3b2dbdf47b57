"""The one training loop. Progress is counted in images; rerunning the same command resumes.

One optimizer step consumes one global batch of `train.batch_size` images, split into
`train.accumulate` micro-batches. Every example's noise, time, label dropout and flip come from its
position in the global stream, so an interrupted run continues exactly where it stopped.
"""

import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

from islands.config import Config, ConfigError, to_dict, trajectory_changes
from islands.data import ClusterLabelled, build_data, streams
from islands.data.clusters import read_prior_table
from islands.data.loader import stream_loader
from islands.data.posterior import EXACT_POSTERIOR_LIMIT, exact_cluster_posterior
from islands.eval.evaluate import Evaluator, generated
from islands.flow.denoiser import NetworkDenoiser
from islands.flow.objectives import training_loss
from islands.flow.paths import build_path
from islands.flow.timesteps import TimeSampler
from islands.generate import generate, network_with_weights, sample_labels
from islands.images import save_curve, save_samples_picture
from islands.nets import build_network
from islands.parallel.launch import World, close_world, init_world
from islands.parallel.strategies import build_strategy
from islands.train.activation_checkpointing import checkpoint_blocks
from islands.train.checkpoint import (
    adam_state,
    latest_checkpoint,
    read_sharded,
    read_state,
    read_trainer,
    write_checkpoint,
)
from islands.train.ema import EMA
from islands.train.flops import flops_per_image, write_flops
from islands.train.logbook import Logbook
from islands.train.router import DistillObjective, RouterObjective


class TrainingStopped(RuntimeError):
    """The run cannot go on (e.g. too many non-finite steps in a row); the last checkpoint is intact."""


@dataclass
class Progress:
    images: int = 0  # training images consumed so far: the run's clock
    step: int = 0  # optimizer steps attempted, skipped ones included
    skipped: int = 0  # steps skipped because the loss or gradients were not finite
    nonfinite_in_a_row: int = 0


class DiffusionObjective:
    """Per-sample diffusion loss with all randomness drawn from the examples' stream positions."""

    def __init__(self, cfg: Config, num_classes: int):
        self.path = build_path(cfg.flow.path, **cfg.flow.path_options())
        self.prediction = cfg.flow.prediction
        steps = cfg.flow.train_steps if cfg.flow.path == "vp_discrete" else None  # DDPM trains on integer steps
        self.times = TimeSampler(cfg.flow.time_sampler, *cfg.flow.t_range, cfg.flow.logit_mean, cfg.flow.logit_std,
                                 steps)
        self.seed, self.num_classes, self.label_dropout = cfg.seed, num_classes, cfg.train.label_dropout

    def __call__(self, net, x0: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        pos = positions.tolist()
        noise = streams.normal(self.seed, pos, tuple(x0.shape[1:])).to(x0)
        tau = self.times(streams.uniform(self.seed, pos, "time")).to(x0)
        cond = None
        if self.num_classes:
            drop = (streams.uniform(self.seed, pos, "label_drop") < self.label_dropout).to(x0.device)
            cond = torch.where(drop, torch.full_like(labels, self.num_classes), labels)
        return training_loss(net, self.path, self.prediction, x0, noise, tau, cond)

    @torch.no_grad()
    def validation_loss(self, net, x0: torch.Tensor, labels: torch.Tensor | None, times: int) -> list[float]:
        """Mean loss at each of `times` stratified times, on fixed examples with fixed noise and no label
        dropout: the same probe at every evaluation, so its changes are the model's, not the draw's."""
        noise = streams.normal(self.seed, list(range(len(x0))), tuple(x0.shape[1:]), "validation").to(x0)
        losses = []
        for stratum in self.times.strata(times):
            tau = torch.full((len(x0),), stratum).to(x0)
            losses.append(training_loss(net, self.path, self.prediction, x0, noise, tau, labels).mean().item())
        return losses


def learning_rate(cfg: Config, images: int) -> float:
    """Linear warm-up over `train.warmup_images`, then constant."""
    if cfg.train.warmup_images == 0:
        return cfg.train.lr
    return cfg.train.lr * min(1.0, (images + cfg.train.batch_size) / cfg.train.warmup_images)


def crossed(before: int, after: int, every: int) -> bool:
    return every > 0 and after // every > before // every


def prepare_run_dir(cfg: Config, write: bool = True, holds: str = "a run", may_change: tuple[str, ...] = ()) -> Path:
    """Create the run directory, or check that the one there holds this same run (every rank checks); keys in
    `may_change` may differ too. Then write the resolved config."""
    run_dir = Path(cfg.run_dir)
    resolved = to_dict(cfg)
    config_file = run_dir / "config.yaml"
    if config_file.exists():
        changes = [c for c in trajectory_changes(yaml.safe_load(config_file.read_text()), resolved)
                   if c.split(":")[0] not in may_change]
        if changes:
            raise ConfigError(f"{run_dir} holds {holds} with another config ({changes[0]}); use a new run_dir")
    if not write:
        return run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / ".config.yaml.tmp"
    tmp.write_text(yaml.safe_dump(resolved, sort_keys=False))
    tmp.replace(config_file)
    return run_dir


def autocast(cfg: Config, device: torch.device):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def train(cfg: Config, progress: bool = True, teacher=None) -> Path:
    """Train (or resume) the run that `cfg` describes and return its directory.

    Under torchrun every rank calls this; rank 0 alone writes files. A distilled student needs `teacher`:
    (cfg, device) -> the ensemble as a `Denoiser` (islands.ddm.ensemble.distillation_teacher).
    """
    world = init_world(cfg.parallel.timeout_s)
    try:
        return _train(cfg, world, progress and world.is_main, teacher)
    finally:
        close_world()


def _train(cfg: Config, world: World, progress: bool, teacher=None) -> Path:
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    # Adam's second moments of rarely-used weights decay into denormal floats, which are ~100x slower on CPUs.
    torch.set_flush_denormal(True)
    if cfg.train.batch_size % (world.size * cfg.train.accumulate):
        raise ConfigError(f"train.batch_size: {cfg.train.batch_size} is not divisible by "
                          f"{world.size} ranks x accumulate={cfg.train.accumulate}")
    strategy = build_strategy(cfg.parallel.strategy, world, cfg.parallel.compression, cfg.train.precision,
                              cfg.train.compile)
    device, main = world.device, world.is_main
    run_dir = prepare_run_dir(cfg, write=main)
    strategy.barrier()
    torch.manual_seed(cfg.seed)  # initial weights, the same on every rank; later randomness is keyed per example

    source = build_data(cfg.data, cfg.seed)  # a corrupt file is reported, by name, when a batch reaches it
    shape, num_classes = tuple(source.shape), cfg.model.num_classes
    if num_classes and num_classes != source.num_classes:
        raise ConfigError(f"model.num_classes: {num_classes} does not match the data's {source.num_classes} classes")
    if main:
        (run_dir / "model.json").write_text(json.dumps({"shape": list(shape), "num_classes": num_classes}))

    net = build_network(cfg.model, shape, num_classes).to(device)
    if cfg.train.objective == "router":  # its logits are anchored at the partition's p(cluster | class)
        net.anchor.set_prior(read_prior_table(cfg.data.partition, num_classes))
    if cfg.train.activation_checkpointing:
        checkpoint_blocks(net)
    model = strategy.wrap(net)  # what the loop calls; `net` is the module whose parameters are optimized
    opt = strategy.optimizer(net, lr=cfg.train.lr, betas=cfg.train.betas, weight_decay=cfg.train.weight_decay)
    ema = EMA(net, cfg.train.ema_halflife_images, cfg.train.ema_rampup) if cfg.train.ema_halflife_images else None
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10, enabled=cfg.train.precision == "fp16")
    diffusion = cfg.train.objective != "router"  # a denoiser comes out: sample it, evaluate it
    if cfg.train.objective == "diffusion":
        objective = DiffusionObjective(cfg, num_classes)
    elif cfg.train.objective == "router":
        objective = RouterObjective(cfg.seed, cfg.model.outputs, num_classes, cfg.train.label_dropout)
    else:
        if teacher is None:  # the ensemble belongs to an outer layer, which builds it (islands.cli)
            raise ConfigError("train.objective: 'distill' needs its teacher, the ensemble; run 'islands distill' or "
                              "'islands train' on the student's config")
        objective = DistillObjective(cfg, num_classes, teacher(cfg, device), source.num_clusters)

    def sharded_state() -> dict:
        """What each rank holds: its shards under FSDP, its optimizer partition under ZeRO-1."""
        held = {"model": net.state_dict(), "optim": adam_state(strategy.local_optimizer(opt), net)}
        if ema is not None:
            held["ema"] = ema.state_dict()
        return held

    state = Progress()
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None:
        held = sharded_state()
        read_sharded(ckpt, held)  # in place, resharded to this run's layout and world size
        net.load_state_dict(held["model"])
        trainer = read_trainer(ckpt)
        scaler.load_state_dict(trainer["scaler"])
        torch.set_rng_state(trainer["rng"])
        state = Progress(**read_state(ckpt)["progress"])
    if state.images >= cfg.train.images:
        if progress:
            print(f"{run_dir}: already trained on {state.images} images; nothing to do")
        return run_dir

    def save_checkpoint() -> Path:
        exports = {"model.safetensors": strategy.full_state_dict(net.state_dict())}
        if ema is not None:
            exports["ema.safetensors"] = strategy.full_state_dict(ema.state_dict())
        trainer = {"scaler": scaler.state_dict(), "rng": torch.get_rng_state()}
        return write_checkpoint(run_dir, state.images, sharded_state(), exports, trainer, {"progress": asdict(state)},
                                cfg.train.keep_checkpoints, main, strategy.barrier)

    def plain_copy() -> torch.nn.Module | None:
        """The averaged (else the raw) weights in a plain network on rank 0; every rank takes part in
        gathering them, and the others get None."""
        weights = strategy.full_state_dict((ema if ema is not None else net).state_dict())
        return network_with_weights(cfg.model, shape, num_classes, weights, device) if main else None

    def save_samples() -> None:
        if not diffusion:
            return save_router_accuracy()
        plain = plain_copy()
        if not main:
            return
        sampler = NetworkDenoiser(plain, objective.path, objective.prediction)
        num = min(cfg.sample.num, 64 if len(shape) == 3 else 2000)  # a legible grid, or a dense scatter
        labels = sample_labels(num, num_classes)
        x = generate(sampler, shape, num, cfg.sample, cfg.seed, labels, device=device)
        reference = source.get(list(range(min(len(source), 2000))))[0] if len(shape) == 1 else None
        save_samples_picture(x, run_dir / "samples" / f"{state.images:012d}.png", reference, f"{state.images} images")

    evaluator, probe = None, None

    def fixed_probe(size: int):
        """A fixed random subset of the data (some sources are sorted by class)."""
        order = torch.randperm(len(source), generator=streams.generator(cfg.seed, 0, "validation"))
        return source.get(order[:size].tolist())

    exact_posterior = None

    def save_router_accuracy() -> None:
        nonlocal exact_posterior
        plain = plain_copy()
        if not main:
            return
        x0, labels = fixed_probe(min(len(source), 2000))
        if exact_posterior is None and len(source) * math.prod(shape) <= EXACT_POSTERIOR_LIMIT:
            exact_posterior = exact_cluster_posterior(source, cfg.model.outputs, num_classes)
        report = {"images": state.images, **objective.report_by_t(plain, x0.to(device), labels.to(device),
                                                                  exact_posterior)}
        (run_dir / "router_accuracy.json").write_text(json.dumps(report, indent=1))
        curves = {"top-1 accuracy": report["accuracy"]}
        if "tv" in report:
            curves.update({"exact posterior's accuracy": report["exact_accuracy"], "TV to exact": report["tv"]})
        save_curve(report["t"], curves, run_dir / "router_accuracy.png", "t (0 data, 1 noise)", "",
                   f"router after {state.images} images; largest cluster {report['majority_cluster_share']:.2f}")

    def evaluate() -> None:
        nonlocal evaluator, probe
        plain = plain_copy()
        if not main:
            return
        record = {"images": state.images}
        if cfg.eval.val_size and isinstance(objective, DiffusionObjective):  # a distilled student has no data loss
            if probe is None:
                probe = fixed_probe(cfg.eval.val_size)
            x0, labels = probe
            by_t = objective.validation_loss(plain, x0.to(device), labels.to(device) if num_classes else None,
                                             cfg.eval.val_times)
            record.update(val_loss=sum(by_t) / len(by_t), val_loss_by_t=by_t)
        if cfg.eval.metrics != []:
            # a router or student sees every example through its partition; it is judged on the data itself
            whole = source.source if isinstance(source, ClusterLabelled) else source
            evaluator = evaluator or Evaluator(whole, cfg.eval, cfg.seed)
            denoiser = NetworkDenoiser(plain, objective.path, objective.prediction)
            batches = generated(denoiser, shape, cfg.eval.num, cfg.sample, cfg.seed, num_classes)
            record.update({k: v for k, v in evaluator(batches, denoiser).items() if isinstance(v, (int, float))})
        eval_log.write(record)

    loader = iter(stream_loader(source, cfg.train.batch_size, cfg.seed, start=state.images, rank=world.rank,
                                world=world.size, workers=cfg.data.workers, flip=cfg.data.flip))
    logbook = Logbook(run_dir) if main else None
    eval_log = Logbook(run_dir, "eval") if main and cfg.eval.every else None
    run_length = math.ceil(cfg.train.images / cfg.train.batch_size) * cfg.train.batch_size  # whole batches
    bar = tqdm(total=run_length, initial=state.images, unit="img", disable=not progress, dynamic_ncols=True)
    params = [p for p in net.parameters() if p.requires_grad]
    window = new_window()
    batch = cfg.train.batch_size
    if main:
        micro = batch // (world.size * cfg.train.accumulate)
        write_flops(run_dir, flops_per_image(cfg, shape, num_classes, objective, micro, device), run_length)
    net.train()
    try:
        while state.images < cfg.train.images:
            x, labels, positions = next(loader)
            x, labels = x.to(device, non_blocking=True), labels.to(device)
            for group in opt.param_groups:
                group["lr"] = learning_rate(cfg, state.images)

            opt.zero_grad(set_to_none=True)
            loss_sum = torch.zeros((), device=device)
            micro = list(zip(x.chunk(cfg.train.accumulate), labels.chunk(cfg.train.accumulate),
                             positions.chunk(cfg.train.accumulate)))
            for i, (xs, ys, ps) in enumerate(micro):
                # Gradients are synchronised once per optimizer step, on the last micro-batch.
                sync = contextlib.nullcontext() if i == len(micro) - 1 else strategy.no_sync(model)
                with sync:
                    with autocast(cfg, device):
                        loss = objective(model, xs, ys, ps).mean()
                    scaler.scale(loss / cfg.train.accumulate).backward()
                loss_sum += loss.detach() / cfg.train.accumulate
            scaler.unscale_(opt)
            grad_norm = strategy.clip_grad_norm(params, cfg.train.grad_clip or math.inf)
            before = state.images
            state.images += batch
            state.step += 1
            if strategy.all_finite(bool(torch.isfinite(loss_sum) and torch.isfinite(grad_norm))):
                scaler.step(opt)
                scaler.update()
                if ema is not None:
                    ema.update(net, state.images, batch)
                state.nonfinite_in_a_row = 0
                window["loss"] += loss_sum.item()
                window["grad_norm"] += grad_norm.item()
                window["steps"] += 1
            else:
                scaler.update()
                state.skipped += 1
                state.nonfinite_in_a_row += 1
                if state.nonfinite_in_a_row >= cfg.train.max_nonfinite:
                    last = latest_checkpoint(run_dir)
                    raise TrainingStopped(
                        f"stopped after {state.nonfinite_in_a_row} steps in a row with non-finite loss or gradients "
                        f"(image {state.images}); last good checkpoint: {last or 'none'}")
            window["comm_bytes"] += sum(strategy.ledger.close_step().values())  # the optimizer's traffic included
            window["images"] += batch
            window["steps_all"] += 1
            bar.update(batch)

            done = state.images >= cfg.train.images
            if crossed(before, state.images, cfg.train.log_every) or done:
                seconds = time.perf_counter() - window["start"]
                steps = max(window["steps"], 1)
                comm_per_step = window["comm_bytes"] / max(window["steps_all"], 1)
                loss_mean, comm_per_step = strategy.mean([window["loss"] / steps, comm_per_step])
                record = {"images": state.images, "step": state.step, "loss": loss_mean,
                          "grad_norm": window["grad_norm"] / steps, "lr": opt.param_groups[0]["lr"],
                          "images_per_s": window["images"] / seconds, "skipped": state.skipped}
                if world.distributed:
                    record["comm_bytes_per_step_per_rank"] = comm_per_step
                if main:
                    logbook.write(record)
                    bar.set_postfix(loss=f"{record['loss']:.4f}", img_s=f"{record['images_per_s']:.0f}")
                window = new_window()
            if crossed(before, state.images, cfg.train.checkpoint_every) or done:
                save_checkpoint()
                strategy.check_consistency(net)
                strategy.barrier()
            if crossed(before, state.images, cfg.train.sample_every) or done:
                save_samples()
            if diffusion and cfg.eval.every and (crossed(before, state.images, cfg.eval.every) or done):
                evaluate()
    finally:
        bar.close()
        for log in (logbook, eval_log):
            if log is not None:
                log.close()
    if main and world.distributed:
        summary = strategy.ledger.summary()
        (run_dir / "communication.json").write_text(json.dumps(summary, indent=1))
    # Leave together: rank 0 may still be drawing samples, and a peer tearing down its process group
    # meanwhile has been seen to abort ("terminate called without an active exception").
    strategy.barrier()
    return run_dir


def new_window() -> dict:
    """Sums over the steps since the last log line."""
    return {"loss": 0.0, "grad_norm": 0.0, "steps": 0, "steps_all": 0, "images": 0, "comm_bytes": 0.0,
            "start": time.perf_counter()}


def run_summary(run_dir: Path) -> str:
    """Where a finished run put things, for people."""
    run_dir = Path(run_dir)
    ckpt = latest_checkpoint(run_dir)
    grids = sorted((run_dir / "samples").glob("*.png"))
    lines = [f"run directory:   {run_dir}",
             f"checkpoint:      {ckpt}",
             f"samples:         {grids[-1] if grids else 'none'}",
             f"metrics:         {run_dir / 'metrics.jsonl'}",
             f"tensorboard:     tensorboard --logdir {run_dir / 'tensorboard'}"]
    return "\n".join(lines)
