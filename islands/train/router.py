"""The router's objective: cross-entropy against the cluster of training examples noised along the
canonical path (McAllister et al. 2025, section 3.2), and its accuracy as a function of t.

Examples arrive labelled class * K + cluster (see islands/data/clusters.py). The router sees x_t at the
canonical t of the example's stream position, and its class with the same label dropout as the denoisers,
so that it also routes unconditional and guided sampling.
"""

import torch
import torch.nn.functional as F

from islands.data import streams
from islands.flow.denoiser import broadcast

REPORT_TIMES = 10  # the t of the router's report: 0.05, 0.15, ..., 0.95


def canonical_x_t(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t) x0 + t eps, the canonical path both the router and the ensemble it serves live on."""
    return (1 - broadcast(t, x0)) * x0 + broadcast(t, x0) * noise


class RouterObjective:
    def __init__(self, seed: int, clusters: int, num_classes: int, label_dropout: float):
        self.seed, self.k, self.num_classes, self.label_dropout = seed, clusters, num_classes, label_dropout

    def split(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(cluster, class or None) from the combined label."""
        return labels % self.k, (labels // self.k if self.num_classes else None)

    def __call__(self, net, x0: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        pos = positions.tolist()
        noise = streams.normal(self.seed, pos, tuple(x0.shape[1:])).to(x0)
        t = streams.uniform(self.seed, pos, "time").to(x0)
        x_t = canonical_x_t(x0, noise, t)
        cluster, cls = self.split(labels)
        if cls is not None:
            drop = (streams.uniform(self.seed, pos, "label_drop") < self.label_dropout).to(x0.device)
            cls = torch.where(drop, torch.full_like(cls, self.num_classes), cls)
        return F.cross_entropy(net(x_t, t, cls).float(), cluster, reduction="none")

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


class DistillObjective:
    """Distillation of an ensemble into one student (McAllister et al. 2025): at x_t on the canonical path,
    || v_student(x_t, t) - v_teacher(x_t, t) ||^2, where the teacher is the expert of the training image's own
    cluster (ancestral routing of the `Mixture`, each image assigned its own cluster), or the routed mixture
    itself. Both see the same class label, dropped to "none" at the student's label-dropout rate so the student
    also learns guidance."""

    def __init__(self, cfg, num_classes: int, teacher, clusters: int):
        from islands.flow.denoiser import NetworkDenoiser
        from islands.flow.paths import build_path
        from islands.flow.timesteps import TimeSampler

        self.path = build_path(cfg.flow.path, **cfg.flow.path_options())  # the student's conventions
        self.prediction = cfg.flow.prediction
        self.student = lambda net: NetworkDenoiser(net, self.path, self.prediction)
        self.times = TimeSampler(cfg.flow.time_sampler, *cfg.flow.t_range, cfg.flow.logit_mean, cfg.flow.logit_std)
        self.seed, self.num_classes, self.label_dropout = cfg.seed, num_classes, cfg.train.label_dropout
        self.teacher, self.k, self.own_cluster = teacher, clusters, teacher.routing.policy == "ancestral"

    def __call__(self, net, x0: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        pos = positions.tolist()
        noise = streams.normal(self.seed, pos, tuple(x0.shape[1:])).to(x0)
        t = self.times(streams.uniform(self.seed, pos, "time")).to(x0)
        x_t = canonical_x_t(x0, noise, t)
        cluster, cond = labels % self.k, (labels // self.k if self.num_classes else None)
        if cond is not None:
            drop = (streams.uniform(self.seed, pos, "label_drop") < self.label_dropout).to(x0.device)
            cond = torch.where(drop, torch.full_like(cond, self.num_classes), cond)
        with torch.no_grad():
            if self.own_cluster:
                self.teacher.assign(cluster)
            target = self.teacher(x_t, t, cond)
        return (self.student(net)(x_t, t, cond) - target).square().flatten(1).mean(1)
