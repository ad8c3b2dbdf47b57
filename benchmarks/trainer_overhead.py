"""What the Islands training loop costs over a bare PyTorch loop, in steady-state images/s.

Same process, same U-Net, same initial weights, batch 64, AdamW, bf16 autocast (fp32 on a CPU that emulates
bf16), clip at 1, no EMA in either. Islands pays for its stream-keyed randomness (per-example noise, time and label
dropout drawn from generators keyed on each example's position), its loader, its bookkeeping and its logging; the
bare loop draws one torch.randn for the whole batch.

This machine is a 2-core VM whose speed jumps between two levels 1.5x apart every few seconds, whatever
runs on it: two runs one after the other can differ by 50%. So the two loops alternate step by step
(A B A B ...): while `train(cfg)` runs, its loader is wrapped so that one bare step runs, timed, before
each Islands batch is handed over. For each Islands log window (from the run's metrics.jsonl) the bare
loop's time is then known to the microsecond and taken out of the window:

    bare images/s    = window images / bare seconds in the window
    Islands images/s = window images / (window seconds - bare seconds in the window)

Both figures come from the same few seconds, so the VM's jumps cancel in their ratio. The first window
is the warm-up; we report the median over the later windows of several runs.

    python -m benchmarks trainer_overhead
    python -m benchmarks.trainer_overhead --profile    # where a plain Islands run spends its time
    python -m benchmarks.trainer_overhead --profile --workers 1    # with the loader (and its draws) in a process
"""

import cProfile
import io
import pstats
import sys
import tempfile
import time
from unittest import mock

import islands.trainer.loop
from benchmarks.common import BATCH, LR, UNET, BareLoop, build_net, islands_config, measure, median, save, setup, table
from islands.parallel.launch import bf16_is_native
from islands.train.logbook import read_metrics

# bf16 where the CPU has it in hardware; where it is emulated (10x slower) the step would hide the loop's overhead,
# so fp32, the fastest step there and the hardest test of the overhead.
PRECISION = "bf16" if bf16_is_native("cpu") else "fp32"
WINDOW_STEPS = 5  # steps per Islands log window
WINDOWS = 6  # timed windows per run, after one warm-up window
RUNS = 3
TARGET = 0.95  # Islands images/s over bare images/s


class Interleaved:
    """Islands' loader, with one timed bare step before each batch it hands over."""

    def __init__(self, loader, bare: BareLoop):
        self.loader, self.bare, self.seconds = loader, bare, []

    def __iter__(self):
        for batch in self.loader:
            t0 = time.perf_counter()
            self.bare.step()
            self.seconds.append(time.perf_counter() - t0)
            yield batch


def interleaved_run() -> list[tuple[float, float]]:
    """One fresh Islands run with a fresh bare loop interleaved: (Islands, bare) images/s per later window."""
    bare = BareLoop(build_net(UNET), PRECISION)
    wrapped = []
    real_loader = islands.trainer.loop.stream_loader

    def stream_loader(*args, **kwargs):
        wrapped.append(Interleaved(real_loader(*args, **kwargs), bare))
        return wrapped[-1]

    with tempfile.TemporaryDirectory() as tmp:
        cfg = islands_config(tmp, UNET, PRECISION, images=BATCH * WINDOW_STEPS * (WINDOWS + 1),
                             log_every=BATCH * WINDOW_STEPS)
        with mock.patch.object(islands.trainer.loop, "stream_loader", stream_loader):
            islands.trainer.loop.train(cfg, progress=False)
        records = read_metrics(tmp)
    assert len(wrapped) == 1 and len(records) == WINDOWS + 1, (len(wrapped), records)
    bare_seconds = wrapped[0].seconds
    rates, start = [], 0
    for r in records:
        steps = (r["images"] - start) // BATCH
        window = (r["images"] - start) / r["images_per_s"]
        bare_window = sum(bare_seconds[start // BATCH:start // BATCH + steps])
        rates.append((steps * BATCH / (window - bare_window), steps * BATCH / bare_window))
        start = r["images"]
    return rates[1:]  # the first window is the warm-up


def profile_islands(workers: int = 0) -> None:
    """cProfile of a plain Islands run (no bare loop), its loader in `workers` processes (which cProfile does not
    see): torch ops, then the loop's own functions."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = islands_config(tmp, UNET, PRECISION, images=BATCH * WINDOW_STEPS * (WINDOWS + 1),
                             log_every=BATCH * WINDOW_STEPS)
        cfg.data.workers = workers
        prof = cProfile.Profile()
        prof.runcall(islands.trainer.loop.train, cfg, progress=False)
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(15)
    stats.sort_stats("cumulative").print_stats(r"islands[/\\](train|data|flow|parallel)", 30)
    print(out.getvalue())


def run() -> dict:
    setup()
    windows, others = [], []
    for r in range(RUNS):
        rates, busy = measure(f"run {r + 1}", interleaved_run)
        windows += rates
        others.append(busy)
        print(f"  run {r + 1}/{RUNS}: " + ", ".join(f"{i / b:.3f}" for i, b in rates) + " (Islands / bare per window)",
              flush=True)
    islands_rates, bare_rates = [i for i, _ in windows], [b for _, b in windows]
    ratios = [i / b for i, b in windows]
    # A window's two rates and their ratio belong together: the extremes are whole windows, not mixed columns.
    slowest, fastest = min(windows), max(windows)
    lowest, highest = min(windows, key=lambda w: w[0] / w[1]), max(windows, key=lambda w: w[0] / w[1])
    rows = [["median (of each column)", median(islands_rates), median(bare_rates), median(ratios)],
            ["slowest Islands window", *slowest, slowest[0] / slowest[1]],
            ["fastest Islands window", *fastest, fastest[0] / fastest[1]],
            ["lowest ratio", *lowest, lowest[0] / lowest[1]],
            ["highest ratio", *highest, highest[0] / highest[1]]]
    print(table([f"{len(windows)} windows of {WINDOW_STEPS} steps", "Islands img/s", "bare img/s",
                 "Islands / bare"], rows))
    ratio = median(ratios)
    met = ratio >= TARGET
    print(f"target Islands / bare >= {TARGET}: {'met' if met else 'NOT met'}")
    result = {
        "settings": {"model": UNET, "batch": BATCH, "precision": PRECISION,
                     "optimizer": f"AdamW lr {LR}, weight decay 0", "ema": False, "grad_clip": 1.0,
                     "time_sampler": "uniform", "label_dropout": 0.1, "window_steps": WINDOW_STEPS,
                     "windows_per_run": WINDOWS, "warmup_windows": 1, "runs": RUNS,
                     "method": "bare steps interleaved with Islands steps; median over windows"},
        "windows": [{"islands_images_per_s": i, "bare_images_per_s": b} for i, b in windows],
        "islands_median": median(islands_rates), "bare_median": median(bare_rates), "table": rows,
        "ratio": ratio, "target": TARGET, "met": met, "others_cpu_share": others,
    }
    save("trainer_overhead", result)
    return result


if __name__ == "__main__":
    setup()
    if "--profile" in sys.argv:
        profile_islands(int(sys.argv[sys.argv.index("--workers") + 1]) if "--workers" in sys.argv else 0)
    else:
        run()
