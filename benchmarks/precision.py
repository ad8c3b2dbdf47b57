"""bf16 autocast versus fp32: images/s and loss curves, for the small U-Net and the small DiT.

Each network is trained twice through `islands.train.loop.train` on MNIST 5k for the same number of
images. Both runs see the same examples with the same noise and times (all keyed on stream position),
from the same initial weights, so the two loss curves differ by precision alone.

    python -m benchmarks precision
"""

import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks.common import BATCH, DIT, FIGURES, UNET, islands_config, save, setup, table, windows_throughput
from islands.train.logbook import read_metrics
from islands.train.loop import train

NETWORKS = {"unet": (UNET, 4096), "dit": (DIT, 2560)}  # (model, training images): the DiT step is ~5x dearer
LOG_EVERY = 3 * BATCH  # a loss point every 3 steps
TAIL = 0.25  # final loss: the mean over the last quarter of the windows
LOSS_TOLERANCE = 0.05  # bf16's final loss within 5% of fp32's


def train_run(model: dict, precision: str, images: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        train(islands_config(tmp, model, precision, images=images, log_every=LOG_EVERY), progress=False)
        return read_metrics(tmp)


def final_loss(records: list[dict]) -> float:
    tail = records[-max(1, round(TAIL * len(records))):]
    return sum(r["loss"] for r in tail) / len(tail)


def plot(curves: dict, path) -> None:
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.6))
    for ax, (name, runs) in zip(axes, curves.items()):
        for precision, records in runs.items():
            label = f"{precision} ({windows_throughput(records):.0f} img/s)"
            ax.plot([r["images"] for r in records], [r["loss"] for r in records], label=label,
                    lw=1.5, ls="-" if precision == "fp32" else "--")
        ax.set(title=name, xlabel="training images", ylabel=f"loss (mean over {LOG_EVERY // BATCH} steps)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"bf16 autocast vs fp32, MNIST 5k, batch {BATCH}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run() -> dict:
    setup()
    curves, rows, figures = {}, [], {}
    for name, (model, images) in NETWORKS.items():
        curves[name] = {}
        for precision in ("fp32", "bf16"):
            curves[name][precision] = train_run(model, precision, images)
            print(f"  {name} {precision}: {windows_throughput(curves[name][precision]):.1f} img/s", flush=True)
        speed = {p: windows_throughput(curves[name][p]) for p in ("fp32", "bf16")}
        loss = {p: final_loss(curves[name][p]) for p in ("fp32", "bf16")}
        figures[name] = {"images": images, "images_per_s": speed, "final_loss": loss,
                         "speedup": speed["bf16"] / speed["fp32"], "loss_ratio": loss["bf16"] / loss["fp32"],
                         "curves": {p: [[r["images"], r["loss"]] for r in curves[name][p]] for p in ("fp32", "bf16")}}
        f = figures[name]
        rows.append([name, images, speed["fp32"], speed["bf16"], f["speedup"], loss["fp32"], loss["bf16"],
                     f["loss_ratio"]])
    print(table(["net", "images", "fp32 img/s", "bf16 img/s", "bf16 / fp32", "fp32 final loss",
                 "bf16 final loss", "bf16 / fp32 loss"], rows))
    met = all(f["speedup"] > 1 and abs(f["loss_ratio"] - 1) <= LOSS_TOLERANCE for f in figures.values())
    print(f"target bf16 faster than fp32 with final loss within {LOSS_TOLERANCE:.0%}: {'met' if met else 'NOT met'}")
    png = FIGURES / "precision_loss.png"
    plot(curves, png)
    print(f"loss curves: {png}")
    result = {"settings": {"networks": {n: m for n, (m, _) in NETWORKS.items()}, "batch": BATCH,
                           "log_every": LOG_EVERY, "final_loss": f"mean over the last {TAIL:.0%} of log windows",
                           "images_per_s": "all log windows but the first"},
              "networks": figures, "target": f"bf16/fp32 images/s > 1 and final loss within {LOSS_TOLERANCE:.0%}",
              "met": met, "figure": "docs/figures/precision_loss.png"}
    save("precision", result)
    return result


if __name__ == "__main__":
    run()
