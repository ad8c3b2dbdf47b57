"""Decentralized experts against a monolith across training budgets (issue 40, section 1): FD against total training
FLOPs for K = 1 (the monolith), 4 and 8, at three budgets and four training seeds, on Fashion-MNIST and on the emoji.

The paper's gain grows with compute (McAllister et al. 2025, Fig. 4: the ensemble's lead widens with training
FLOPs). On this machine a budget is at most a few hundred thousand images, so the networks are small enough that
those budgets reach the regime where a model has seen its data many times over: a U-Net of 16 channels (two levels,
one residual block each). K experts of that U-Net hold K times the monolith's parameters for the same FLOPs per
image, which is where an ensemble can pull ahead; at a small budget neither has learnt its data and the ensemble's
experts, each on a K-th of it, see fewer steps' worth of each cluster. Each budget is the images the experts see
together, each expert at batch BATCH / K for the same number of steps; the router takes 4% of their FLOPs (the
paper's share) and the monolith is trained for the FLOPs of the costliest ensemble, router included (K = 8's).

Fashion-MNIST: class-conditional, partitioned by the classifier's features (semantic, issue 40's second change);
the emoji: text-conditioned by MiniLM-L6 as benchmarks/ddm_text.py, partitioned by the captions' embeddings, routed
by prompt through the condition router. A training seed changes the initialisation, the partition's k-means and the
data order. Each model samples NUM images (Heun, STEPS steps, no guidance) under ancestral routing (each sample keeps
the expert drawn once for its condition), scored by FD in islands/eval's default features against the whole set.

The runs live in runs/benchmarks/ddm_budget/DATA/seedS/bB: a rerun continues where an interrupted one stopped
(training and evaluations alike); `--data`, `--seeds` and `--budgets` run part of it.

    python -m benchmarks ddm_budget [--data fashion,emoji] [--seeds 0,1,2,3] [--budgets 8192,32768,131072]
"""

import sys
from pathlib import Path

import torch

from benchmarks.common import FIGURES, cached, ensembles_at_equal_flops, save, setup, table
from islands.ddm.pipeline import ensemble_training_flops, sample_and_evaluate, training_flops
from islands.eval.evaluate import evaluate_target

WORK = Path("runs/benchmarks/ddm_budget")
BUDGETS = (8_192, 32_768, 131_072)  # images the experts see together
KS = (4, 8)
SEEDS = (0, 1, 2, 3)
BATCH = 64
NUM, STEPS, SOLVER = 500, 16, "heun"
TARGET = 0.9  # K = 8 at <= 0.9x the monolith's FD, outside the seeds' spread
SCORING = 1  # part of every cached evaluation's key: bumped when the scoring changes
DATA = {
    "fashion": {"data": {"source": "fashion_mnist"},
                "model": {"arch": "unet", "channels": 16, "channel_mult": [1, 2], "num_res_blocks": 1,
                          "attention_resolutions": []},
                "features": "classifier"},
    "emoji": {"data": {"source": "emoji", "resolution": 32},
              "model": {"arch": "unet", "channels": 16, "channel_mult": [1, 2, 2], "num_res_blocks": 1,
                        "attention_resolutions": [8]},
              "features": "text"},
}


def config(data: str, run_dir: Path, seed: int, images: int, k: int = 0) -> dict:
    spec = DATA[data]
    cfg = {"run_dir": str(run_dir), "seed": seed, "data": dict(spec["data"]), "model": dict(spec["model"]),
           "flow": {"path": "rectified_flow", "prediction": "velocity", "time_sampler": "logit_normal"},
           "train": {"images": images, "batch_size": BATCH, "lr": 2e-3, "warmup_images": min(4096, images // 8),
                     "precision": "bf16", "ema_halflife_images": max(1024, images // 16),
                     "checkpoint_every": images, "log_every": max(1024, images // 8)},
           "sample": {"num": 64, "steps": STEPS, "solver": SOLVER, "guidance": 1.0, "batch_size": 500,
                      "precision": "bf16"},
           "eval": {"num": NUM}}
    if k:
        cfg["ddm"] = {"k": k, "partition": {"method": "kmeans", "features": spec["features"], "pca_dim": 64,
                                            "fine": 1024, "balanced": True},
                      "router": {"hidden_size": 96, "depth": 3, "num_heads": 4, "patch_size": 4,
                                 "batch_size": BATCH, "lr": 1e-3}}
    return cfg


def one_budget(data: str, seed: int, images: int) -> dict:
    """K = 4 and 8 and their monolith at one budget: {K: {"fd", "flops"}} (K = 1 the monolith)."""
    work = WORK / data / f"seed{seed}" / f"b{images}"
    work.mkdir(parents=True, exist_ok=True)
    ensembles = {f"k{k}": config(data, work / f"k{k}", seed, images, k) for k in KS}
    built, mono_dir = ensembles_at_equal_flops(work, ensembles, config(data, work / "monolith", seed, images))
    key = f"num={NUM} steps={STEPS} solver={SOLVER} scoring={SCORING}"
    found = {1: {"fd": cached(work / "evaluations.json", f"monolith {key}",
                              lambda: evaluate_target(mono_dir, progress=False)[0])["fd"],
                 "flops": training_flops(mono_dir)}}
    for k in KS:
        cfg = built[f"k{k}"]
        result = cached(work / "evaluations.json", f"k{k} ancestral {key}",
                        lambda cfg=cfg: sample_and_evaluate(cfg, "ancestral", False))
        found[k] = {"fd": result["fd"], "flops": ensemble_training_flops(cfg)}
    print(f"  {data} seed {seed} budget {images:,}: " + ", ".join(f"K={k} FD {v['fd']:.3f}" for k, v in found.items()),
          flush=True)
    return found


def summary(runs: dict, data: str, budgets: list[int], seeds: list[int]) -> tuple[list, list]:
    """Per budget and K: FD by seed, mean +- sd, the ratio to the monolith's mean, and whether K's every seed is below
    the monolith's best seed (outside the seeds' spread)."""
    rows, verdicts = [], []
    for images in budgets:
        mono = torch.tensor([runs[(data, s, images)][1]["fd"] for s in seeds], dtype=torch.float64)
        for k in (1, *KS):
            fds = torch.tensor([runs[(data, s, images)][k]["fd"] for s in seeds], dtype=torch.float64)
            flops = sum(runs[(data, s, images)][k]["flops"] for s in seeds) / len(seeds)
            ratio = (fds.mean() / mono.mean()).item()
            outside = k > 1 and fds.max().item() < mono.min().item()
            rows.append([data, images, k, flops / 1e15, " ".join(f"{f:.3f}" for f in fds.tolist()),
                         fds.mean().item(), fds.std().item() if len(fds) > 1 else 0.0, ratio,
                         "-" if k == 1 else ("yes" if outside else "no")])
            if k == 8:
                verdicts.append((images, ratio, outside, ratio <= TARGET and outside))
    return rows, verdicts


def figure(rows: list, datas: list[str]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(datas), figsize=(5.5 * len(datas), 4), dpi=100, squeeze=False)
    for ax, data in zip(axes[0], datas, strict=True):
        for k in (1, *KS):
            mine = [r for r in rows if r[0] == data and r[2] == k]
            ax.errorbar([r[3] for r in mine], [r[5] for r in mine], yerr=[r[6] for r in mine], marker="o",
                        capsize=3, label="monolith" if k == 1 else f"K = {k}, ancestral")
        ax.set_xscale("log")
        ax.set_xlabel("total training PFLOPs (experts and router, or the monolith)")
        ax.set_ylabel("FD (lower is better), mean +- sd over seeds")
        ax.set_title(data)
        ax.legend()
    fig.tight_layout()
    path = FIGURES / "ddm_budget.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def option(name: str, default: tuple) -> list:
    if name not in sys.argv:
        return list(default)
    value = sys.argv[sys.argv.index(name) + 1].split(",")
    return [int(v) if v.isdigit() else v for v in value]


def run() -> dict:
    setup()
    datas, seeds, budgets = option("--data", tuple(DATA)), option("--seeds", SEEDS), option("--budgets", BUDGETS)
    unknown = [d for d in datas if d not in DATA]
    if unknown:
        raise SystemExit(f"--data: {', '.join(unknown)} unknown; choose from {', '.join(DATA)}")
    runs = {(d, s, b): one_budget(d, s, b) for d in datas for b in budgets for s in seeds}
    rows, verdicts = [], {}
    for data in datas:
        mine, verdicts[data] = summary(runs, data, budgets, seeds)
        rows += mine
    print(table(["data", "budget (images)", "K", "PFLOPs", "FD by seed", "mean", "sd", "vs monolith",
                 "every seed below the monolith's best"], rows))
    for data, by_budget in verdicts.items():
        for images, ratio, outside, met in by_budget:
            print(f"{data}, {images:,} images: K = 8 at {ratio:.3f}x the monolith's FD, "
                  f"{'outside' if outside else 'inside'} the seeds' spread: target {'met' if met else 'NOT met'}")
    met = all(any(v[3] for v in by_budget) for by_budget in verdicts.values())
    path = figure(rows, datas)
    save("ddm_budget", {"data": datas, "seeds": seeds, "budgets": budgets, "table": rows,
                        "verdicts": {d: [list(v) for v in vs] for d, vs in verdicts.items()},
                        "runs": {f"{d} seed{s} b{b}": {str(k): v for k, v in r.items()}
                                 for (d, s, b), r in runs.items()}, "met": met, "figure": str(path)})
    return {"met": met}


if __name__ == "__main__":
    run()
