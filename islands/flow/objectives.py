"""Training objective: regress the network's own prediction target on its own path."""

from torch import Tensor, nn

from islands.flow.denoiser import broadcast, prediction_target
from islands.flow.paths import Path


def training_loss(
    net: nn.Module, path: Path, prediction: str, x0: Tensor, noise: Tensor, tau: Tensor, cond: Tensor | None = None
) -> Tensor:
    """Per-sample mean squared error (B,), as in DDPM (Ho et al. 2020, eq. 14) and flow matching
    (Lipman et al. 2022, eq. 23): the target is eps, x0 or d x_tau / d tau for the path's own time tau."""
    x = broadcast(path.alpha(tau), x0) * x0 + broadcast(path.sigma(tau), x0) * noise
    out = net(x, tau, cond)
    target = prediction_target(path, prediction, x0, noise, tau)
    return (out.float() - target.float()).square().flatten(1).mean(1)
