"""What a run learns: a denoiser (diffusion), a router of noised examples to their clusters, or a student of an
ensemble (distillation), behind one interface.

An objective maps (net, a `Batch`) to a per-example loss. All its randomness (noise, time, label dropout) comes
from the examples' stream positions, drawn by the loader (or by `Batch.drawn` for a batch that comes without it)
and turned into the objective's own noise, time and condition by `draw`, so an interrupted run continues exactly
where it stopped. `produces` says what comes out of the run ("denoiser": sample and evaluate it; "router": report
its accuracy by t), so the trainer picks its reporters without asking which objective it holds.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from islands.data import streams
from islands.data.batch import Batch
from islands.data.clusters import read_prior_table
from islands.flow.denoiser import NetworkDenoiser, broadcast
from islands.flow.objectives import regression_loss, training_loss, training_pair
from islands.flow.paths import build_path
from islands.flow.timesteps import TimeSampler

REPORT_TIMES = 10  # the t of the router's report: 0.05, 0.15, ..., 0.95


def draw(seed: int, batch: Batch, times=None, condition=None, dropout: float = 0.0):
    """Each example's noise, time and (dropped) condition, keyed on its stream position: (noise, t, cond), on the
    examples' device. The batch's own draws where the loader made them, else drawn from its positions.

    `times` maps uniforms to training times (a `TimeSampler`; None: the uniform itself). `condition` is the
    network's condition module (islands/nets/condition.py), which says what a dropped condition is, so that the
    network also learns the unconditional velocity guidance needs; for an unconditional network (None), cond is None.
    """
    x0 = batch.x
    batch = batch.drawn(seed, conditioned=condition is not None)
    noise = batch.noise.to(x0)
    u = batch.u_time.to(x0.device)
    t = (u if times is None else times(u)).to(x0)
    cond = None
    if condition is not None:
        cond = condition.drop(batch.condition, batch.u_drop.to(x0.device) < dropout)
    return noise, t, cond


@dataclass(frozen=True)
class Regression:
    """An objective's loss as a regression of the network's output on a target, for strategies that feed the network
    and score its output on different ranks (pipeline stages): the network's inputs, the target, and
    loss(output, target) -> the per-example loss, which may be called on any part of the rows."""

    inputs: tuple
    target: torch.Tensor
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def canonical_x_t(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t) x0 + t eps, the canonical path both the router and the ensemble it serves live on."""
    return (1 - broadcast(t, x0)) * x0 + broadcast(t, x0) * noise


class Objective(ABC):
    produces: ClassVar[str] = "denoiser"
    condition = None  # the network's condition module, set by `prepare`; None: unconditional

    @abstractmethod
    def __call__(self, net, batch: Batch) -> torch.Tensor:
        """The per-example loss (B,)."""

    def prepare(self, net: torch.nn.Module) -> None:
        """Take from the (unwrapped) network what the objective needs before training: how it drops its condition
        (islands/nets/condition.py); a router also its prior."""
        self.condition = net.condition

    def conditions(self, batch: Batch) -> torch.Tensor | None:
        """The batch's conditions as the network takes them (no dropout), or None for an unconditional network."""
        return None if self.condition is None else batch.condition

    def validation_loss(self, net, probe: Batch, times: int) -> list[float] | None:
        """The data loss on a fixed probe at `times` stratified times; None where the objective has no data loss."""
        return None

    def regression(self, batch: Batch) -> Regression | None:
        """The loss as a regression of the network's output (for pipeline stages); None where it is not one."""
        return None

    loss_of = staticmethod(regression_loss)  # (output, target) -> the per-example loss of a `Regression`


class DiffusionObjective(Objective):
    """The network regresses its own prediction target on its own path (islands/flow/objectives.py)."""

    def __init__(self, path, prediction: str, times: TimeSampler, seed: int, label_dropout: float):
        self.path, self.prediction, self.times = path, prediction, times
        self.seed, self.label_dropout = seed, label_dropout

    def __call__(self, net, batch):
        regression = self.regression(batch)
        return regression.loss(net(*regression.inputs), regression.target)

    def regression(self, batch):
        noise, tau, cond = draw(self.seed, batch, self.times, self.condition, self.label_dropout)
        x, target = training_pair(self.path, self.prediction, batch.x, noise, tau)
        return Regression((x, tau) if cond is None else (x, tau, cond), target, self.loss_of)

    def denoiser(self, net) -> NetworkDenoiser:
        return NetworkDenoiser(net, self.path, self.prediction)

    @torch.no_grad()
    def validation_loss(self, net, probe, times):
        """Mean loss at each of `times` stratified times, on fixed examples with fixed noise and no condition
        dropout: the same probe at every evaluation, so its changes are the model's, not the draw's."""
        x0, cond = probe.x, self.conditions(probe)
        noise = streams.normal(self.seed, list(range(len(x0))), tuple(x0.shape[1:]), "validation").to(x0)
        losses = []
        for stratum in self.times.strata(times):
            tau = torch.full((len(x0),), stratum).to(x0)
            losses.append(training_loss(net, self.path, self.prediction, x0, noise, tau, cond).mean().item())
        return losses


class RouterObjective(Objective):
    """Cross-entropy against the cluster of training examples noised along the canonical path (McAllister et al.
    2025, section 3.2). Examples arrive with their cluster (`Batch.cluster`, islands/data/clusters.py); the router
    sees x_t at a uniform canonical t and the condition, with the denoisers' condition dropout, so that it also routes
    unconditional and guided sampling. Its logits are anchored at the partition's p(cluster | class) (`prior`)."""

    produces: ClassVar[str] = "router"

    def __init__(self, seed: int, clusters: int, label_dropout: float, prior: torch.Tensor | None = None):
        self.seed, self.k, self.label_dropout, self.prior = seed, clusters, label_dropout, prior

    def prepare(self, net):
        super().prepare(net)
        if self.prior is not None:
            net.anchor.set_prior(self.prior)

    def __call__(self, net, batch):
        noise, t, cond = draw(self.seed, batch, None, self.condition, self.label_dropout)
        return F.cross_entropy(net(canonical_x_t(batch.x, noise, t), t, cond).float(), batch.cluster,
                               reduction="none")

    @torch.no_grad()
    def report_by_t(self, net, probe: Batch, exact=None) -> dict:
        """Top-1 accuracy on fixed examples (their cluster in `probe.cluster`) and noise at t = (b + 0.5) /
        REPORT_TIMES, with the condition given; with `exact` (the data's exact cluster posterior,
        islands.data.posterior), the router's calibration against it at each t too."""
        x0, cluster, cond = probe.x, probe.cluster, self.conditions(probe)
        noise = streams.normal(self.seed, list(range(len(x0))), tuple(x0.shape[1:]), "validation").to(x0)
        report = {"t": [], "accuracy": []}
        for b in range(REPORT_TIMES):
            t = torch.full((len(x0),), (b + 0.5) / REPORT_TIMES, dtype=x0.dtype, device=x0.device)
            x_t = canonical_x_t(x0, noise, t)
            probs = net(x_t, t, cond).float().softmax(1)
            report["t"].append(t[0].item())
            report["accuracy"].append((probs.argmax(1) == cluster).double().mean().item())
            if exact is not None:
                for name, value in calibration(probs, exact(x_t, t, cond), cluster).items():
                    report.setdefault(name, []).append(value)
        report["majority_cluster_share"] = torch.bincount(cluster, minlength=self.k).max().item() / len(cluster)
        return report


def calibration(probs: torch.Tensor, exact: torch.Tensor, clusters: torch.Tensor, bins: int = 10) -> dict:
    """A router's probabilities (B, K) against the exact posterior (B, K) and the examples' true clusters (B,).

    tv: mean total variation 0.5 sum_k |p - q|; kl: mean KL(exact || router) in nats; ece: the expected
    calibration error of the top-1 prediction over `bins` equal-width confidence bins (Guo et al. 2017);
    exact_accuracy: the top-1 accuracy of the exact posterior, the most any router can reach.
    """
    p, q = probs.double().cpu(), exact.double().cpu()
    clusters = torch.as_tensor(clusters).cpu()
    tv = 0.5 * (p - q).abs().sum(1).mean()
    kl = torch.where(q > 0, q * (q.clamp_min(1e-300).log() - p.clamp_min(1e-300).log()), 0.0).sum(1).mean()
    confidence, predicted = p.max(1)
    correct = (predicted == clusters).double()
    which = (confidence * bins).long().clamp(max=bins - 1)
    ece = sum((correct[which == b].mean() - confidence[which == b].mean()).abs() * (which == b).double().mean()
              for b in range(bins) if (which == b).any())
    return {"tv": float(tv), "kl": float(kl), "ece": float(ece),
            "exact_accuracy": float((q.argmax(1) == clusters).double().mean())}


class DistillObjective(DiffusionObjective):
    """Distillation of an ensemble into one student (McAllister et al. 2025): at x_t on the canonical path,
    || v_student(x_t, t) - v_teacher(x_t, t) ||^2, where the teacher is the expert of the training image's own
    cluster (ancestral routing of the `Mixture`, each image assigned its own cluster, `Batch.cluster`), or the routed
    mixture itself. Both see the same condition, dropped to "none" at the student's dropout rate so the student also
    learns guidance. The teacher is a `Denoiser` built by the caller: training knows nothing of ensembles."""

    def __init__(self, path, prediction: str, times: TimeSampler, seed: int, label_dropout: float, teacher):
        super().__init__(path, prediction, times, seed, label_dropout)
        self.teacher = teacher
        self.own_cluster = getattr(getattr(teacher, "routing", None), "policy", None) == "ancestral"

    def __call__(self, net, batch):
        noise, t, cond = draw(self.seed, batch, self.times, self.condition, self.label_dropout)
        x_t = canonical_x_t(batch.x, noise, t)
        with torch.no_grad():
            teacher = self.teacher.assigned(batch.cluster) if self.own_cluster else self.teacher
            target = teacher(x_t, t, cond)
        return (self.denoiser(net)(x_t, t, cond) - target).square().flatten(1).mean(1)

    def validation_loss(self, net, probe, times):
        return None  # a student learns its teacher, not the data: it has no data loss to probe

    def regression(self, batch):
        return None  # the teacher's velocity is compared with the student's, not with its raw output


def time_sampler(flow, discrete: bool = True) -> TimeSampler:
    """The training times of a `FlowConfig`; a DDPM path (vp_discrete) trains on its integer steps."""
    steps = flow.train_steps if discrete and flow.path == "vp_discrete" else None
    return TimeSampler(flow.time_sampler, *flow.t_range, flow.logit_mean, flow.logit_std, steps, flow.time_shift)


def build_objective(cfg, teacher=None) -> Objective:
    """The objective `cfg.train.objective` names. A student needs its `teacher` (a `Denoiser`); a router reads its
    prior from the partition. `prepare(net)` hands it the network's condition before training."""
    seed, dropout = cfg.seed, cfg.train.label_dropout
    if cfg.train.objective == "autoencoder":
        from islands.train.autoencoder import AutoencoderObjective  # it imports this module's Objective

        return AutoencoderObjective.from_config(cfg)
    if cfg.train.objective == "router":
        prior = read_prior_table(cfg.data.partition, cfg.model.num_classes)
        return RouterObjective(seed, cfg.model.outputs, dropout, prior)
    path = build_path(cfg.flow.path, **cfg.flow.path_options())
    if cfg.train.objective == "diffusion":
        return DiffusionObjective(path, cfg.flow.prediction, time_sampler(cfg.flow), seed, dropout)
    return DistillObjective(path, cfg.flow.prediction, time_sampler(cfg.flow, discrete=False), seed, dropout, teacher)
