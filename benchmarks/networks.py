"""Islands' U-Net and DiT against diffusers' networks of the same size: one training step each, side by side.

The peers are diffusers' `UNet2DModel` (32-64-64 channels, one layer per block, attention at 7x7, class
embeddings) and `DiTTransformer2DModel` (patch 2, width 192, 6 layers, 3 heads, adaLN-Zero), against the
benchmarks' small U-Net and DiT (benchmarks/common.py), all on 1x28x28 digits with 10 classes. A step is what
the trainer does: bf16 autocast, rectified-flow velocity loss, backward, AdamW, batch 64.

- Seconds per step: the networks alternate step by step (A B A B ...), so this VM's speed jumps cancel in the
  ratio; the median step of each and the median of the per-pair ratios.
- GFLOP/s: the step's FLOPs (forward and backward, torch.utils.flop_counter on one step) over the median step.
- MFU: GFLOP/s over this machine's bf16 matmul peak, measured in the same run (the best of large square
  matmuls under the same thread count); and, since the VM's speed jumps, each step's GFLOP/s over that of a
  2048-square bf16 matmul timed just before it, times the probe's best rate (the median over steps: "beside
  probe", what the targets use).
- Compiled: `train.compile` (torch.compile of each block, as the strategy applies it) for Islands, and
  torch.compile of the whole model for the peer, each against the other, after their compilation.

    python -m benchmarks networks
"""

import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.common import BATCH, DIT, LR, THREADS, UNET, build_net, measure, median, mnist, save, setup, table
from islands.parallel.strategies import compile_blocks

WARMUP, PAIRS = 3, 12
COMPILED_PAIRS = 8
TARGETS = {"unet": 0.35, "dit": 0.55}  # MFU, compiled allowed; and Islands' GFLOP/s at least the peer's


def diffusers_unet() -> torch.nn.Module:
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    return UNet2DModel(sample_size=28, in_channels=1, out_channels=1, block_out_channels=(32, 64, 64),
                       layers_per_block=1, down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D", "UpBlock2D"), num_class_embeds=11,
                       attention_head_dim=16, norm_num_groups=32)


def diffusers_dit() -> torch.nn.Module:
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(0)
    return DiTTransformer2DModel(num_attention_heads=3, attention_head_dim=64, in_channels=1, out_channels=1,
                                 num_layers=6, sample_size=28, patch_size=2, num_embeds_ada_norm=11)


def islands_call(net):
    return lambda x, t, y: net(x, t, y)


def unet_call(net):  # diffusers' networks take timesteps in [0, 1000) and return an output object
    return lambda x, t, y: net(x, 1000 * t, class_labels=y).sample


def dit_call(net):
    return lambda x, t, y: net(x, timestep=1000 * t, class_labels=y).sample


class Step:
    """One training step of a network: a fixed batch (data movement is not what is measured), bf16 autocast,
    the velocity loss, backward, AdamW."""

    def __init__(self, net: torch.nn.Module, call, batch: int = BATCH):
        images, labels = mnist()
        g = torch.Generator().manual_seed(0)
        self.net, self.call = net.train(), call(net)
        self.opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0)
        x0 = images[:batch]
        noise = torch.randn(x0.shape, generator=g)
        self.t = torch.rand(batch, generator=g)
        self.x = (1 - self.t.view(-1, 1, 1, 1)) * x0 + self.t.view(-1, 1, 1, 1) * noise
        self.y, self.target = labels[:batch], noise - x0

    def loss(self) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = self.call(self.x, self.t, self.y)
        return (out.float() - self.target).square().mean()

    def __call__(self) -> float:
        start = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        self.loss().backward()
        self.opt.step()
        return time.perf_counter() - start

    def flops(self) -> float:
        """Forward and backward of one step, counted by torch (the optimizer's elementwise work is not)."""
        with FlopCounterMode(display=False) as counter:
            self.loss().backward()
        self.opt.zero_grad(set_to_none=True)
        return counter.get_total_flops()


def matmul_peak(sizes=(1024, 2048, 3072), repeats: int = 8) -> float:
    """This machine's bf16 matmul GFLOP/s: the best of `repeats` timings of square matmuls of each size."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
        a @ b  # warm-up
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = max(best, 2 * n**3 / (time.perf_counter() - start) / 1e9)
    return best


def probe_rate(n: int = 2048) -> float:
    """GFLOP/s of one bf16 matmul of size n, about 40 ms: what the machine can do at this moment."""
    a, b = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
    start = time.perf_counter()
    a @ b
    return 2 * n**3 / (time.perf_counter() - start) / 1e9


def alternated(steps: dict, flops: dict, pairs: int) -> dict:
    """Median seconds per step of each, alternating, after WARMUP rounds; the median per-round ratio; and the
    median over steps of the step's GFLOP/s over a probe matmul's timed just before it, times the best probe's
    rate: the step against the best the probe ever did, scaled by the machine's speed at that moment. This VM's
    speed jumps between two levels 1.5x apart every few seconds, so a step set against the best matmul of another
    moment reads up to 1.5x low; beside its probe the jump cancels, as it does in the ratio."""
    seconds, over_probe, rates = {name: [] for name in steps}, {name: [] for name in steps}, []
    for i in range(WARMUP + pairs):
        for name, step in steps.items():
            rates.append(probe_rate())
            s = step()
            if i >= WARMUP:
                seconds[name].append(s)
                over_probe[name].append(flops[name] / s / 1e9 / rates[-1])
    islands, peer = seconds
    ratios = [p / s for s, p in zip(seconds[islands], seconds[peer], strict=True)]
    return {"seconds": {name: median(v) for name, v in seconds.items()}, "peer_over_islands": median(ratios),
            "gflop_per_s_beside_probe": {name: median(v) * max(rates) for name, v in over_probe.items()},
            "probe_best_gflop_per_s": max(rates)}


def compare(name: str, ours, peer, compiled: bool) -> dict:
    steps = {"islands": Step(*ours), "diffusers": Step(*peer)}
    flops = {k: step.flops() for k, step in steps.items()}
    if compiled:
        compile_blocks(steps["islands"].net)  # what train.compile does
        steps["diffusers"].net.compile()
        for step in steps.values():  # compilation happens here, outside the timed steps
            for _ in range(2):
                step()
    timed, busy = measure(f"{name} {'compiled' if compiled else 'eager'}",
                          lambda: alternated(steps, flops, COMPILED_PAIRS if compiled else PAIRS))
    params = {k: sum(p.numel() for p in step.net.parameters()) for k, step in steps.items()}
    gflops = {k: flops[k] / timed["seconds"][k] / 1e9 for k in steps}
    return {"params": params, "flops_per_step": flops, **timed, "gflop_per_s": gflops, "others_cpu_share": busy}


def run() -> dict:
    setup()
    peak, busy = measure("bf16 matmul peak", matmul_peak)
    print(f"  bf16 matmul peak: {peak:.0f} GFLOP/s ({THREADS} threads)", flush=True)
    builders = {"unet": (lambda: (build_net(UNET), islands_call), lambda: (diffusers_unet(), unet_call)),
                "dit": (lambda: (build_net(DIT), islands_call), lambda: (diffusers_dit(), dit_call))}
    figures, rows = {}, []
    for compiled in (False, True):
        for net, (ours, peer) in builders.items():
            key = f"{net} {'compiled' if compiled else 'eager'}"
            f = figures[key] = compare(key, ours(), peer(), compiled)  # fresh networks for each comparison
            mfu = f["mfu"] = {k: g / peak for k, g in f["gflop_per_s"].items()}
            # against the larger of the two peaks: the probe's best can exceed the peak measured at the start
            top = max(peak, f["probe_best_gflop_per_s"])
            f["mfu_beside_probe"] = {k: g / top for k, g in f["gflop_per_s_beside_probe"].items()}
            rows.append([key, f"{f['params']['islands'] / 1e6:.2f} / {f['params']['diffusers'] / 1e6:.2f}",
                         f"{f['flops_per_step']['islands'] / 1e9:.1f} / {f['flops_per_step']['diffusers'] / 1e9:.1f}",
                         1e3 * f["seconds"]["islands"], 1e3 * f["seconds"]["diffusers"], f["peer_over_islands"],
                         f["gflop_per_s"]["islands"], f["gflop_per_s"]["diffusers"], mfu["islands"], mfu["diffusers"],
                         f["mfu_beside_probe"]["islands"], f["mfu_beside_probe"]["diffusers"]])
            print(f"  {key}: Islands {1e3 * f['seconds']['islands']:.0f} ms, diffusers "
                  f"{1e3 * f['seconds']['diffusers']:.0f} ms per step", flush=True)
    print(table(["network", "params M (ours / peer)", "GFLOP/step (ours / peer)", "Islands ms/step",
                 "diffusers ms/step", "peer / Islands time", "Islands GFLOP/s", "diffusers GFLOP/s", "Islands MFU",
                 "diffusers MFU", "Islands MFU beside probe", "diffusers MFU beside probe"], rows))
    verdicts = {}
    for net, target in TARGETS.items():
        best = max(figures[f"{net} {mode}"]["mfu_beside_probe"]["islands"] for mode in ("eager", "compiled"))
        faster = all(figures[f"{net} {mode}"]["gflop_per_s"]["islands"] >= figures[f"{net} {mode}"]["gflop_per_s"][
            "diffusers"] for mode in ("eager", "compiled"))
        verdicts[net] = {"best_mfu": best, "mfu_target": target, "mfu_met": best >= target,
                         "at_least_peer_gflops": faster}
        print(f"target {net}: MFU beside the probe >= {target} ({best:.3f}: {'met' if best >= target else 'NOT met'}); "
              f"GFLOP/s at least the peer's, eager and compiled: {'met' if faster else 'NOT met'}")
    met = all(v["mfu_met"] and v["at_least_peer_gflops"] for v in verdicts.values())
    result = {"settings": {"batch": BATCH, "precision": "bf16 autocast", "threads": THREADS, "pairs": PAIRS,
                           "compiled_pairs": COMPILED_PAIRS, "warmup": WARMUP, "islands": {"unet": UNET, "dit": DIT}},
              "matmul_peak_gflop_per_s": peak, "peak_others_cpu_share": busy, "figures": figures,
              "verdicts": verdicts, "met": met}
    save("networks", result)
    return result


if __name__ == "__main__":
    run()
