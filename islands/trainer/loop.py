"""The training loop: the composition root that builds a run's parts, resumes them, steps, and calls the reporters.

Progress is counted in images; rerunning the same command resumes. One optimizer step consumes one global batch
of `train.batch_size` images, split into `train.accumulate` micro-batches. Every example's noise, time, label
dropout and flip come from its position in the global stream, so an interrupted run continues exactly where it
stopped.
"""

import json
import math
import sys
from pathlib import Path

import torch

from islands.config import STRATEGIES, Config
from islands.data.loader import training_batches
from islands.data.order import build_order
from islands.errors import ConfigError, TrainingStopped, config_errors
from islands.parallel.launch import World, close_world, init_world
from islands.rundir import atomic_write_text, latest_checkpoint
from islands.train.flops import flops_per_image, write_flops
from islands.trainer.parts import Parts, build_parts, learning_rate
from islands.trainer.preemption import Preemption
from islands.trainer.ranges import tstage_config
from islands.trainer.reporters import Step, build_reporters, crossed


def train(cfg: Config, progress: bool = True, teacher=None, fall_back: bool = False) -> Path:
    """Train (or resume) the run that `cfg` describes and return its directory.

    Under torchrun every rank calls this; rank 0 alone writes files. A distilled student needs `teacher`:
    (cfg, device) -> the ensemble as a `Denoiser` (islands.ddm.ensemble.distillation_teacher). `fall_back`: resume
    from an earlier checkpoint when the latest holds a file changed since it was written (else the run stops).
    """
    world = init_world(cfg.parallel.timeout_s)
    progress = progress and world.is_main
    preemption = None
    try:
        if STRATEGIES[cfg.parallel.strategy].path is None:  # tstages: groups of ranks, each a run of its own
            cfg, world = range_of_this_rank(cfg, world)
        preemption = Preemption(world)  # SIGUSR1 (Slurm), SIGTERM (a spot instance): a checkpoint, then stop
        return _train(cfg, world, progress, teacher, fall_back, preemption)
    finally:
        if preemption is not None:
            preemption.close()
        close_world()


def range_of_this_rank(cfg: Config, world: World) -> tuple[Config, World]:
    """parallel.strategy=tstages: one group of ranks per range of flow.t_ranges, data parallel inside it and
    nothing between groups; this rank's range expert and group."""
    if cfg.flow.t_ranges is None:
        raise ConfigError("parallel.strategy: 'tstages' needs flow.t_ranges, the boundaries of the ranges")
    with config_errors("parallel"):
        index, group = world.split(len(cfg.flow.t_ranges) - 1)
    return tstage_config(cfg, index, {"strategy": "ddp" if group.distributed else "none"}), group


def _train(cfg: Config, world: World, progress: bool, teacher, fall_back: bool = False,
           preemption: Preemption | None = None) -> Path:
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    # Adam's second moments of rarely-used weights decay into denormal floats, which are ~100x slower on CPUs.
    torch.set_flush_denormal(True)
    parts = build_parts(cfg, world, teacher)
    parts.strategy.replicas.attach_optimizer(parts.opt)  # a synchronisation may reset its state
    state = parts.resume(fall_back)
    if state.images >= cfg.train.images:
        if progress:
            print(f"{parts.run_dir}: already trained on {state.images} images; nothing to do")
        return parts.run_dir

    batch, accumulate = cfg.train.batch_size, cfg.train.accumulate
    shares = parts.strategy.data.shares  # pipeline stages of one data row read the same share
    # replicas that differ step at some ticks only, each at its own rate (islands.data.schedule)
    schedule, replica, part, replica_ranks = parts.strategy.data.clock(batch)
    with config_errors("parallel"):  # a resume under another schedule must land on one of its ticks
        tick = schedule.tick_at(state.images)

    def batches_from(images: int):
        return training_batches(parts.source, parts.space, batch, cfg.seed, world.device, cfg.data.flip,
                                start=images, rank=replica, workers=cfg.data.workers, schedule=schedule, part=part,
                                parts=replica_ranks, own_order=cfg.data.shards is not None,
                                pin_memory=world.device.type == "cuda", condition=parts.condition_field,
                                order=build_order(parts.source, cfg.seed, cfg.data.order, cfg.data.block,
                                                  cfg.data.window))

    loader = batches_from(state.images)
    peak_lr = cfg.parallel.worker_lr[replica] if cfg.parallel.worker_lr else cfg.train.lr
    if world.is_main:
        micro = batch // (shares * accumulate)
        per_image = flops_per_image(cfg.model, parts.shape, parts.num_classes, parts.objective, micro, world.device,
                                    cfg.train.activation_checkpointing)
        write_flops(parts.run_dir, per_image, schedule.run_length(cfg.train.images),
                    parts.space.flops_per_image(tuple(parts.source.shape)))
    reporters = build_reporters(parts, state.images, schedule.run_length(cfg.train.images), progress)
    parts.net.train()
    try:
        while state.images < cfg.train.images:
            images = schedule.tick_images(tick)
            lr = learning_rate(peak_lr, cfg.train.warmup_images, images, state.images)
            stepped = schedule.active(tick, replica)
            if stepped:
                # This rank's share of the global batch, with the noise, times and label dropout the loader drew for
                # each example's stream position, in the network's space, in micro-batches (on a GPU copied from
                # pinned memory, unwaited).
                batch = next(loader)
                micro_batches = batch.chunk(accumulate)
                loss, grad_norm, finite = optimizer_step(parts, micro_batches, lr, state.images)
            else:  # a slower replica waits out the round; it still votes on whether the others' step was finite
                loss, grad_norm, finite = math.nan, math.nan, world.all_finite(True)

            # The clock moves on even for a skipped step: its images were consumed.
            before = state.images
            state.images += images
            state.step += 1
            tick += 1
            # The strategy may synchronise replicas here; the EMA takes in the model's weights, not a replica's.
            replicas = parts.strategy.replicas
            credit = replicas.after_step(state.images, state.images >= cfg.train.images)
            if replicas.joined not in (None, state.images):  # a replica that rejoined takes its peers' clock
                if world.is_main:
                    print(f"islands: rejoined the other replicas at image {replicas.joined} (from image "
                          f"{state.images}), with their weights", file=sys.stderr, flush=True)
                state.images, tick = replicas.joined, schedule.tick_at(replicas.joined)
                loader = batches_from(state.images)
            if finite:
                if parts.ema is not None and credit != 0:
                    parts.ema.update(parts.net, state.images, images if credit is None else credit,
                                     replicas.ema_weights())
                state.nonfinite_in_a_row = 0
            else:
                state.skipped += 1
                state.nonfinite_in_a_row += 1
                if state.nonfinite_in_a_row >= cfg.train.max_nonfinite:
                    raise TrainingStopped(
                        f"stopped after {state.nonfinite_in_a_row} steps in a row with non-finite loss or gradients "
                        f"(image {state.images}); last good checkpoint: {latest_checkpoint(parts.run_dir) or 'none'}")

            # Each reporter decides for itself whether it is due at this image count.
            step = Step(before, state, finite and stepped, loss, grad_norm,
                        sum(parts.strategy.ledger.close_step().values()), images, lr, state.images >= cfg.train.images)
            for reporter in reporters:
                reporter(step)
            if preemption is not None and not step.done and preemption.agreed():  # every rank stops after this step
                if not crossed(before, state.images, cfg.train.checkpoint_every):  # the checkpointer has not just
                    parts.save_checkpoint(state)
                    world.barrier()
                raise preemption.stop(state.images, latest_checkpoint(parts.run_dir))
    finally:
        for reporter in reporters:
            reporter.close()
        parts.strategy.replicas.close()
    if world.is_main and parts.strategy.communicates:
        atomic_write_text(parts.run_dir / "communication.json", json.dumps(parts.strategy.ledger.summary(), indent=1))
    # Leave together: rank 0 may still be drawing samples, and a peer tearing down its process group
    # meanwhile has been seen to abort ("terminate called without an active exception").
    world.barrier()
    return parts.run_dir


def optimizer_step(parts: Parts, micro_batches: list, lr: float, images: int = 0) -> tuple[float, float, bool]:
    """One optimizer step after `images` images, skipped on every rank if any saw a non-finite loss or gradient.
    -> (loss, gradient norm, whether it was taken)."""
    opt, scaler = parts.opt, parts.scaler
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss = parts.strategy.layout.forward_backward(parts.model, parts.objective, micro_batches, scaler)
    params = [p for p in parts.net.parameters() if p.requires_grad]
    parts.strategy.replicas.before_step(params, images)  # replicas in a warm start average their gradients
    scaler.unscale_(opt)
    grad_norm = parts.strategy.layout.clip_grad_norm(params, parts.cfg.train.grad_clip or math.inf)
    finite = parts.world.all_finite(bool(torch.isfinite(loss) and torch.isfinite(grad_norm)))
    if finite:
        scaler.step(opt)
    scaler.update()
    return (loss.item(), grad_norm.item(), True) if finite else (math.nan, math.nan, False)
