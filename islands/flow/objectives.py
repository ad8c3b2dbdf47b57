"""Training objective: regress the network's own prediction target on its own path."""

from torch import Tensor, nn

from islands.flow.denoiser import broadcast, prediction_target
from islands.flow.paths import Path


def training_pair(path: Path, prediction: str, x0: Tensor, noise: Tensor, tau: Tensor) -> tuple[Tensor, Tensor]:
    """(x_tau, the regression target): the noised input the network sees and the eps, x0 or d x_tau / d tau it
    is asked for, on the path's own time tau."""
    x = broadcast(path.alpha(tau), x0) * x0 + broadcast(path.sigma(tau), x0) * noise
    return x, prediction_target(path, prediction, x0, noise, tau)


def regression_loss(out: Tensor, target: Tensor) -> Tensor:
    """Per-sample mean squared error (B,), in fp32 whatever precision the network ran in."""
    return (out.float() - target.float()).square().flatten(1).mean(1)


def training_loss(
    net: nn.Module, path: Path, prediction: str, x0: Tensor, noise: Tensor, tau: Tensor, cond: Tensor | None = None
) -> Tensor:
    """Per-sample mean squared error (B,), as in DDPM (Ho et al. 2020, eq. 14) and flow matching
    (Lipman et al. 2022, eq. 23): the target is eps, x0 or d x_tau / d tau for the path's own time tau."""
    x, target = training_pair(path, prediction, x0, noise, tau)
    return regression_loss(net(x, tau, cond), target)
