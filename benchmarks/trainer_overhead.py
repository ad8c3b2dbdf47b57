"""What the Islands training loop costs over a bare PyTorch loop, in steady-state images/s.

Same process, same U-Net, same initial weights, batch 64, AdamW, bf16 autocast, clip at 1, no EMA in
either. Islands pays for its stream-keyed randomness (per-example noise, time and label dropout drawn
from generators keyed on each example's position), its loader, its bookkeeping and its logging; the bare
loop draws one torch.randn for the whole batch. The two are measured alternately (A B A B ...) so that
drift (thermal, other load) hits both alike; we report the median of each.

    python -m benchmarks trainer_overhead
"""

import cProfile
import io
import pstats
import sys
import tempfile

from benchmarks.common import BATCH, LR, UNET, BareLoop, build_net, islands_config, median, save, setup, table, \
    windows_throughput
from islands.train.logbook import read_metrics
from islands.train.loop import train

PRECISION = "bf16"
WINDOW_STEPS = 10  # steps per Islands log window; the first window is the warm-up
WINDOWS = 5  # so 4 measured windows, 40 steps
ROUNDS = 3  # A B A B A B
TARGET = 0.95  # Islands images/s over bare images/s


def islands_images_per_s(profile: bool = False) -> float:
    """One fresh Islands run; its images/s over all log windows but the first."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = islands_config(tmp, UNET, PRECISION, images=BATCH * WINDOW_STEPS * WINDOWS,
                             log_every=BATCH * WINDOW_STEPS)
        if profile:
            prof = cProfile.Profile()
            prof.runcall(train, cfg, progress=False)
            out = io.StringIO()
            stats = pstats.Stats(prof, stream=out)
            stats.sort_stats("tottime").print_stats(15)  # where the time goes, torch ops included
            stats.sort_stats("cumulative").print_stats(r"islands[/\\](train|data|flow)", 25)  # the loop's own code
            print(out.getvalue())
        else:
            train(cfg, progress=False)
        records = read_metrics(tmp)
    assert len(records) == WINDOWS, records
    return windows_throughput(records, skip=1)


def bare_images_per_s() -> float:
    """The bare loop, warmed up and measured over as many steps as the Islands windows."""
    loop = BareLoop(build_net(UNET), PRECISION)
    return loop.images_per_s(warmup=WINDOW_STEPS, steps=WINDOW_STEPS * (WINDOWS - 1))


def run() -> dict:
    setup()
    islands, bare = [], []
    for r in range(ROUNDS):
        islands.append(islands_images_per_s())
        bare.append(bare_images_per_s())
        print(f"  round {r + 1}/{ROUNDS}: islands {islands[-1]:.1f} img/s, bare {bare[-1]:.1f} img/s", flush=True)
    ratio = median(islands) / median(bare)
    rows = [[f"round {r + 1}", i, b, i / b] for r, (i, b) in enumerate(zip(islands, bare))]
    rows.append(["median", median(islands), median(bare), ratio])
    print(table(["", "Islands img/s", "bare img/s", "Islands / bare"], rows))
    met = ratio >= TARGET
    print(f"target Islands / bare >= {TARGET}: {'met' if met else 'NOT met'}")
    result = {
        "settings": {"model": UNET, "batch": BATCH, "precision": PRECISION, "optimizer": f"AdamW lr {LR}, weight decay 0",
                     "ema": False, "grad_clip": 1.0, "steps_measured": WINDOW_STEPS * (WINDOWS - 1),
                     "warmup_steps": WINDOW_STEPS, "rounds": ROUNDS},
        "islands_images_per_s": islands, "bare_images_per_s": bare,
        "islands_median": median(islands), "bare_median": median(bare),
        "ratio": ratio, "target": TARGET, "met": met,
    }
    save("trainer_overhead", result)
    return result


if __name__ == "__main__":
    if "--profile" in sys.argv:  # where an Islands run spends its time, by function
        setup()
        islands_images_per_s(profile=True)
    else:
        run()
