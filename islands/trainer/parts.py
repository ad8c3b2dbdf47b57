"""The parts of a run, built from its config: strategy, data, network, wrapped model, optimizer, EMA, loss scaler
and objective; resumed from the run directory's latest checkpoint; written into a new one."""

import json
import pickle
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from islands.conditions import condition_kind, network_spec
from islands.config import Config
from islands.data import ClusterSubset, build_data, data_name
from islands.data.captions import record_text_encoder
from islands.data.clusters import read_clusters
from islands.data.latents import open_data_space, record_data_space
from islands.data.sources import LABEL, Source
from islands.data.space import PIXELS, DataSpace
from islands.errors import CheckpointError, ConfigError, DataError, IslandsWarning, TamperedCheckpoint, config_errors
from islands.generate import network_with_weights
from islands.nets import build_network
from islands.nets.dit import DiT, interpolated_pos_embed
from islands.parallel.build import build_strategy
from islands.parallel.launch import World, warn_if_bf16_is_slow
from islands.parallel.strategies import Strategy
from islands.rundir import (
    SHARDED,
    atomic_write_text,
    checkpoint_weights,
    is_shard,
    latest_checkpoint,
    list_checkpoints,
    prepare_run_dir,
    read_state,
    read_trainer,
    verified,
    write_config,
    write_model_description,
)
from islands.train.checkpoint import adam_state, read_sharded, write_checkpoint
from islands.train.ema import EMA
from islands.train.objectives import Objective, build_objective

PRETRAINED = "pretrained.json"  # RUN/pretrained.json: the diffusers folder a run started from and its weights' sha256


@dataclass
class Progress:
    images: int = 0  # training images consumed so far: the run's clock
    step: int = 0  # optimizer steps attempted, skipped ones included
    skipped: int = 0  # steps skipped because the loss or gradients were not finite
    nonfinite_in_a_row: int = 0


@dataclass
class Parts:
    cfg: Config
    world: World
    strategy: Strategy
    run_dir: Path
    source: Source
    shape: tuple
    num_classes: int
    net: torch.nn.Module  # the module whose parameters are optimized
    model: torch.nn.Module  # what the step calls: `net` wrapped by the strategy
    opt: torch.optim.Optimizer
    ema: EMA | None
    scaler: torch.amp.GradScaler
    objective: Objective
    space: DataSpace = PIXELS  # between the data and the objective, and the samples and what people see

    @property
    def main(self) -> bool:
        return self.world.is_main

    @property
    def condition_field(self) -> str:
        """The field of an example the network is conditioned on (its kind's; an unconditional run's batches carry
        the label, which no network reads)."""
        return condition_kind(self.cfg.model).field or LABEL

    def held_state(self) -> dict:
        """What each rank holds: its shards under FSDP, its optimizer partition under ZeRO-1, its stages' under a
        pipeline."""
        held = {"model": self.net.state_dict(), "optim": adam_state(self.strategy.checkpoint.local_optimizer(self.opt),
                                                                    self.net)}
        if self.ema is not None:
            held["ema"] = self.ema.state_dict()
        return held

    def sharded_state(self, held: dict | None = None) -> dict:
        """The held state as the strategy lays it out in the checkpoint (a replica's under its own name)."""
        return self.strategy.checkpoint.arrange(held or self.held_state())

    def resume(self, fall_back: bool = False) -> Progress:
        """Load the latest complete checkpoint that can be read, in place (resharded to this run's layout and world
        size). One that cannot (a file cut short under its marker) is passed over, with one warning, for the one
        before it, which fills every tensor again; every rank takes the same one. A file of the right size whose
        sha256 is not the recorded one was changed on purpose: that stops the run, so that an attack cannot quietly
        roll it back, unless `fall_back` (islands train --fall-back). A run none of whose checkpoints can be read is
        refused rather than begun again."""
        found = list_checkpoints(self.run_dir)
        reasons = []
        for ckpt in reversed(found):
            loaded = self._load(ckpt)
            if isinstance(loaded, str):
                if loaded.startswith(TamperedCheckpoint.__name__) and not fall_back:
                    raise TamperedCheckpoint(f"{loaded.split(': ', 1)[1]}; resume stopped (islands train ... "
                                             "--fall-back resumes from the checkpoint before it)")
                reasons.append(loaded)
                continue
            if reasons and self.main:
                warnings.warn(f"checkpoint {found[-1]} cannot be read ({reasons[0]}); resumed from {ckpt}, the latest "
                              "that can be", IslandsWarning, stacklevel=2)
            return loaded
        if found:
            raise CheckpointError(f"no checkpoint of {self.run_dir} can be read (the latest, {found[-1]}: "
                                  f"{reasons[0]}); move checkpoints/ aside to train from the start")
        return Progress()

    def _load(self, ckpt: Path) -> Progress | str:
        """The checkpoint's state in the parts and its progress, or why it cannot be read: the same on every rank."""
        small = {}

        def read_small():  # every rank reads them, and must know before the collective read whether all could
            state = read_state(ckpt)
            # the files this rank reads, checked before: rank 0 those it wrote itself, every rank the trainer's state
            # and DCP's metadata; each rank's shards are checked by the ranks that read them (read_sharded)
            for name in state.files if self.main else ("trainer.pt", f"{SHARDED}/.metadata"):
                if not is_shard(name):
                    verified(ckpt, name, state)
            small.update(trainer=read_trainer(ckpt), progress=Progress(**state.progress), state=state)

        held = self.held_state()
        why = agreed(self.world, read_small)
        changed = TamperedCheckpoint.__name__
        if not self.world.all_finite(not (why or "").startswith(changed)):  # every rank stops, or none
            return why if (why or "").startswith(changed) else f"{changed}: {ckpt}: another rank found a file changed"
        why = why or agreed(self.world, lambda: read_sharded(ckpt, self.sharded_state(held), self.world.group,
                                                             small["state"]))
        if why:
            return why
        self.strategy.checkpoint.resumed()
        self.net.load_state_dict(held["model"])
        self.scaler.load_state_dict(small["trainer"]["scaler"])
        if "ledger" in small["trainer"]:  # absent from checkpoints of older Islands: counted from this start
            self.strategy.ledger.load_state_dict(small["trainer"]["ledger"])
        set_rng_state(small["trainer"], self.world.device)
        return small["progress"]

    def save_checkpoint(self, progress: Progress) -> Path:
        """Every rank writes its shards; rank 0 the whole weights (and EMA), the trainer's state and the counters."""
        gather = self.strategy.layout.full_state_dict  # a collective under sharding
        exports = {"model.safetensors": gather(self.net.state_dict())}
        if self.ema is not None:
            exports["ema.safetensors"] = gather(self.ema.state_dict())
        trainer = {"scaler": self.scaler.state_dict(), "ledger": self.strategy.ledger.state_dict(),
                   **rng_state(self.world.device)}
        return write_checkpoint(self.run_dir, progress.images, self.sharded_state(), exports, trainer,
                                {"progress": asdict(progress)}, self.cfg.train.keep_checkpoints, self.main,
                                self.world.barrier, self.world.group)

    def plain_copy(self) -> torch.nn.Module | None:
        """The averaged (else the raw) weights in a plain network on rank 0; every rank takes part in gathering
        them, and the others get None."""
        weights = self.strategy.layout.full_state_dict((self.ema if self.ema is not None else self.net).state_dict())
        if not self.main:
            return None
        return network_with_weights(network_spec(self.cfg.model, self.shape, self.num_classes), weights,
                                    self.world.device)


def rng_state(device: torch.device) -> dict:
    """The global generators a step draws from (dropout): the CPU's, and on a GPU the device's own, which dropout on
    CUDA tensors uses; without it a resumed GPU run with dropout would not continue the same trajectory."""
    state = {"rng": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["rng"])
    if device.type == "cuda" and "cuda_rng" in state:  # checkpoints written on a CPU hold none
        torch.cuda.set_rng_state(state["cuda_rng"], device)


def build_parts(cfg: Config, world: World, teacher=None) -> Parts:
    """Everything a run needs, in an order that keeps its bits: the initial weights are drawn right after seeding,
    the same on every rank; later randomness is keyed per example. `teacher(cfg, device)` builds a student's
    teacher (a `Denoiser`), in a layer above this one."""
    train, par = cfg.train, cfg.parallel
    with config_errors("parallel"):
        strategy = build_strategy(cfg, world)
        schedule, replica, _, parts = strategy.data.clock(train.batch_size)
    world.barrier()  # every rank has made the strategy's process groups before any may exit on an error below
    shares = strategy.data.shares
    for r, b in enumerate(schedule.batches):
        if par.worker_batch and b % (parts * train.accumulate):
            raise ConfigError(f"parallel.worker_batch: replica {r}'s {b} images are not divisible by its {parts} "
                              f"ranks x accumulate={train.accumulate}")
    if par.worker_lr is not None and len(par.worker_lr) != len(schedule.batches):
        raise ConfigError(f"parallel.worker_lr: {len(par.worker_lr)} entries for {len(schedule.batches)} replicas")
    if not par.worker_batch and train.batch_size % (shares * train.accumulate):
        raise ConfigError(f"train.batch_size: {train.batch_size} is not divisible by "
                          f"{shares} data-parallel ranks x accumulate={train.accumulate}")
    with config_errors("parallel"):
        strategy.layout.check_training(train)
    if world.is_main:
        warn_if_bf16_is_slow("train.precision", train.precision, world.device)
    run_dir = prepare_run_dir(cfg, write=False)  # its config is written once the data and network are built
    space = open_data_space(cfg, run_dir, world.device, starting=True)  # data.autoencoder: its latents
    world.barrier()
    torch.manual_seed(cfg.seed)

    with world.node_first():  # each machine's caches filled once, by its first rank
        source = build_data(cfg.data, cfg.seed, check=True)  # a corrupt file stops the run here, by name
        if cfg.data.shards is not None:  # replica r trains on cluster r of the partition only
            clusters = read_clusters(cfg.data.shards, source, data_name(cfg.data))
            if int(clusters.max()) + 1 != len(schedule.batches):
                raise ConfigError(f"data.shards: {cfg.data.shards} has {int(clusters.max()) + 1} clusters for "
                                  f"{len(schedule.batches)} replicas")
            source = ClusterSubset(source, clusters, replica)
        source = condition_kind(cfg.model).source(cfg, run_dir, source, world.device)  # holding its condition
    shape, num_classes = tuple(source.shape), cfg.model.num_classes
    with config_errors("data.autoencoder"):  # a latent run's network learns the latents of the images
        shape = space.example_shape(shape)
    if num_classes and num_classes != source.num_classes:
        raise ConfigError(f"model.num_classes: {num_classes} does not match the data's {source.num_classes} classes")

    with config_errors("model"):
        net = build_network(network_spec(cfg.model, shape, num_classes)).to(world.device)
    pretrained = None  # the sha256 of a diffusers folder's weights the run starts from
    if getattr(cfg.model, "pretrained", None) and latest_checkpoint(run_dir) is None:
        from islands.nets.diffusers_net import load_pretrained

        try:
            pretrained = load_pretrained(net, cfg.model.pretrained)
        except DataError as err:
            raise DataError(f"model.pretrained: {err}") from None
    if train.init_from and latest_checkpoint(run_dir) is None:  # a resume reads its own weights instead
        start_from(net, Path(train.init_from))
    if train.objective == "distill" and teacher is None:  # the ensemble belongs to an outer layer, which builds it
        raise ConfigError("train.objective: 'distill' needs its teacher, the ensemble; run 'islands distill' or "
                          "'islands train' on the student's config")
    objective = build_objective(cfg, teacher and teacher(cfg, world.device))
    objective.prepare(net)  # how the network drops its condition; a router's prior
    with config_errors("parallel"):  # a network a pipeline cannot cut
        model = strategy.parallelize(net)
    opt = strategy.layout.optimizer(net, train.optimizer, lr=train.lr, betas=train.betas,
                                    weight_decay=train.weight_decay)
    ema = EMA(net, train.ema_halflife_images, train.ema_rampup) if train.ema_halflife_images else None
    if ema is not None:  # a replica that rejoins its peers takes their EMA too
        strategy.replicas.share("ema", ema.state_dict, ema.load_state_dict)
    scaler = torch.amp.GradScaler(world.device.type, init_scale=2.0**10, enabled=train.precision == "fp16")
    if world.is_main:  # only a config that builds lands in the folder
        write_config(cfg)
        write_model_description(run_dir, shape, num_classes)
        record_data_space(cfg, run_dir, space)
        record_text_encoder(cfg, run_dir, source)
        if pretrained is not None:  # what the run started from, as it read it
            atomic_write_text(run_dir / PRETRAINED, json.dumps({"pretrained": cfg.model.pretrained,
                                                               "sha256": pretrained}, indent=1))
    return Parts(cfg, world, strategy, run_dir, source, shape, num_classes, net, model, opt, ema, scaler, objective,
                 space)


# What reading a damaged checkpoint raises: our readers' errors, torch.load's and json's, a state.json of other keys.
UNREADABLE = (CheckpointError, RuntimeError, pickle.UnpicklingError, OSError, ValueError, EOFError, KeyError, TypeError)


def agreed(world: World, read) -> str | None:
    """read() on every rank; None if it worked on all of them, else why (this rank's reason, or another's failure)."""
    why = None
    try:
        read()
    except UNREADABLE as err:
        said = (str(err).strip().splitlines() or [""])[0].split(". ")[0]  # torch.load's first sentence is the reason
        why = f"{type(err).__name__}: {said}" if said else type(err).__name__
    if world.all_finite(why is None):  # the world's AND
        return None
    return why or "another rank cannot read it"


def start_from(net: torch.nn.Module, run_dir: Path) -> None:
    """Put the latest weights of another run (its EMA, if any) into `net` (train.init_from). The run may have trained
    on smaller images: convolutions (the U-Net, a DiT's patches) take any size as they are, and a DiT's position
    embedding is interpolated to its new grid; any other difference of names or shapes is refused by name, so that
    no weight is dropped or left at its initialisation unnoticed."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise ConfigError(f"train.init_from: {run_dir} has no complete checkpoint")
    weights, own = checkpoint_weights(ckpt), net.state_dict()
    unfit = f"train.init_from: the weights of {run_dir} do not fit this model"
    missing, extra = sorted(own.keys() - weights.keys()), sorted(weights.keys() - own.keys())
    if missing or extra:
        said = ([f"it has no {missing[0]}"] if missing else []) + ([f"this model has no {extra[0]}"] if extra else [])
        raise ConfigError(f"{unfit}: {'; '.join(said)} ({len(missing) + len(extra)} names differ)")
    for name in sorted(weights):
        there, here = tuple(weights[name].shape), tuple(own[name].shape)
        if there == here:
            continue
        if not (isinstance(net, DiT) and name == "pos_embed"):
            raise ConfigError(f"{unfit}: {name} is {there} there, {here} here")
        try:  # a DiT trained on images of another size
            weights[name] = interpolated_pos_embed(weights[name], net.grid_size)
        except ValueError as err:
            raise ConfigError(f"{unfit}: {err}") from None
    net.load_state_dict(weights)


def learning_rate(lr: float, warmup_images: int, batch: int, images: int) -> float:
    """The rate of the step after `images`: linear warm-up over `warmup_images`, then constant."""
    if warmup_images == 0:
        return lr
    return lr * min(1.0, (images + batch) / warmup_images)
