"""Training that synchronises rarely, on Fashion-MNIST (issue 14): sample quality against the bytes each rank sent,
for DDP, local SGD and DiLoCo at several H, pseudo-gradients in fp32 and bf16, streaming DiLoCo, and a
decentralized ensemble that sends nothing, all at the same training images.

Every run is ddm_fashion's monolith (the class-conditional U-Net at batch 128, bf16, EMA) on 2 gloo ranks of one
thread each; only `parallel` changes. Bytes are what the ledger counted (communication.json, per rank, the whole
run). Quality is FD and KID on the evaluation's classifier features, 1000 samples of Heun with 16 steps. The
decentralized ensemble is `islands ddm` with K = 2 experts of half the batch each, for the same images, and a router
(4% of their FLOPs), sampled with ancestral routing.

Target (issue 14): DiLoCo at H = 100 with bf16 pseudo-gradients within 10% of DDP's FD while sending at least 100x
fewer bytes. DDP and that run are then trained again for LONGER epochs (more outer rounds), to see the trend.

The runs live in runs/benchmarks/local_updates: a rerun continues where an interrupted one stopped.

    python -m benchmarks local_updates
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from benchmarks.common import FIGURES, cached, save, table
from benchmarks.ddm_fashion import config as fashion_config
from islands.config import validate
from islands.ddm.members import images_done
from islands.ddm.pipeline import sample_and_evaluate
from islands.eval.evaluate import evaluate_target
from islands.parallel.launch import free_port

WORK = Path("runs/benchmarks/local_updates")
IMAGES = 60_000  # one epoch: 469 steps of 128 images
RUNS = {"ddp": {"strategy": "ddp"},
        **{f"local_sgd H={h}": {"strategy": "local_sgd", "sync_every": h} for h in (10, 50, 200)},
        **{f"diloco H={h} fp32": {"strategy": "diloco", "sync_every": h} for h in (10, 50, 100, 200)},
        **{f"diloco H={h} bf16": {"strategy": "diloco", "sync_every": h, "compression": "bf16"}
           for h in (10, 50, 100, 200)},
        "streaming diloco H=100 F=4 bf16": {"strategy": "diloco", "sync_every": 100, "fragments": 4,
                                            "compression": "bf16"}}
ENSEMBLE, ROUTING = "ddm K=2", "ancestral"
TARGET_RUN, FD_SLACK, BYTES_FACTOR = "diloco H=100 bf16", 1.10, 100
# One epoch is 4 outer rounds at H = 100, where DiLoCo's recipe is tuned on hundreds: DDP and the target's run again
# at LONGER epochs, to see which way the gap moves with the number of rounds.
LONGER = 3


def name_of(label: str) -> str:
    return label.replace(" ", "_").replace("=", "")


def trained(label: str, parallel: dict, images: int = IMAGES) -> Path:
    """The 2-rank run `label` (resumed, or nothing done, if it was trained before)."""
    cfg = {**fashion_config(WORK / name_of(label), images=images), "parallel": parallel}
    cfg["train"]["checkpoint_every"] = images // 4
    if images_done(Path(cfg["run_dir"])) >= images:
        return Path(cfg["run_dir"])
    path = WORK / f"{name_of(label)}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "islands", "train", str(path), "--quiet"]
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=4 * 3600)
    assert done.returncode == 0, done.stderr[-3000:]
    return Path(cfg["run_dir"])


def ensemble() -> dict:
    """`islands ddm` with K = 2 at the same images: the experts and the router never communicate."""
    cfg = fashion_config(WORK / name_of(ENSEMBLE), "kmeans", 2, IMAGES)
    path = WORK / f"{name_of(ENSEMBLE)}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    done = subprocess.run([sys.executable, "-m", "islands", "ddm", str(path), "--jobs", "2", "--quiet"],
                          capture_output=True, text=True, timeout=4 * 3600)
    assert done.returncode == 0, done.stderr[-3000:]
    return sample_and_evaluate(validate(cfg), ROUTING, False)


def sent_bytes(run_dir: Path) -> float:
    """Bytes one rank sent over the whole run, every collective together."""
    return sum(json.loads((run_dir / "communication.json").read_text())["total_bytes"].values())


def run() -> dict:
    WORK.mkdir(parents=True, exist_ok=True)
    found = {}
    for label, parallel in RUNS.items():
        run_dir = trained(label, parallel)
        metrics = cached(WORK / "evaluations.json", f"{label} images={IMAGES}",
                         lambda: evaluate_target(run_dir, progress=False)[0])
        found[label] = {"fd": metrics["fd"], "kid": metrics["kid"], "bytes": sent_bytes(run_dir)}
        print(f"  {label}: FD {found[label]['fd']:.3f}, {found[label]['bytes'] / 2**20:.1f} MiB sent per rank",
              flush=True)
    metrics = cached(WORK / "evaluations.json", f"{ENSEMBLE} images={IMAGES}", ensemble)
    found[ENSEMBLE] = {"fd": metrics["fd"], "kid": metrics["kid"], "bytes": 0.0}
    ddp = found["ddp"]
    rows = [[label, r["fd"], 1e3 * r["kid"], r["fd"] / ddp["fd"], r["bytes"] / 2**20,
             ddp["bytes"] / r["bytes"] if r["bytes"] else float("inf")] for label, r in found.items()]
    print(table(["run", "FD", "KID x1e3", "FD vs ddp", "MiB sent per rank", "ddp's bytes / these"], rows))
    target = found[TARGET_RUN]
    met = target["fd"] <= FD_SLACK * ddp["fd"] and target["bytes"] * BYTES_FACTOR <= ddp["bytes"]
    print(f"{TARGET_RUN}: FD {target['fd']:.3f} against ddp's {ddp['fd']:.3f} ({target['fd'] / ddp['fd']:.3f}x, "
          f"target <= {FD_SLACK}), {ddp['bytes'] / target['bytes']:.0f}x fewer bytes (target >= {BYTES_FACTOR}): "
          f"{'met' if met else 'NOT met'}")
    longer = {}
    for label in ("ddp", TARGET_RUN):
        run_dir = trained(f"{label} x{LONGER}", RUNS[label], LONGER * IMAGES)
        metrics = cached(WORK / "evaluations.json", f"{label} images={LONGER * IMAGES}",
                         lambda: evaluate_target(run_dir, progress=False)[0])
        longer[label] = {"fd": metrics["fd"], "kid": metrics["kid"], "bytes": sent_bytes(run_dir)}
    ratio = longer[TARGET_RUN]["fd"] / longer["ddp"]["fd"]
    print(f"at {LONGER}x the images: ddp FD {longer['ddp']['fd']:.3f}, {TARGET_RUN} FD "
          f"{longer[TARGET_RUN]['fd']:.3f} ({ratio:.3f}x; at 1x {target['fd'] / ddp['fd']:.3f}x), "
          f"{longer['ddp']['bytes'] / longer[TARGET_RUN]['bytes']:.0f}x fewer bytes")
    figure(found)
    save("local_updates", {"results": found, "images": IMAGES, "runs": RUNS, "met": met,
                           "longer": {"images": LONGER * IMAGES, "results": longer, "fd_vs_ddp": ratio},
                           "claim": f"{TARGET_RUN} within {FD_SLACK - 1:.0%} of DDP's FD with at least "
                                    f"{BYTES_FACTOR}x fewer bytes"})
    return {"met": met}


def figure(found: dict) -> Path:
    """FD against MiB sent, one line per method through its H values, the run that sends nothing at the left edge."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    floor = min(r["bytes"] for r in found.values() if r["bytes"]) / 10  # where a run that sent nothing is drawn
    families: dict[str, list] = {}
    for label, r in found.items():
        family = " ".join(word for word in label.split() if not word.startswith("H="))
        h = next((word for word in label.split() if word.startswith("H=")), "")
        families.setdefault(family, []).append((max(r["bytes"], floor) / 2**20, r["fd"], h))
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for family, points in families.items():
        name = f"{family} (sends nothing)" if all(r == floor / 2**20 for r, _, _ in points) else family
        xs, ys, hs = zip(*sorted(points), strict=True)
        line, = ax.plot(xs, ys, "o-", label=name, color="k" if family == "ddp" else None)
        for x, y, h in zip(xs, ys, hs, strict=True):
            if h:
                ax.annotate(h, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points", color=line.get_color())
    ax.axhline(FD_SLACK * found["ddp"]["fd"], color="0.6", ls=":", lw=1, label=f"ddp's FD x {FD_SLACK}")
    ax.set(xscale="log", xlabel="MiB sent per rank over the run", ylabel="FD (classifier features)",
           title=f"Fashion-MNIST, {IMAGES} images, 2 ranks: quality against communication")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = FIGURES / "local_updates.png"
    fig.savefig(path)
    plt.close(fig)
    return path


if __name__ == "__main__":
    run()
