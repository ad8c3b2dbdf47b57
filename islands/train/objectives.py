"""What a run learns: a denoiser (diffusion), a router of noised examples to their clusters, or a student of an
ensemble (distillation), behind one interface.

An objective maps (net, a `Batch`) to a per-example loss. All its randomness (noise, time, label dropout) comes
from the examples' stream positions, drawn by the loader (or by `Batch.drawn` for a batch that comes without it)
and turned into the objective's own noise, time and condition by `draw`, so an interrupted run continues exactly
where it stopped. `produces` says what comes out of the run ("denoiser": sample and evaluate it; "router": report
its accuracy by t), so the trainer picks its reporters without asking which objective it holds.
"""

from abc import ABC, abstractmethod
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


def draw(seed: int, batch: Batch, times=None, labels: torch.Tensor | None = None, num_classes: int = 0,
         label_dropout: float = 0.0):
    """Each example's noise, time and (dropped) label, keyed on its stream position: (noise, t, cond), on the
    examples' device. The batch's own draws where the loader made them, else drawn from its positions.

    `times` maps uniforms to training times (a `TimeSampler`; None: the uniform itself). Dropped labels become
    `num_classes`, the "no label" token, so that the network also learns the unconditional velocity guidance
    needs; without labels or classes, cond is None.
    """
    x0, conditional = batch.x, labels is not None and num_classes > 0
    batch = batch.drawn(seed, labelled=conditional)
    noise = batch.noise.to(x0)
    u = batch.u_time.to(x0.device)
    t = (u if times is None else times(u)).to(x0)
    cond = None
    if conditional:
        drop = batch.u_drop.to(x0.device) < label_dropout
        cond = torch.where(drop, torch.full_like(labels, num_classes), labels)
    return noise, t, cond


def canonical_x_t(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t) x0 + t eps, the canonical path both the router and the ensemble it serves live on."""
    return (1 - broadcast(t, x0)) * x0 + broadcast(t, x0) * noise


class Objective(ABC):
    produces: ClassVar[str] = "denoiser"

    @abstractmethod
    def __call__(self, net, batch: Batch) -> torch.Tensor:
        """The per-example loss (B,)."""

    def prepare(self, net: torch.nn.Module) -> None:  # noqa: B027 -- a hook most objectives leave empty
        """Set what the network needs from the data before training (nothing, unless the objective says)."""

    def validation_loss(self, net, x0: torch.Tensor, labels: torch.Tensor | None, times: int) -> list[float] | None:
        """The data loss on a fixed probe at `times` stratified times; None where the objective has no data loss."""
        return None

    def inputs_and_target(self, batch: Batch):
        """(the network's inputs, the target its output is scored against by `loss_of`), for strategies that feed
        the network and score its output on different ranks (pipeline stages); None where the loss is not a
        regression of the network's output."""
        return None

    loss_of = staticmethod(regression_loss)  # (output, target) -> the per-example loss, with inputs_and_target


class DiffusionObjective(Objective):
    """The network regresses its own prediction target on its own path (islands/flow/objectives.py)."""

    def __init__(self, path, prediction: str, times: TimeSampler, seed: int, num_classes: int, label_dropout: float):
        self.path, self.prediction, self.times = path, prediction, times
        self.seed, self.num_classes, self.label_dropout = seed, num_classes, label_dropout

    def __call__(self, net, batch):
        inputs, target = self.inputs_and_target(batch)
        return self.loss_of(net(*inputs), target)

    def inputs_and_target(self, batch):
        noise, tau, cond = draw(self.seed, batch, self.times, batch.labels, self.num_classes, self.label_dropout)
        x, target = training_pair(self.path, self.prediction, batch.x, noise, tau)
        return (x, tau) if cond is None else (x, tau, cond), target

    def denoiser(self, net) -> NetworkDenoiser:
        return NetworkDenoiser(net, self.path, self.prediction)

    @torch.no_grad()
    def validation_loss(self, net, x0, labels, times):
        """Mean loss at each of `times` stratified times, on fixed examples with fixed noise and no label
        dropout: the same probe at every evaluation, so its changes are the model's, not the draw's."""
        noise = streams.normal(self.seed, list(range(len(x0))), tuple(x0.shape[1:]), "validation").to(x0)
        losses = []
        for stratum in self.times.strata(times):
            tau = torch.full((len(x0),), stratum).to(x0)
            losses.append(training_loss(net, self.path, self.prediction, x0, noise, tau, labels).mean().item())
        return losses


class RouterObjective(Objective):
    """Cross-entropy against the cluster of training examples noised along the canonical path (McAllister et al.
    2025, section 3.2). Examples arrive labelled class * K + cluster (islands/data/clusters.py); the router sees x_t
    at a uniform canonical t and the class, with the denoisers' label dropout, so that it also routes unconditional
    and guided sampling. Its logits are anchored at the partition's p(cluster | class) (`prior`)."""

    produces: ClassVar[str] = "router"

    def __init__(self, seed: int, clusters: int, num_classes: int, label_dropout: float,
                 prior: torch.Tensor | None = None):
        self.seed, self.k, self.num_classes, self.label_dropout = seed, clusters, num_classes, label_dropout
        self.prior = prior

    def prepare(self, net):
        if self.prior is not None:
            net.anchor.set_prior(self.prior)

    def split(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(cluster, class or None) from the combined label."""
        return labels % self.k, (labels // self.k if self.num_classes else None)

    def __call__(self, net, batch):
        cluster, cls = self.split(batch.labels)
        noise, t, cls = draw(self.seed, batch, None, cls, self.num_classes, self.label_dropout)
        return F.cross_entropy(net(canonical_x_t(batch.x, noise, t), t, cls).float(), cluster, reduction="none")

    @torch.no_grad()
    def report_by_t(self, net, x0: torch.Tensor, labels: torch.Tensor, exact=None) -> dict:
        """Top-1 accuracy on fixed examples and noise at t = (b + 0.5) / REPORT_TIMES, with the class given; with
        `exact` (the data's exact cluster posterior, islands.data.posterior), the router's calibration against it
        at each t too."""
        noise = streams.normal(self.seed, list(range(len(x0))), tuple(x0.shape[1:]), "validation").to(x0)
        cluster, cls = self.split(labels)
        report = {"t": [], "accuracy": []}
        for b in range(REPORT_TIMES):
            t = torch.full((len(x0),), (b + 0.5) / REPORT_TIMES, dtype=x0.dtype, device=x0.device)
            x_t = canonical_x_t(x0, noise, t)
            probs = net(x_t, t, cls).float().softmax(1)
            report["t"].append(t[0].item())
            report["accuracy"].append((probs.argmax(1) == cluster).double().mean().item())
            if exact is not None:
                for name, value in calibration(probs, exact(x_t, t, cls), cluster).items():
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
    cluster (ancestral routing of the `Mixture`, each image assigned its own cluster), or the routed mixture
    itself. Both see the same class label, dropped to "none" at the student's label-dropout rate so the student
    also learns guidance. The teacher is a `Denoiser` built by the caller: training knows nothing of ensembles."""

    def __init__(self, path, prediction: str, times: TimeSampler, seed: int, num_classes: int, label_dropout: float,
                 teacher, clusters: int):
        super().__init__(path, prediction, times, seed, num_classes, label_dropout)
        self.teacher, self.k = teacher, clusters
        self.own_cluster = getattr(getattr(teacher, "routing", None), "policy", None) == "ancestral"

    def __call__(self, net, batch):
        cluster, cls = batch.labels % self.k, (batch.labels // self.k if self.num_classes else None)
        noise, t, cond = draw(self.seed, batch, self.times, cls, self.num_classes, self.label_dropout)
        x_t = canonical_x_t(batch.x, noise, t)
        with torch.no_grad():
            if self.own_cluster:
                self.teacher.assign(cluster)
            target = self.teacher(x_t, t, cond)
        return (self.denoiser(net)(x_t, t, cond) - target).square().flatten(1).mean(1)

    def validation_loss(self, net, x0, labels, times):
        return None  # a student learns its teacher, not the data: it has no data loss to probe

    def inputs_and_target(self, batch):
        return None  # the teacher's velocity is compared with the student's, not with its raw output


def time_sampler(flow, discrete: bool = True) -> TimeSampler:
    """The training times of a `FlowConfig`; a DDPM path (vp_discrete) trains on its integer steps."""
    steps = flow.train_steps if discrete and flow.path == "vp_discrete" else None
    return TimeSampler(flow.time_sampler, *flow.t_range, flow.logit_mean, flow.logit_std, steps)


def build_objective(cfg, num_classes: int, teacher=None, clusters: int = 0) -> Objective:
    """The objective `cfg.train.objective` names. A student needs its `teacher` (a `Denoiser`) and the data's
    number of `clusters`; a router reads its prior from the partition."""
    seed, dropout = cfg.seed, cfg.train.label_dropout
    if cfg.train.objective == "autoencoder":
        from islands.train.autoencoder import AutoencoderObjective  # it imports this module's Objective

        return AutoencoderObjective.from_config(cfg)
    if cfg.train.objective == "router":
        prior = read_prior_table(cfg.data.partition, num_classes)
        return RouterObjective(seed, cfg.model.outputs, num_classes, dropout, prior)
    path = build_path(cfg.flow.path, **cfg.flow.path_options())
    if cfg.train.objective == "diffusion":
        return DiffusionObjective(path, cfg.flow.prediction, time_sampler(cfg.flow), seed, num_classes, dropout)
    return DistillObjective(path, cfg.flow.prediction, time_sampler(cfg.flow, discrete=False), seed, num_classes,
                            dropout, teacher, clusters)
