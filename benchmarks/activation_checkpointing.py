"""Activation checkpointing (`checkpoint_blocks`) on the small U-Net at batch 64: memory and step time.

A CPU has no torch.cuda.max_memory_allocated, so activation memory is measured two ways:

1. Saved for backward: a `saved_tensors_hooks` pack hook sees every tensor autograd keeps for the
   backward pass; we sum the bytes of their distinct storages, parameters excluded, at the end of the
   forward pass. Under non-reentrant checkpointing the ops inside a block are packed by the checkpoint's
   own (innermost) hook, which keeps nothing, so ours sees only what survives: each block's inputs and
   what the layers outside the blocks save. We check exactly that: every block input must be among the
   saved storages.
2. Peak RSS: in a fresh subprocess per variant, the growth of the resident set over one whole training
   step (forward, backward with its recomputation, clip, AdamW) above the resident set just before it,
   gradients freed. glibc's mmap threshold is pinned so that every large tensor gets its own mapping and
   goes back to the OS when freed: the RSS then follows live memory instead of the heap's high water.

Step time is measured in this process, the two variants alternating step by step (A B A B ...): this
2-core VM's speed jumps between two levels 1.5x apart every few seconds, so only steps taken back to back
compare. We report the median step of each and the median ratio over the pairs.

    python -m benchmarks activation_checkpointing
"""

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.autograd.graph import saved_tensors_hooks

from benchmarks.common import BATCH, UNET, BareLoop, build_net, measure, median, save, setup, table
from islands.parallel.activation_checkpointing import checkpoint_blocks

PRECISION = "bf16"
VARIANTS = ("plain", "checkpointed")
WARMUP, STEPS = 3, 20  # step time: 3 warm-up steps of each variant, then 20 timed steps of each, alternating
RSS_REPEATS = 3
TARGET = 0.40  # at least 40% less activation memory
MIB = 2**20


def make_loop(variant: str) -> BareLoop:
    net = build_net(UNET)
    if variant == "checkpointed":
        checkpoint_blocks(net)
    return BareLoop(net, PRECISION)


def saved_for_backward(variant: str) -> dict:
    """Bytes of the distinct storages autograd keeps after one forward pass, and of the blocks' inputs."""
    loop = make_loop(variant)
    params = {p.untyped_storage().data_ptr() for p in loop.net.parameters()}
    saved, inputs = {}, {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    def record_inputs(module, args):
        for a in args:
            if isinstance(a, torch.Tensor):
                inputs[a.untyped_storage().data_ptr()] = a.untyped_storage().nbytes()

    hooks = [block.register_forward_pre_hook(record_inputs) for block in loop.net.blocks]
    torch.manual_seed(1)
    with saved_tensors_hooks(pack, lambda t: t):
        loss = loop.loss()
    for h in hooks:
        h.remove()
    del loss  # drops the graph, and with it everything saved
    missing = set(inputs) - set(saved)
    return {"saved_bytes": sum(saved.values()), "saved_tensors": len(saved),
            "block_input_bytes": sum(inputs.values()), "block_inputs_saved": not missing}


def same_gradients() -> float:
    """Largest gradient difference between the variants on one batch: checkpointing must not change them."""
    grads = []
    for variant in VARIANTS:
        loop = make_loop(variant)
        torch.manual_seed(1)
        loop.loss().backward()
        grads.append([p.grad for p in loop.params])
    return max((a - b).abs().max().item() for a, b in zip(*grads, strict=True))


def rss_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(variant: str) -> None:
    """In a fresh process: RSS growth over one training step, above the RSS just before it."""
    setup()
    loop = make_loop(variant)
    for _ in range(WARMUP):  # optimizer state, oneDNN kernels and the like exist before we measure
        loop.step()
    growth = []
    for _ in range(RSS_REPEATS):
        loop.opt.zero_grad(set_to_none=True)
        gc.collect()
        before = rss_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak RSS, to the current RSS
        loop.step()
        growth.append((rss_kib("VmHWM") - before) * 1024)
    print(json.dumps({"peak_growth_bytes": median(growth), "all": growth}))


def peak_rss_growth(variant: str) -> int:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")  # fixed: no dynamic threshold growth
    out = subprocess.run([sys.executable, "-m", "benchmarks.activation_checkpointing", "--child", variant],
                         env=env, cwd=Path(__file__).parent.parent, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_growth_bytes"]


def step_seconds() -> dict:
    """Seconds per training step of each variant, the two alternating step by step."""
    loops = {v: make_loop(v) for v in VARIANTS}
    times = {v: [] for v in VARIANTS}
    for i in range(WARMUP + STEPS):
        for variant, loop in loops.items():
            t0 = time.perf_counter()
            loop.step()
            if i >= WARMUP:
                times[variant].append(time.perf_counter() - t0)
    return times


def run() -> dict:
    setup()
    saved = {v: saved_for_backward(v) for v in VARIANTS}
    assert saved["checkpointed"]["block_inputs_saved"], "a checkpointed block's input was not saved for backward"
    peak = {v: peak_rss_growth(v) for v in VARIANTS}
    grad_diff = same_gradients()
    times, others = measure("step time", step_seconds)
    step = {v: median(times[v]) for v in VARIANTS}
    step_ratio = median([c / p for p, c in zip(times["plain"], times["checkpointed"], strict=True)])

    def row(what, plain, ckpt):
        return [what, plain / MIB, ckpt / MIB, ckpt / plain, f"{1 - ckpt / plain:.0%}"]

    rows = [row("saved for backward (MiB)", *(saved[v]["saved_bytes"] for v in VARIANTS)),
            row("peak RSS growth over a step (MiB)", *(peak[v] for v in VARIANTS)),
            ["step time (ms, median)", 1e3 * step["plain"], 1e3 * step["checkpointed"], step_ratio, ""]]
    print(table(["", "plain", "checkpointed", "ckpt / plain", "reduction"], rows))
    ck = saved["checkpointed"]
    print(f"checkpointed: {ck['saved_tensors']} tensors saved, {ck['saved_bytes'] / MIB:.1f} MiB, of which block "
          f"inputs {ck['block_input_bytes'] / MIB:.1f} MiB (all saved: {ck['block_inputs_saved']}); "
          f"largest gradient difference vs plain: {grad_diff:.2e}")
    reduction = {"saved_for_backward": 1 - saved["checkpointed"]["saved_bytes"] / saved["plain"]["saved_bytes"],
                 "peak_rss_growth": 1 - peak["checkpointed"] / peak["plain"]}
    met = min(reduction.values()) >= TARGET
    print(f"target >= {TARGET:.0%} less activation memory (both measures): {'met' if met else 'NOT met'}")
    result = {"settings": {"model": UNET, "batch": BATCH, "precision": PRECISION, "step": "bare loop step",
                           "warmup_steps": WARMUP, "timed_steps": STEPS},
              "saved_for_backward": saved, "peak_rss_growth_bytes": peak, "step_seconds": times,
              "step_seconds_median": step, "step_time_ratio": step_ratio,
              "reduction": reduction, "max_grad_difference": grad_diff, "target": TARGET, "met": met,
              "others_cpu_share": others}
    save("activation_checkpointing", result)
    return result


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        run()
