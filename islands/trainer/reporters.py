"""What a run reports while it trains, each reporter deciding for itself when it is due.

After every optimizer step the trainer hands each reporter the step's outcome; a reporter acts when the image
count crosses a multiple of its interval, and at the end of the run. Every rank calls every reporter in the same
order (the metrics log averages over ranks, the others gather the weights); only rank 0 writes.
"""

import json
import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from tqdm import tqdm

from islands.data import judged_on, streams
from islands.data.batch import Batch
from islands.data.posterior import EXACT_POSTERIOR_LIMIT, exact_cluster_posterior
from islands.data.shards import skipped_examples
from islands.data.sources import CLUSTER, X
from islands.data.space import PIXELS
from islands.eval.evaluate import Evaluator, evaluate_sampler, refuse_untrusted_features
from islands.generate import Sampler, run_sample_options
from islands.images import save_curve, save_grid, save_samples_picture
from islands.rundir import atomic_write_text
from islands.train.autoencoder import export_autoencoder
from islands.train.logbook import Logbook
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


class MetricsLog(Reporter):
    """Loss, gradient norm, learning rate, throughput and communication, averaged over the steps since the last
    line and over ranks, to metrics.jsonl, TensorBoard and the progress bar."""

    def __init__(self, parts: Parts, initial: int, total: int, progress: bool):
        self.parts, self.every = parts, parts.cfg.train.log_every
        self.logbook = Logbook(parts.run_dir) if parts.main else None
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
        w, world = self.window, self.parts.world
        seconds, steps = time.perf_counter() - w["start"], max(w["steps"], 1)
        # sums and counts apart: a replica idle for the whole window (a slower worker) adds no steps, not a loss of 0
        loss_sum, loss_steps, comm_per_step = world.mean([w["loss"], w["steps"],
                                                          w["comm_bytes"] / max(w["steps_all"], 1)])
        loss = loss_sum / loss_steps if loss_steps > 0 else 0.0
        record = {"images": step.progress.images, "step": step.progress.step, "loss": loss,
                  "grad_norm": w["grad_norm"] / steps, "lr": step.lr, "images_per_s": w["images"] / seconds,
                  "skipped": step.progress.skipped}
        if self.parts.strategy.communicates:
            record["comm_bytes_per_step_per_rank"] = comm_per_step
        if (skipped := skipped_examples(self.parts.source)) is not None:  # on_error skip: replaced so far, all ranks
            record["skipped_examples"] = round(world.mean([skipped])[0] * world.size)
        if self.parts.main:
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

    def __init__(self, parts: Parts):
        self.parts, self.every = parts, parts.cfg.train.checkpoint_every

    def report(self, step: Step) -> None:
        self.parts.save_checkpoint(step.progress)
        self.parts.strategy.layout.check_consistency(self.parts.net)
        self.parts.world.barrier()


def fixed_probe(parts: Parts, size: int) -> Batch:
    """A fixed random subset of the data (some sources are sorted by class), on the run's device."""
    order = torch.randperm(len(parts.source), generator=streams.generator(parts.cfg.seed, 0, "validation"))
    indices = order[:size].tolist()
    got = parts.source.read(indices, (X, parts.condition_field, CLUSTER))
    condition = got.get(parts.condition_field)
    if condition is None:
        condition = torch.full((len(indices),), -1, dtype=torch.long)
    return Batch(got[X], condition, order[:size], cluster=got.get(CLUSTER)).to(parts.world.device)


def sampler_of(parts: Parts, plain: torch.nn.Module) -> Sampler:
    """The network `plain` (a plain copy of the run's) opened for sampling as the run's samples are drawn."""
    opts = run_sample_options(parts.cfg.sample, parts.cfg, parts.world.device)
    return Sampler(parts.objective.denoiser(plain), parts.cfg, parts.shape, parts.num_classes, opts, space=parts.space)


class SampleGrid(Reporter):
    """A picture of samples of the averaged weights: a grid of images, or a scatter of vectors over the data."""

    def __init__(self, parts: Parts):
        self.parts, self.every = parts, parts.cfg.train.sample_every

    def report(self, step: Step) -> None:
        p = self.parts
        plain = p.plain_copy()
        if plain is None:
            return
        num = min(p.cfg.sample.num, 64 if len(p.shape) == 3 else 2000)  # a legible grid, or a dense scatter
        sampler = sampler_of(p, plain)
        # a text-conditioned run draws for the captions of its first examples (a class run: every class in turn)
        first = [i % len(p.source) for i in range(num)]
        captions = p.source.captions(first) if p.cfg.model.condition == "text" else None
        labels = p.source.read(first, (p.condition_field,))[p.condition_field] if captions else sampler.labels(num)
        x = sampler.generate(num, labels, device=p.world.device)
        reference = p.source.get(list(range(min(len(p.source), 2000))))[0] if len(p.shape) == 1 else None
        images = step.progress.images
        save_samples_picture(x, p.run_dir / "samples" / f"{images:012d}.png", reference, f"{images} images",
                             captions)


class Evaluation(Reporter):
    """Every `eval.every` images: the validation loss on a fixed probe, and the metrics of `islands eval` on
    samples of the averaged weights, to eval.jsonl."""

    def __init__(self, parts: Parts):
        self.parts, self.every = parts, parts.cfg.eval.every
        self.log = Logbook(parts.run_dir, "eval") if parts.main else None
        self.evaluator, self.probe = None, None
        if self.every and parts.cfg.eval.metrics != []:  # a module this machine does not trust: now, not mid-run
            refuse_untrusted_features(parts.cfg.eval)

    def report(self, step: Step) -> None:
        p, cfg = self.parts, self.parts.cfg
        plain = p.plain_copy()
        if plain is None:
            return
        record = {"images": step.progress.images}
        if cfg.eval.val_size:
            self.probe = self.probe or p.space.encode(fixed_probe(p, cfg.eval.val_size))  # a latent run: latents
            by_t = p.objective.validation_loss(plain, self.probe, cfg.eval.val_times)
            if by_t is not None:
                record.update(val_loss=sum(by_t) / len(by_t), val_loss_by_t=by_t)
        if cfg.eval.metrics != []:
            self.evaluator = self.evaluator or Evaluator(p.space.reference(judged_on(p.source)), cfg.eval, cfg.seed,
                                                         device=p.world.device)
            sampler = sampler_of(p, plain)  # on the run's device, as are its samples' noise and labels
            scored = evaluate_sampler(self.evaluator, sampler, cfg.eval.num, device=p.world.device)
            record.update({k: v for k, v in scored.items() if isinstance(v, (int, float))})
        self.log.write(record)

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


class RouterAccuracy(Reporter):
    """The router's accuracy by t on a fixed probe and, for data small enough, its calibration against the exact
    cluster posterior: router_accuracy.json and its plot."""

    def __init__(self, parts: Parts):
        self.parts, self.every = parts, parts.cfg.train.sample_every
        self.exact = None

    def report(self, step: Step) -> None:
        p = self.parts
        plain = p.plain_copy()
        if plain is None:
            return
        probe = p.space.encode(fixed_probe(p, min(len(p.source), 2000)))  # a latent run: latents
        # the exact posterior is over the examples themselves: not one draw of their latents, which the router sees
        small = len(p.source) * math.prod(p.shape) <= EXACT_POSTERIOR_LIMIT
        # and of a class or nothing: a caption has no exact posterior over these examples to compare with
        if self.exact is None and small and p.space == PIXELS and p.cfg.model.condition != "text":
            self.exact = exact_cluster_posterior(p.source, p.cfg.model.outputs, p.num_classes)
        report = {"images": step.progress.images, **p.objective.report_by_t(plain, probe, self.exact)}
        atomic_write_text(p.run_dir / "router_accuracy.json", json.dumps(report, indent=1))
        curves = {"top-1 accuracy": report["accuracy"]}
        if "tv" in report:
            curves.update({"exact posterior's accuracy": report["exact_accuracy"], "TV to exact": report["tv"]})
        title = f"router after {step.progress.images} images; largest cluster {report['majority_cluster_share']:.2f}"
        save_curve(report["t"], curves, p.run_dir / "router_accuracy.png", "t (0 data, 1 noise)", "", title)


class AutoencoderExport(Reporter):
    """With every checkpoint and at the end: the averaged weights as a diffusers folder, RUN/autoencoder; the fixed
    probe's reconstruction error to eval.jsonl; up to 32 of its images above their reconstructions in samples/."""

    def __init__(self, parts: Parts):
        self.parts, self.every = parts, parts.cfg.train.checkpoint_every
        self.log = Logbook(parts.run_dir, "eval") if parts.main else None
        self.probe = None

    def report(self, step: Step) -> None:
        p = self.parts
        plain = p.plain_copy()
        if plain is None:
            return
        if self.probe is None:
            self.probe = fixed_probe(p, min(len(p.source), 256)).x
        record, reconstruction = export_autoencoder(plain.vae, self.probe, p.run_dir, p.cfg.seed)
        self.log.write({"images": step.progress.images, **record})
        shown = min(len(self.probe), 32)
        save_grid(torch.cat([self.probe[:shown].cpu(), reconstruction[:shown].cpu()]),
                  p.run_dir / "samples" / f"{step.progress.images:012d}.png", nrow=8)

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


# What each kind of run reports beside its log and checkpoints (an objective's `produces`).
PRODUCT_REPORTERS = {"denoiser": (SampleGrid, Evaluation), "router": (RouterAccuracy,),
                     "autoencoder": (AutoencoderExport,)}


def build_reporters(parts: Parts, initial: int, total: int, progress: bool) -> list[Reporter]:
    """The metrics log, the checkpointer, then what the run's product calls for, in the order every rank runs
    them. An evaluation every 0 images is none."""
    reporters = [MetricsLog(parts, initial, total, progress), Checkpointer(parts)]
    for kind in PRODUCT_REPORTERS[parts.objective.produces]:
        if kind is not Evaluation or parts.cfg.eval.every:
            reporters.append(kind(parts))
    return reporters
