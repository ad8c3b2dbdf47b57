"""Routed sampling against the monolith's speed: where a mixture's time goes, at the demo's and the table's sizes.

The networks are those of `make demo` and of the ddm_fashion table: the class-conditional U-Net (1.1M parameters)
for the monolith and every expert, and the DiT router of each (hidden 64, depth 2 in the demo; 96, depth 3 in the
table), with random weights: speed does not depend on what they learned. The random router sends nearly every
sample to the same expert, the worst split there is (ancestral routing's balanced clusters are the best). Each
expert's weights are written to safetensors and loaded the way an ensemble loads them, on first use, inside the
timed sampling. Settings: the demo's (K = 4, 400 samples in batches of 256, guidance 2, Heun 12 steps: 46 network
evaluations per sample) and the table's (K = 8, one batch of 500 samples, no guidance, Heun 16 steps: 31). A
mixture draws `Mixture.samples_at_once` samples at once, as `islands` does, so that each expert's calls hold about as
many samples as the monolith's, and none more than the monolith's batch. Monolith, top-1 and ancestral routing
alternate, three rounds, on a quiet machine; the median is reported, the mean and largest samples per network
call, and for the mixtures the share of the time spent inside the experts, inside the router, and elsewhere
(loading the experts, splitting the batch, gathering the velocities). Target (issue 11): top-1 and ancestral
within 1.1x of the monolith's seconds per sample at both sizes.

    python -m benchmarks routed_sampling
"""

import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.common import UNET, measure, median, save, setup, table
from islands.conditions import network_spec
from islands.config import validate
from islands.ddm.ensemble import LearnedRouter
from islands.ddm.mixture import ExpertSlot, Mixture
from islands.flow.denoiser import NetworkDenoiser
from islands.flow.paths import build_path
from islands.generate import generate, network_with_weights
from islands.nets import build_network
from islands.rundir import load_weights

SHAPE, CLASSES, ROUNDS, TARGET = (1, 28, 28), 10, 3, 1.1
SETTINGS = {  # name: (K, samples, batch, guidance, Heun steps, router hidden size, router depth)
    "demo": (4, 400, 256, 2.0, 12, 64, 2),
    "ddm_fashion table": (8, 500, 500, 1.0, 16, 96, 3),
}
POLICIES = ("top1", "ancestral")


class Clock:
    """A callable's seconds, summed over its calls, and the samples of each call."""

    def __init__(self, fn):
        self.fn, self.seconds, self.sizes = fn, 0.0, []

    def __call__(self, *args):
        start = time.perf_counter()
        out = self.fn(*args)
        self.seconds += time.perf_counter() - start
        self.sizes.append(args[0].shape[0])
        return out


def denoiser(weights: dict | None = None) -> NetworkDenoiser:
    model = validate({"run_dir": ".", "model": dict(UNET)}).model
    net = build_network(network_spec(model, SHAPE, CLASSES)) if weights is None else \
        network_with_weights(network_spec(model, SHAPE, CLASSES), weights)
    return NetworkDenoiser(net.eval(), build_path("rectified_flow"), "velocity")


def loader(path: Path, clock: Clock):
    """An expert slot's loader: the weights read from disk when the mixture first needs the expert, timed."""
    def load():
        clock.fn = denoiser(load_weights(path))
        return clock
    return load


def router(k: int, hidden: int, depth: int) -> LearnedRouter:
    model = validate({"run_dir": ".", "model": {"arch": "router", "num_classes": CLASSES, "outputs": k,
                                                "hidden_size": hidden, "depth": depth, "patch_size": 4}}).model
    return LearnedRouter(build_network(network_spec(model, SHAPE, CLASSES)).eval())


def run() -> dict:
    setup()
    torch.manual_seed(0)
    rows, found = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (k, num, batch, guidance, steps, hidden, depth) in SETTINGS.items():
            paths = []
            for e in range(k):  # each expert's weights on disk, loaded on first use as an ensemble loads them
                paths.append(Path(tmp) / f"{name}-expert{e}.safetensors")
                save_file(denoiser().net.state_dict(), str(paths[-1]))
            opts = validate({"run_dir": ".", "sample": {"steps": steps, "solver": "heun", "guidance": guidance,
                                                        "batch_size": batch, "precision": "bf16"}}).sample
            labels = torch.arange(num) % CLASSES
            monolith, the_router = Clock(denoiser()), router(k, hidden, depth)
            seconds = {"monolith": [], **{p: [] for p in POLICIES}}
            shares = {p: [] for p in POLICIES}
            sizes = {"monolith": monolith.sizes}  # samples per network call, over all rounds
            for _ in range(ROUNDS):
                s, _ = measure(f"{name} monolith", lambda: timed(monolith, num, opts, labels))
                seconds["monolith"].append(s)
                for policy in POLICIES:
                    experts = [Clock(None) for _ in range(k)]
                    slots = [ExpertSlot(f"expert{e}", loader(paths[e], experts[e])) for e in range(k)]
                    clocked_router = Clock(the_router)
                    mixture = Mixture(slots, clocked_router, policy, call_batch=batch)
                    for_batch = None
                    if policy == "ancestral":  # balanced clusters: every expert draws a K-th of the samples
                        def for_batch(lo, hi, _labels, mixture=mixture):
                            return mixture.assigned(torch.arange(lo, hi) % k)
                    wide = opts.model_copy(update={"batch_size": mixture.samples_at_once(batch)})  # as islands does
                    s, _ = measure(f"{name} {policy}", lambda: timed(mixture, num, wide, labels, for_batch))
                    seconds[policy].append(s)
                    inside = sum(c.seconds for c in experts)
                    shares[policy].append((inside / s, clocked_router.seconds / s))
                    sizes[policy] = [n for c in experts for n in c.sizes]
            mono = median(seconds["monolith"])
            rows.append([name, "monolith", f"{1000 * mono / num:.1f}", "1.00", *calls(sizes["monolith"]), "-", "-",
                         "-"])
            found[name] = {"monolith_ms_per_sample": 1000 * mono / num}
            for policy in POLICIES:
                s = median(seconds[policy])
                expert_share = median([a for a, _ in shares[policy]])
                router_share = median([b for _, b in shares[policy]])
                found[name][policy] = {"ms_per_sample": 1000 * s / num, "ratio": s / mono,
                                       "expert_share": expert_share, "router_share": router_share,
                                       "largest_call": max(sizes[policy])}
                rows.append([name, policy, f"{1000 * s / num:.1f}", f"{s / mono:.2f}", *calls(sizes[policy]),
                             f"{expert_share:.0%}", f"{router_share:.0%}", f"{1 - expert_share - router_share:.0%}"])
                print(f"  {name} {policy}: {s / mono:.2f}x the monolith", flush=True)
    print(table(["setting", "sampler", "ms/sample", "x monolith", "mean call", "largest call", "in experts",
                 "in router", "elsewhere"], rows))
    ratios = [found[name][p]["ratio"] for name in SETTINGS for p in POLICIES]
    met = max(ratios) <= TARGET
    print(f"slowest routed sampler: {max(ratios):.2f}x the monolith (target <= {TARGET}x): "
          f"{'met' if met else 'NOT met'}")
    save("routed_sampling", {"results": found, "rounds": ROUNDS, "target": TARGET, "met": met})
    return {"met": met}


def calls(sizes: list[int]) -> list[str]:
    """The mean and the largest number of samples in one network call (one of a guided evaluation's halves)."""
    return [f"{sum(sizes) / len(sizes):.0f}", str(max(sizes))]


def timed(den, num: int, opts, labels, for_batch=None) -> float:
    start = time.perf_counter()
    generate(den, SHAPE, num, opts, 0, labels, for_batch=for_batch)
    return time.perf_counter() - start
