"""Feature networks behind one interface: `features(x) -> [N, D]` for images x in [-1, 1].

- `Pixels`: the flattened values (also what vectors of a Gaussian mixture are compared on).
- `ClassifierFeatures`: a small CNN that Islands trains on a labelled data set (Fashion-MNIST, MNIST 5k),
  deterministic from its seed, cached in safetensors beside the hash of the data it learned. Its 128-d
  penultimate layer stands in for Inception's pool features where no Inception weights can be had; its
  predictions give the class balance of the samples.
- `TorchFeatures`: the user's own extractor (Inception, DINOv2, ...): a function that builds the module,
  and its weights from a safetensors file, so FID proper works wherever those weights exist. Its module is imported
  only if the user's own machine trusts it (ISLANDS_TRUSTED_MODULES): a config may have come from another island.
"""

import hashlib
import importlib
import os
import re
from abc import ABC, abstractmethod
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from islands.config import ConfigError
from islands.data.fingerprint import cache_dir, data_fingerprint
from islands.data.sources import Source
from islands.errors import CheckpointError
from islands.rundir import load_weights, save_weights

BATCH = 512


class Features(ABC):
    name: str  # names the reference statistics computed with it

    @abstractmethod
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @torch.no_grad()
    def of_source(self, source: Source, progress: bool = False) -> torch.Tensor:
        out = []
        for lo in tqdm(range(0, len(source), BATCH), disable=not progress, desc=f"{self.name} features", unit="batch"):
            out.append(self(source.get(list(range(lo, min(len(source), lo + BATCH))))[0]))
        return torch.cat(out)


class Pixels(Features):
    name = "pixels"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1).float()


class Classifier(nn.Module):
    """Three convolutions (the last two stride 2), global average pooling: 128 features, then a linear head."""

    def __init__(self, channels: int, num_classes: int, width: int = 32, dim: int = 128):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1), nn.GroupNorm(8, width), nn.SiLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.GroupNorm(8, 2 * width), nn.SiLU(),
            nn.Conv2d(2 * width, dim, 3, stride=2, padding=1), nn.GroupNorm(8, dim), nn.SiLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class ClassifierFeatures(Features):
    def __init__(self, net: Classifier, fingerprint: str, seed: int, epochs: int):
        self.net = net.eval()
        # everything that made the classifier: its data, seed and training length (reference statistics and
        # metrics.json entries are keyed on this name)
        self.name = f"classifier-{fingerprint[:16]}-seed{seed}-epochs{epochs}"

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.body(x.float())

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.float()).argmax(1)


def train_classifier(source: Source, seed: int = 0, epochs: int = 2, batch: int = 128, lr: float = 2e-3,
                     progress: bool = False) -> Classifier:
    """Cross-entropy with AdamW; the initial weights and the order of examples come from `seed` alone."""
    if not source.num_classes or len(source.shape) != 3:
        raise ConfigError(f"eval.features: 'classifier' needs labelled images; {source!r} has none")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        net = Classifier(source.shape[0], source.num_classes)

    def loss(chosen: torch.Tensor) -> torch.Tensor:
        x, y = source.get(chosen.tolist())
        return F.cross_entropy(net(x), y)

    return fit(net, loss, len(source), seed, epochs, batch, lr, 0.01, "training the feature classifier", progress)


def fit(net: nn.Module, loss, n: int, seed: int, epochs: int, batch: int, lr: float, weight_decay: float, desc: str,
        progress: bool = False) -> nn.Module:
    """AdamW with a one-cycle schedule over `epochs` passes of `n` examples in an order drawn from `seed`;
    `loss(indices)` is a batch's loss. A data set smaller than one batch is one batch, not zero steps."""
    batch = min(batch, n)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
    steps = epochs * (n // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    bar = tqdm(total=steps, disable=not progress, desc=desc, unit="step")
    net.train()
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen)
        for lo in range(0, n - batch + 1, batch):
            value = loss(order[lo:lo + batch])
            opt.zero_grad(set_to_none=True)
            value.backward()
            opt.step()
            sched.step()
            bar.update()
    bar.close()
    return net.eval()


def accuracy(net: Classifier, source: Source) -> float:
    features = ClassifierFeatures(net, "", 0, 0)
    correct = 0
    for lo in range(0, len(source), BATCH):
        x, y = source.get(list(range(lo, min(len(source), lo + BATCH))))
        correct += int((features.predict(x) == y).sum())
    return correct / len(source)


def cached_or_trained(path: Path, fingerprint: str, empty: nn.Module, train, metadata: dict) -> nn.Module:
    """`empty` given the weights cached at `path` for the data of `fingerprint`, or the network `train()` returns,
    cached there under the fingerprint and `metadata`."""
    if path.exists():
        with safe_open(str(path), "pt") as f:
            cached_for = (f.metadata() or {}).get("data_sha256")
        if cached_for == fingerprint:
            empty.load_state_dict(load_weights(path))
            return empty
    net = train()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_weights(net.state_dict(), path, {"data_sha256": fingerprint, **metadata})
    return net


def load_classifier(source: Source, seed: int = 0, epochs: int = 2, progress: bool = False) -> ClassifierFeatures:
    """The classifier for this exact data (by hash) and seed: from the cache, or trained and cached."""
    fingerprint = data_fingerprint(source)
    path = cache_dir() / "classifiers" / f"{fingerprint[:16]}-seed{seed}-epochs{epochs}.safetensors"
    with torch.random.fork_rng():  # evaluating during training must not move the run's random numbers
        empty = Classifier(source.shape[0], source.num_classes)
    net = cached_or_trained(path, fingerprint, empty, lambda: train_classifier(source, seed, epochs, progress=progress),
                            {"seed": seed, "epochs": epochs})
    return ClassifierFeatures(net, fingerprint, seed, epochs)


class TorchFeatures(Features):
    """A user's feature network: called on x in [-1, 1], resized to `size` and repeated to `channels`."""

    def __init__(self, net: nn.Module, name: str, size: int | None = None, channels: int | None = None):
        self.net, self.name, self.size, self.channels = net.eval(), name, size, channels

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.channels and x.shape[1] != self.channels:
            x = x.expand(-1, self.channels, -1, -1) if x.shape[1] == 1 else x[:, :self.channels]
        if self.size and x.shape[-1] != self.size:
            x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False)
        return self.net(x).flatten(1)


# the allow-list of feature modules, set by the user on their own machine: comma-separated module names, each also
# trusting the modules below it ("torchvision" trusts "torchvision.models")
TRUSTED_MODULES = "ISLANDS_TRUSTED_MODULES"
FACTORY = re.compile(r"(?P<module>[A-Za-z_]\w*(\.[A-Za-z_]\w*)*):(?P<function>[A-Za-z_]\w*)")


def trusted_modules() -> list[str]:
    return [name.strip() for name in os.environ.get(TRUSTED_MODULES, "").split(",") if name.strip()]


def trusted_factory(factory: str, key: str = "eval.feature_net") -> tuple[str, str]:
    """`factory` ('package.module:function') as (module, function), refused in one line unless its module is one the
    user trusts here: a config names code, and a config may have come from another island."""
    found = FACTORY.fullmatch(factory)
    if found is None:
        raise ConfigError(f"{key}: {factory!r} is not 'package.module:function'")
    module, trusted = found["module"], trusted_modules()
    if not any(module == name or module.startswith(f"{name}.") for name in trusted):
        raise ConfigError(f"{key}: {factory!r} names module {module!r}, which this machine does not trust to be "
                          f"imported: if you trust it, set {TRUSTED_MODULES}={','.join([*trusted, module])}")
    return module, found["function"]


def load_torch_features(factory: str, weights: str | Path, size: int | None = None,
                        channels: int | None = None) -> TorchFeatures:
    """`factory` is 'package.module:function' returning the module, a module the user trusts; `weights` a safetensors
    file."""
    module_name, function = trusted_factory(factory)
    try:
        build = getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"eval.feature_net: cannot import {factory!r} ({err})") from None
    net = build()
    state = load_weights(Path(weights))  # safetensors only: an extractor's weights are never unpickled
    missing, unexpected = net.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{weights} does not fit {factory}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    digest = hashlib.sha256(Path(weights).read_bytes()).hexdigest()
    # everything that changes the features: the factory (module and function), its weights, and the input's size
    # and channels
    name = f"torch-{module_name}.{function}-{digest[:16]}"
    name += (f"-size{size}" if size else "") + (f"-channels{channels}" if channels else "")
    return TorchFeatures(net, name, size, channels)
