"""What a run reports while it trains, each reporter deciding for itself when it is due.

After every optimizer step the trainer hands each reporter the step's outcome; a reporter acts when the image
count crosses a multiple of its interval, and at the end of the run. Every rank calls every reporter in the same
order (the metrics log averages over ranks, the others gather the weights); only rank 0 writes.

A reporter is handed only what it uses, as small handles built once by `build_reporters` (where it writes, the
examples it reads, the weights it samples), never the run's whole `Parts`: what a reporter can touch is in its
constructor's signature.
"""

import json
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from islands.conditions import ConditionKind, condition_kind
from islands.config import Config, EvalConfig
from islands.data import judged_on, streams
from islands.data.batch import Batch
from islands.data.posterior import EXACT_POSTERIOR_LIMIT, exact_cluster_posterior
from islands.data.shards import skipped_examples
from islands.data.sources import CLUSTER, LABEL, Source, X
from islands.data.space import PIXELS, DataSpace
from islands.eval.evaluate import Evaluator, evaluate_sampler, refuse_untrusted_features
from islands.generate import Sampler, run_sample_options
from islands.images import save_curve, save_grid, save_samples_picture
from islands.parallel.launch import World
from islands.rundir import atomic_write_text
from islands.train.autoencoder import export_autoencoder
from islands.train.logbook import Logbook
from islands.train.objectives import Objective
from islands.trainer.parts import Parts, Progress


@dataclass
class Step:
    """One optimizer step's outcome, as the reporters see it."""

    before: int  # images consumed before the step
    progress: Progress  # after it
    finite: bool  # False: the step was skipped
    loss: float
    grad_norm: float
    comm_bytes: float  # what this rank sent during the step, the optimizer's traffic included
    batch: int
    lr: float
    done: bool  # the run's last step


def crossed(before: int, after: int, every: int) -> bool:
    return every > 0 and after // every > before // every


class Reporter(ABC):
    every = 0  # images between reports; 0: at the end only

    def __call__(self, step: Step) -> None:
        if step.done or crossed(step.before, step.progress.images, self.every):
            self.report(step)

    @abstractmethod
    def report(self, step: Step) -> None: ...

    def close(self) -> None:  # noqa: B027 -- a hook for reporters that hold files
        """Release what the reporter holds open (nothing, unless it says)."""


@dataclass(frozen=True)
class Folder:
    """Where a reporter writes, and whether this rank writes (rank 0 alone)."""

    run_dir: Path
    main: bool


@dataclass(frozen=True)
class Examples:
    """The run's training examples as a reporter reads them, and the space the network sees them in."""

    source: Source
    condition_field: str  # the field the network is conditioned on: a caption's embedding, or a class
    space: DataSpace
    seed: int
    device: torch.device

    def probe(self, size: int) -> Batch:
        """A fixed random subset of the data (some sources are sorted by class), on the run's device."""
        order = torch.randperm(len(self.source), generator=streams.generator(self.seed, 0, "validation"))
        indices = order[:size].tolist()
        got = self.source.read(indices, (X, self.condition_field, CLUSTER))
        condition = got.get(self.condition_field)
        if condition is None:
            condition = torch.full((len(indices),), -1, dtype=torch.long)
        return Batch(got[X], condition, order[:size], cluster=got.get(CLUSTER)).to(self.device)


@dataclass(frozen=True)
class Weights:
    """The run's averaged weights: `plain_copy()` gathers them into a plain network on rank 0 (every rank must call
    it; the others get None), and `sampler` opens that network as the run's samples are drawn."""

    plain_copy: Callable[[], torch.nn.Module | None]
    objective: Objective
    cfg: Config
    shape: tuple
    num_classes: int
    space: DataSpace
    device: torch.device

    def sampler(self, plain: torch.nn.Module) -> Sampler:
        opts = run_sample_options(self.cfg.sample, self.cfg, self.device)
        return Sampler(self.objective.denoiser(plain), self.cfg, self.shape, self.num_classes, opts, space=self.space)


class MetricsLog(Reporter):
    """Loss, gradient norm, learning rate, throughput and communication, averaged over the steps since the last
    line and over ranks, to metrics.jsonl, TensorBoard and the progress bar."""

    def __init__(self, every: int, folder: Folder, world: World, communicates: bool, source: Source, initial: int,
                 total: int, progress: bool):
        self.every, self.folder, self.world, self.communicates, self.source = every, folder, world, communicates, source
        self.logbook = Logbook(folder.run_dir) if folder.main else None
        self.bar = tqdm(total=total, initial=initial, unit="img", disable=not progress, dynamic_ncols=True)
        self.window = self.new_window()

    @staticmethod
    def new_window() -> dict:
        return {"loss": 0.0, "grad_norm": 0.0, "steps": 0, "steps_all": 0, "images": 0, "comm_bytes": 0.0,
                "start": time.perf_counter()}

    def __call__(self, step: Step) -> None:
        if step.finite:
            self.window["loss"] += step.loss
            self.window["grad_norm"] += step.grad_norm
            self.window["steps"] += 1
        self.window["comm_bytes"] += step.comm_bytes
        self.window["images"] += step.batch
        self.window["steps_all"] += 1
        self.bar.update(step.batch)
        super().__call__(step)

    def report(self, step: Step) -> None:
        w, world = self.window, self.world
        seconds, steps = time.perf_counter() - w["start"], max(w["steps"], 1)
        # sums and counts apart: a replica idle for the whole window (a slower worker) adds no steps, not a loss of 0
        loss_sum, loss_steps, comm_per_step = world.mean([w["loss"], w["steps"],
                                                          w["comm_bytes"] / max(w["steps_all"], 1)])
        loss = loss_sum / loss_steps if loss_steps > 0 else 0.0
        record = {"images": step.progress.images, "step": step.progress.step, "loss": loss,
                  "grad_norm": w["grad_norm"] / steps, "lr": step.lr, "images_per_s": w["images"] / seconds,
                  "skipped": step.progress.skipped}
        if self.communicates:
            record["comm_bytes_per_step_per_rank"] = comm_per_step
        if (skipped := skipped_examples(self.source)) is not None:  # on_error skip: replaced so far, all ranks
            record["skipped_examples"] = round(world.mean([skipped])[0] * world.size)
        if self.folder.main:
            self.logbook.write(record)
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", img_s=f"{record['images_per_s']:.0f}")
        self.window = self.new_window()

    def close(self) -> None:
        self.bar.close()
        if self.logbook is not None:
            self.logbook.close()


class Checkpointer(Reporter):
    """A complete checkpoint every `train.checkpoint_every` images; then every rank checks it holds the same
    weights (replicated strategies) before any goes on."""

    def __init__(self, every: int, save: Callable[[Progress], Path], check_consistency: Callable[[], None],
                 barrier: Callable[[], None]):
        self.every, self.save, self.check_consistency, self.barrier = every, save, check_consistency, barrier

    def report(self, step: Step) -> None:
        self.save(step.progress)
        self.check_consistency()
        self.barrier()


class SampleGrid(Reporter):
    """A picture of samples of the averaged weights: a grid of images, or a scatter of vectors over the data."""

    def __init__(self, every: int, folder: Folder, weights: Weights, examples: Examples, num: int,
                 kind: ConditionKind):
        self.every, self.folder, self.weights, self.examples = every, folder, weights, examples
        self.num, self.kind = num, kind

    def report(self, step: Step) -> None:
        w, source = self.weights, self.examples.source
        plain = w.plain_copy()
        if plain is None:
            return
        num = min(self.num, 64 if len(w.shape) == 3 else 2000)  # a legible grid, or a dense scatter
        sampler = w.sampler(plain)
        # drawn for the conditions of the first examples (a caption's) where the kind says so, else as `islands
        # sample` draws them (every class in turn)
        first = [i % len(source) for i in range(num)]
        condition, captions = self.kind.first_examples(source, first) if self.kind.grid_from_data else (None, None)
        x = sampler.generate(num, sampler.conditions(num) if condition is None else condition, device=w.device)
        reference = source.get(list(range(min(len(source), 2000))))[0] if len(w.shape) == 1 else None
        images = step.progress.images
        save_samples_picture(x, self.folder.run_dir / "samples" / f"{images:012d}.png", reference, f"{images} images",
                             captions)


class Evaluation(Reporter):
    """Every `eval.every` images: the validation loss on a fixed probe, and the metrics of `islands eval` on
    samples of the averaged weights, to eval.jsonl."""

    def __init__(self, folder: Folder, weights: Weights, examples: Examples, cfg: EvalConfig, seed: int):
        self.folder, self.weights, self.examples, self.cfg, self.seed = folder, weights, examples, cfg, seed
        self.every = cfg.every
        self.log = Logbook(folder.run_dir, "eval") if folder.main else None
        self.evaluator, self.probe = None, None
        if self.every and cfg.metrics != []:  # a module this machine does not trust: now, not mid-run
            refuse_untrusted_features(cfg)

    def report(self, step: Step) -> None:
        w, cfg, space = self.weights, self.cfg, self.examples.space
        plain = w.plain_copy()
        if plain is None:
            return
        record = {"images": step.progress.images}
        if cfg.val_size:
            self.probe = self.probe or space.encode(self.examples.probe(cfg.val_size))  # a latent run: latents
            by_t = w.objective.validation_loss(plain, self.probe, cfg.val_times)
            if by_t is not None:
                record.update(val_loss=sum(by_t) / len(by_t), val_loss_by_t=by_t)
        if cfg.metrics != []:
            self.evaluator = self.evaluator or Evaluator(space.reference(judged_on(self.examples.source)), cfg,
                                                         self.seed, device=w.device)
            sampler = w.sampler(plain)  # on the run's device, as are its samples' noise and labels
            scored = evaluate_sampler(self.evaluator, sampler, cfg.num, device=w.device)
            record.update({k: v for k, v in scored.items() if isinstance(v, (int, float))})
        self.log.write(record)

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


class RouterAccuracy(Reporter):
    """The router's accuracy by t on a fixed probe and, for data small enough, its calibration against the exact
    cluster posterior: router_accuracy.json and its plot."""

    def __init__(self, every: int, folder: Folder, weights: Weights, examples: Examples, outputs: int,
                 by_class: bool):
        self.every, self.folder, self.weights, self.examples = every, folder, weights, examples
        self.outputs, self.by_class = outputs, by_class  # the router's clusters; whether it sees a class or nothing
        self.exact = None

    def report(self, step: Step) -> None:
        w, examples, run_dir = self.weights, self.examples, self.folder.run_dir
        plain = w.plain_copy()
        if plain is None:
            return
        source = examples.source
        probe = examples.space.encode(examples.probe(min(len(source), 2000)))  # a latent run: latents
        # the exact posterior is over the examples themselves: not one draw of their latents, which the router sees
        small = len(source) * math.prod(w.shape) <= EXACT_POSTERIOR_LIMIT
        # and of a class or nothing: a caption has no exact posterior over these examples to compare with
        if self.exact is None and small and examples.space == PIXELS and self.by_class:
            self.exact = exact_cluster_posterior(source, self.outputs, w.num_classes)
        report = {"images": step.progress.images, **w.objective.report_by_t(plain, probe, self.exact)}
        atomic_write_text(run_dir / "router_accuracy.json", json.dumps(report, indent=1))
        curves = {"top-1 accuracy": report["accuracy"]}
        if "tv" in report:
            curves.update({"exact posterior's accuracy": report["exact_accuracy"], "TV to exact": report["tv"]})
        title = f"router after {step.progress.images} images; largest cluster {report['majority_cluster_share']:.2f}"
        save_curve(report["t"], curves, run_dir / "router_accuracy.png", "t (0 data, 1 noise)", "", title)


class AutoencoderExport(Reporter):
    """With every checkpoint and at the end: the averaged weights as a diffusers folder, RUN/autoencoder; the fixed
    probe's reconstruction error to eval.jsonl; up to 32 of its images above their reconstructions in samples/."""

    def __init__(self, every: int, folder: Folder, weights: Weights, examples: Examples):
        self.every, self.folder, self.weights, self.examples = every, folder, weights, examples
        self.log = Logbook(folder.run_dir, "eval") if folder.main else None
        self.probe = None

    def report(self, step: Step) -> None:
        plain = self.weights.plain_copy()
        if plain is None:
            return
        run_dir = self.folder.run_dir
        if self.probe is None:
            self.probe = self.examples.probe(min(len(self.examples.source), 256)).x
        record, reconstruction = export_autoencoder(plain.vae, self.probe, run_dir, self.examples.seed)
        self.log.write({"images": step.progress.images, **record})
        shown = min(len(self.probe), 32)
        save_grid(torch.cat([self.probe[:shown].cpu(), reconstruction[:shown].cpu()]),
                  run_dir / "samples" / f"{step.progress.images:012d}.png", nrow=8)

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


def build_reporters(parts: Parts, initial: int, total: int, progress: bool) -> list[Reporter]:
    """The metrics log, the checkpointer, then what the run's product calls for (an objective's `produces`), in the
    order every rank runs them, each handed only what it uses. An evaluation every 0 images is none."""
    cfg, world = parts.cfg, parts.world
    folder = Folder(parts.run_dir, parts.main)
    examples = Examples(parts.source, parts.condition_field, parts.space, cfg.seed, world.device)
    weights = Weights(parts.plain_copy, parts.objective, cfg, parts.shape, parts.num_classes, parts.space,
                      world.device)
    kind = condition_kind(cfg.model)
    reporters = [MetricsLog(cfg.train.log_every, folder, world, parts.strategy.communicates, parts.source, initial,
                            total, progress),
                 Checkpointer(cfg.train.checkpoint_every, parts.save_checkpoint,
                              lambda: parts.strategy.layout.check_consistency(parts.net), world.barrier)]
    # what each kind of run reports beside its log and checkpoints (an objective's `produces`)
    products = {
        "denoiser": lambda: [SampleGrid(cfg.train.sample_every, folder, weights, examples, cfg.sample.num, kind),
                             *([Evaluation(folder, weights, examples, cfg.eval, cfg.seed)] if cfg.eval.every else [])],
        "router": lambda: [RouterAccuracy(cfg.train.sample_every, folder, weights, examples, cfg.model.outputs,
                                          kind.field in (None, LABEL))],
        "autoencoder": lambda: [AutoencoderExport(cfg.train.checkpoint_every, folder, weights, examples)]}
    return reporters + products[parts.objective.produces]()
