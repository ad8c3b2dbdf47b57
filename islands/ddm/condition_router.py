"""The condition router p(cluster | text): what ancestral routing draws a prompt's expert from.

Ancestral routing draws each sample's expert once, before the first step, and keeps it from noise to data (the
sample is then one expert's). For a class that draw comes from a table, p(cluster | class), counted from the
partition. A caption has no table: most captions are unique. The condition router is a small MLP on the caption's
pooled embedding, trained with cross-entropy against the cluster of each training example, whose softmax estimates
that table for any prompt. Its maximum-likelihood solution for a caption seen n times is the empirical share of
those n examples in each cluster, which is what the tests check it against.

It trains in seconds (full batch, on the pooled vectors alone), before the experts, from the partition and the
captions; a held-out tenth of the examples measures its calibration (condition_router.json).
"""

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from islands.rundir import atomic_write_text

ROUTER_FOLDER, ROUTER_WEIGHTS, ROUTER_REPORT = "condition_router", "model.safetensors", "condition_router.json"


class ConditionRouter(nn.Module):
    """Pooled caption embedding (n, width) -> logits over the K clusters."""

    def __init__(self, width: int, clusters: int, hidden: int = 256):
        super().__init__()
        self.width, self.clusters, self.hidden = width, clusters, hidden
        self.net = nn.Sequential(nn.Linear(width, hidden), nn.SiLU(), nn.Linear(hidden, clusters))

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.net(pooled.float())


def fit_condition_router(pooled: torch.Tensor, clusters: torch.Tensor, k: int, seed: int, held_out: float = 0.1,
                         steps: int = 600, lr: float = 3e-3, check_every: int = 20) -> tuple[ConditionRouter, dict]:
    """Trained on all but a seeded `held_out` share of the examples, full batch with Adam, and stopped early: a
    further tenth of the training examples is set aside, and the weights kept are those of the step (every
    `check_every`) with the lowest log-loss on it (full batch overfits unique captions, and an overconfident router
    would send every sample of a prompt to one expert). -> (the router, its calibration on the held-out examples)."""
    n = len(pooled)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    kept, held = order[math.ceil(held_out * n):], order[:math.ceil(held_out * n)]
    fit, stop = (kept[len(kept) // 10:], kept[:len(kept) // 10]) if len(kept) >= 20 else (kept, kept)
    with torch.random.fork_rng(devices=[]):  # its initial weights from the seed, the caller's RNG left as it was
        torch.manual_seed(seed)
        router = ConditionRouter(pooled.shape[1], k)
    opt = torch.optim.Adam(router.parameters(), lr=lr)
    x, y = pooled[fit].float(), clusters[fit].long()
    best, best_state = math.inf, None
    for step in range(steps + 1):
        if step % check_every == 0 or step == steps:
            with torch.no_grad():
                loss = F.cross_entropy(router(pooled[stop].float()), clusters[stop].long()).item()
            if loss < best:
                best, best_state = loss, {name: t.clone() for name, t in router.state_dict().items()}
        if step == steps:
            break
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(router(x), y).backward()
        opt.step()
    router.load_state_dict(best_state)
    router.eval().requires_grad_(False)
    return router, calibration(router, pooled[held].float(), clusters[held].long(), clusters[kept].long(), k)


def calibration(router: ConditionRouter, pooled: torch.Tensor, clusters: torch.Tensor, seen: torch.Tensor,
                k: int, bins: int = 10) -> dict:
    """On held-out examples: the mean predicted share of each cluster against the empirical one, the log-loss
    against that of the cluster sizes alone (the training examples' shares), top-1 accuracy and its expected
    calibration error."""
    if len(pooled) == 0:
        return {"held_out": 0}
    probs = router(pooled).softmax(1)
    prior = torch.bincount(seen, minlength=k).double().clamp_min(1) / len(seen)
    confidence, top = probs.max(1)
    correct = (top == clusters).double()
    ece = 0.0
    for b in range(bins):
        inside = (confidence > b / bins) & (confidence <= (b + 1) / bins)
        if inside.any():
            ece += inside.double().mean().item() * abs(correct[inside].mean().item() - confidence[inside].mean().item())
    return {"held_out": len(pooled),
            "shares_predicted": probs.mean(0).tolist(),
            "shares_empirical": (torch.bincount(clusters, minlength=k).double() / len(clusters)).tolist(),
            "log_loss": F.nll_loss(probs.clamp_min(1e-12).log(), clusters).item(),
            "prior_log_loss": -prior.log()[clusters].mean().item(),
            "accuracy": correct.mean().item(), "ece": ece}


def save_condition_router(router: ConditionRouter, root: Path, report: dict) -> Path:
    """ENSEMBLE/condition_router/: its weights (safetensors) and its sizes and calibration."""
    folder = Path(root) / ROUTER_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in router.state_dict().items()}, folder / ROUTER_WEIGHTS)
    atomic_write_text(folder / ROUTER_REPORT, json.dumps({"width": router.width, "clusters": router.clusters,
                                                   "hidden": router.hidden, "calibration": report}, indent=1))
    return folder


def condition_prior(router: ConditionRouter, pooled_width: int):
    """labels (packed captions, islands.nets.condition.pack_text) -> p(cluster | text), (n, K) float64."""

    @torch.no_grad()
    def prior(labels: torch.Tensor) -> torch.Tensor:
        return router(labels[:, 0, :pooled_width].cpu()).softmax(1).double()

    return prior
