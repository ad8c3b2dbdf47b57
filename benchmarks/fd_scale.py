"""The scale generated samples are read against: Frechet distances on Fashion-MNIST.

FD of the training set (60k) against: the test set (10k), the test set with Gaussian noise of std 0.1
and 0.3 added (in [-1, 1] units, clipped), and uniform noise; with Islands' classifier features (the
default: 2 epochs on the training set, seed 0) and with raw pixels. KID is given beside FD. A model whose
samples score near FD(train, test) is as close to the data as held-out real images are.

    python -m benchmarks fd_scale
"""

import time

import torch

from benchmarks.common import save, setup, table
from islands.data.sources import FashionMnist, Source
from islands.eval import metrics
from islands.eval.features import Pixels, accuracy, load_classifier

NOISE_SEED = 0


class Corrupted(Source):
    """The test set with noise added (std `noise`), or replaced by uniform noise."""

    def __init__(self, source: Source, noise: float | None):
        self.source, self.noise = source, noise
        self.shape, self.num_classes, self.flip, self.holds = source.shape, source.num_classes, False, source.holds

    def __len__(self):
        return len(self.source)

    def read(self, indices, fields):
        got = self.source.read(indices, fields)
        g = torch.Generator().manual_seed(NOISE_SEED + indices[0])
        x = got["x"]
        got["x"] = torch.rand(x.shape, generator=g) * 2 - 1 if self.noise is None else \
            (x + self.noise * torch.randn(x.shape, generator=g)).clamp(-1, 1)
        return got


def run() -> dict:
    setup()
    train_set, test_set = FashionMnist(split="train"), FashionMnist(split="test")
    start = time.perf_counter()
    classifier = load_classifier(train_set, seed=0, epochs=2)
    classifier_s = time.perf_counter() - start
    test_accuracy = accuracy(classifier.net, test_set)
    print(f"classifier: {test_accuracy:.3f} test accuracy ({classifier_s:.0f} s, including any training)")
    candidates = {"test": test_set, "test + N(0, 0.1^2)": Corrupted(test_set, 0.1),
                  "test + N(0, 0.3^2)": Corrupted(test_set, 0.3), "uniform noise": Corrupted(test_set, None)}
    found = {}
    for features in (classifier, Pixels()):
        kind = "classifier" if features is classifier else "pixels"
        train_features = features.of_source(train_set)
        reference = metrics.feature_stats(train_features)
        order = torch.randperm(len(train_features), generator=torch.Generator().manual_seed(0))
        subset = train_features[order[:10_000]]  # KID's real side, as `islands eval` uses
        for name, source in candidates.items():
            other = features.of_source(source)
            fd = metrics.frechet_distance(metrics.feature_stats(other), reference)
            kid, kid_se = metrics.kid(subset, other)  # kid_se: the standard error of the estimate
            found[f"{kind}/{name}"] = {"fd": fd, "kid": kid, "kid_se": kid_se}
            print(f"  {kind:10s} {name:20s} FD {fd:10.3f}  KID {kid:.4f} +- {kid_se:.4f}", flush=True)
    rows = []
    for name in candidates:
        c, p = found[f"classifier/{name}"], found[f"pixels/{name}"]
        rows.append([name, c["fd"], c["fd"] / found["classifier/test"]["fd"], c["kid"],
                     p["fd"], p["fd"] / found["pixels/test"]["fd"]])
    print(table(["train vs", "FD classifier", "x test's", "KID classifier", "FD pixels", "x test's"], rows))
    save("fd_scale", {"results": found, "classifier_test_accuracy": test_accuracy, "classifier_seconds": classifier_s})
    separated = found["classifier/uniform noise"]["fd"] > 10 * found["classifier/test"]["fd"]
    return {"met": separated}


if __name__ == "__main__":
    run()
