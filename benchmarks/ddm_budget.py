"""Decentralized experts against a monolith across training budgets (issue 40, section 1): FD against total training
FLOPs for K = 1 (the monolith), 4 and 8, at four budgets and four training seeds, on Fashion-MNIST and on the emoji.

The paper's gain grows with compute (McAllister et al. 2025, Fig. 4: the ensemble's lead widens with training
FLOPs). On this machine a budget is at most a few hundred thousand images, so the networks are small enough that
those budgets reach the regime where a model has seen its data many times over: a U-Net of 16 channels (two levels,
one residual block each). K experts of that U-Net hold K times the monolith's parameters for the same FLOPs per
image, which is where an ensemble can pull ahead; at a small budget neither has learnt its data and the ensemble's
experts, each on a K-th of it, see fewer steps' worth of each cluster. Each budget is the images the experts see
together, each expert at batch BATCH / K for the same number of steps; the router takes 4% of their FLOPs (the
paper's share) and the monolith is trained for the FLOPs of the costliest ensemble, router included (K = 8's).

Fashion-MNIST: unconditional, partitioned by the classifier's features (semantic, issue 40's second change);
the emoji: text-conditioned by MiniLM-L6 as benchmarks/ddm_text.py, partitioned by the captions' embeddings, routed
by prompt through the condition router. A training seed changes the initialisation, the partition's k-means and the
data order. Each model samples NUM images (Heun, STEPS steps, no guidance) under ancestral routing (each sample keeps
the expert drawn once for its condition), scored by FD in islands/eval's default features against the whole set.

Every ensemble is also sampled under top-1 routing (each sample's expert the router's most likely one at every
step), the paper's best policy, to set against ancestral. Three more of the paper's settings, one at a time, with
`--variants` (on Fashion-MNIST, at the budgets and seeds asked for):
- `dit`: K = 8 experts and their monolith as DiTs (patch 2, width 64, depth 3: 263 MFLOPs per training image
  against the U-Net's 251) instead of U-Nets, at learning rate 1e-3 (a transformer is usually trained below a
  U-Net's rate; chosen, not tuned);
- `router`: K = 8's experts as they are, with a router of 1% and of 16% of their FLOPs against the default 4%,
  sampled under top-1 routing. Ancestral routing draws each sample's expert from the partition's cluster shares
  and never asks the router, so under it the router's 4% is compute the ensemble is charged for and does not use;
- `pixels`: K = 8 partitioned by k-means on the pixels' PCA (the earlier benchmarks') instead of the classifier's
  features, against the same monolith.

The runs live in runs/benchmarks/ddm_budget/DATA/seedS/bB: a rerun continues where an interrupted one stopped
(training and evaluations alike); `--data`, `--seeds` and `--budgets` run part of it. The partition depends on the
seed and K, not the budget: a budget copies it from another budget of its seed (run_partition checks it).

    python -m benchmarks ddm_budget [--data fashion,emoji] [--seeds 0,1,2,3] [--budgets 2048,8192,32768,131072]
                                    [--variants dit,router,pixels] [--cached-only]

--cached-only reports every run and variant of those asked for that is already measured, and trains nothing.
"""

import shutil
import sys
from pathlib import Path

import torch

from benchmarks.common import FIGURES, cached, ensembles_at_equal_flops, save, setup, table
from islands.config import validate
from islands.ddm.pipeline import build_ensemble, ensemble_training_flops, sample_and_evaluate, training_flops
from islands.eval.evaluate import evaluate_target

WORK = Path("runs/benchmarks/ddm_budget")
BUDGETS = (2_048, 8_192, 32_768, 131_072)  # images the experts see together
KS = (4, 8)
SEEDS = (0, 1, 2, 3)
BATCH = 64
NUM, STEPS, SOLVER = 500, 16, "heun"
ROUTINGS = ("ancestral", "top1")
VARIANTS = ("dit", "router", "pixels")
DIT = {"arch": "dit", "patch_size": 2, "hidden_size": 64, "depth": 3, "num_heads": 4}
ROUTER_SHARES = (0.01, 0.16)  # beside the default 0.04
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


KEY = f"num={NUM} steps={STEPS} solver={SOLVER} scoring={SCORING}"


def copy_once(source: Path, to: Path) -> None:
    """A finished step (a partition, trained experts) reused where it is the same: run_partition and build_ensemble
    check what they find and skip it."""
    if source.exists() and not to.exists():
        shutil.copytree(source, to)


def share_partition(work: Path, name: str) -> None:
    """Copy WORK/NAME/partition from another budget of the same seed (the partition ignores the budget)."""
    for done in sorted(work.parent.glob(f"b*/{name}/partition/partition.json"))[:1]:
        copy_once(done.parent, work / name / "partition")


def evaluated(work: Path, name: str, cfg, routing: str) -> float:
    return cached(work / "evaluations.json", f"{name} {routing} {KEY}",
                  lambda: sample_and_evaluate(cfg, routing, False))["fd"]


def at_equal_flops(work: Path, ensembles: dict, monolith: dict) -> dict:
    """Build the ensembles and their monolith in WORK and evaluate them: {K: {"fd", "flops", ROUTING: FD}} (K = 1 the
    monolith; "fd" ancestral routing's)."""
    for name in ensembles:
        share_partition(work, name)
    built, mono_dir = ensembles_at_equal_flops(work, ensembles, monolith)
    found = {1: {"fd": cached(work / "evaluations.json", f"monolith {KEY}",
                              lambda: evaluate_target(mono_dir, progress=False)[0])["fd"],
                 "flops": training_flops(mono_dir)}}
    for name, cfg in built.items():
        fds = {routing: evaluated(work, name, cfg, routing) for routing in ROUTINGS}
        found[cfg.ddm.k] = {"fd": fds["ancestral"], "flops": ensemble_training_flops(cfg), **fds}
    return found


def one_budget(data: str, seed: int, images: int) -> dict:
    """K = 4 and 8 and their monolith at one budget."""
    work = WORK / data / f"seed{seed}" / f"b{images}"
    work.mkdir(parents=True, exist_ok=True)
    found = at_equal_flops(work, {f"k{k}": config(data, work / f"k{k}", seed, images, k) for k in KS},
                           config(data, work / "monolith", seed, images))
    print(f"  {data} seed {seed} budget {images:,}: " + ", ".join(f"K={k} FD {v['fd']:.3f}" for k, v in found.items()),
          flush=True)
    return found


def dit_variant(seed: int, images: int) -> dict:
    """K = 8 DiT experts and their DiT monolith at one budget, in bB/dit."""
    work = WORK / "fashion" / f"seed{seed}" / f"b{images}" / "dit"
    work.mkdir(parents=True, exist_ok=True)
    raw = {name: config("fashion", work / name, seed, images, k) for name, k in (("k8", 8), ("monolith", 0))}
    for cfg in raw.values():
        cfg["model"], cfg["train"]["lr"] = dict(DIT), 1e-3
    copy_once(work.parent / "k8" / "partition", work / "k8" / "partition")  # the U-Nets' K = 8 partition
    return at_equal_flops(work, {"k8": raw["k8"]}, raw["monolith"])


def pixels_variant(seed: int, images: int) -> dict:
    """K = 8 partitioned on pixels at one budget, in bB/k8_pixels: {8: {"fd", "flops"}}."""
    work = WORK / "fashion" / f"seed{seed}" / f"b{images}"
    raw = config("fashion", work / "k8_pixels", seed, images, 8)
    raw["ddm"]["partition"]["features"] = "pixels"
    cfg = validate(raw)
    build_ensemble(cfg, jobs=2, progress=False)
    return {8: {"fd": evaluated(work, "k8_pixels", cfg, "ancestral"), "flops": ensemble_training_flops(cfg)}}


def router_variant(seed: int, images: int) -> dict:
    """K = 8's trained experts (copied) with routers of other shares of their FLOPs, sampled under top-1 routing (the
    router is what top-1 reads; ancestral routing needs none): {share: {"fd", "flops"}}."""
    work = WORK / "fashion" / f"seed{seed}" / f"b{images}"
    found = {}
    for share in ROUTER_SHARES:
        name = f"k8_router{share:g}"
        for part in ("partition", "experts"):
            copy_once(work / "k8" / part, work / name / part)
        raw = config("fashion", work / name, seed, images, 8)
        raw["ddm"]["router"]["flops_fraction"] = share
        cfg = validate(raw)
        build_ensemble(cfg, progress=False)  # the router only: the partition and experts are done
        found[share] = {"fd": evaluated(work, name, cfg, "top1"), "flops": ensemble_training_flops(cfg)}
    print(f"  fashion seed {seed} budget {images:,}, K = 8 under top-1 routing with a router of "
          + ", ".join(f"{share:.0%}: FD {v['fd']:.3f}" for share, v in found.items()), flush=True)
    return found


def seeds_of(runs: dict, data: str, images: int) -> list[int]:
    return sorted(s for d, s, b in runs if (d, b) == (data, images))


def column(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.float64)


def fds_of(runs: dict, data: str, images: int, k: int, routing: str = "fd") -> torch.Tensor:
    return column(runs[(data, s, images)][k][routing] for s in seeds_of(runs, data, images))


def spread(fds: torch.Tensor) -> tuple[str, float, float]:
    return " ".join(f"{f:.3f}" for f in fds.tolist()), fds.mean().item(), fds.std().item() if len(fds) > 1 else 0.0


def summary(runs: dict, data: str) -> tuple[list, list]:
    """Per budget and K: FD by seed, mean +- sd, the ratio to the monolith's mean, the ratio seed by seed (each seed's
    FD is in features trained with that seed, so its own monolith is K's fairest yardstick), and whether K's every
    seed is below the monolith's best seed (outside the seeds' spread: the target's test)."""
    rows, verdicts = [], []
    for images in sorted({b for d, _, b in runs if d == data}):
        seeds, mono = seeds_of(runs, data, images), fds_of(runs, data, images, 1)
        for k in (1, *KS):
            fds = fds_of(runs, data, images, k)
            flops = sum(runs[(data, s, images)][k]["flops"] for s in seeds) / len(seeds)
            ratio = (fds.mean() / mono.mean()).item()
            outside = k > 1 and fds.max().item() < mono.min().item()
            paired = fds / mono
            rows.append([data, images, k, len(seeds), flops / 1e15, *spread(fds), ratio,
                         "-" if k == 1 else f"{spread(paired)[0]} ({paired.mean().item():.3f})",
                         "-" if k == 1 else ("yes" if outside else "no")])
            if k == 8:
                verdicts.append((images, len(seeds), ratio, outside, ratio <= TARGET and outside and len(seeds) > 1))
    return rows, verdicts


def routing_rows(runs: dict) -> list:
    """Top-1 against ancestral routing: per data, budget and K, both means over the seeds and their ratio."""
    rows = []
    for data, images in sorted({(d, b) for d, _, b in runs}):
        for k in KS:
            ancestral, top1 = fds_of(runs, data, images, k), fds_of(runs, data, images, k, "top1")
            rows.append([data, images, k, len(ancestral), spread(ancestral)[1], spread(top1)[0], spread(top1)[1],
                         (top1.mean() / ancestral.mean()).item()])
    return rows


def variant_rows(runs: dict, variants: dict) -> list:
    """Each variant's FD by seed beside its reference at the same budget and seeds: the DiTs' K = 8 against their DiT
    monolith (and the U-Nets' under ancestral routing), a router's share against the default 4% (top-1 routing)."""
    rows = []
    for (name, images), by_seed in sorted(variants.items()):
        seeds = sorted(by_seed)
        routing = "top1" if name == "router" else "fd"
        reference = column(runs[("fashion", s, images)][8][routing] for s in seeds)
        if name == "dit":
            mono = column(by_seed[s][1]["fd"] for s in seeds)
            for k, label in ((1, "DiT monolith"), (8, "DiT K = 8")):
                fds = column(by_seed[s][k]["fd"] for s in seeds)
                rows.append([label, images, len(seeds), *spread(fds), (fds.mean() / mono.mean()).item(),
                             (fds.mean() / reference.mean()).item()])
        elif name == "pixels":
            fds = column(by_seed[s][8]["fd"] for s in seeds)
            mono = column(runs[("fashion", s, images)][1]["fd"] for s in seeds)
            rows.append(["K = 8, partition on pixels", images, len(seeds), *spread(fds),
                         (fds.mean() / mono.mean()).item(), (fds.mean() / reference.mean()).item()])
        else:
            for share in ROUTER_SHARES:
                fds = column(by_seed[s][share]["fd"] for s in seeds)
                rows.append([f"K = 8, router {share:.0%}", images, len(seeds), *spread(fds), float("nan"),
                             (fds.mean() / reference.mean()).item()])
    return rows


def figure(rows: list, routing: list, datas: list[str]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(1, len(datas), figsize=(5.5 * len(datas), 4), dpi=100, squeeze=False)
    for ax, data in zip(axes[0], datas, strict=True):
        for k in (1, *KS):
            mine = [r for r in rows if r[0] == data and r[2] == k]
            line = ax.errorbar([r[4] for r in mine], [r[6] for r in mine], yerr=[r[7] for r in mine], marker="o",
                               capsize=3, label="monolith" if k == 1 else f"K = {k}, ancestral")
            if k > 1:
                top1 = {r[1]: r[6] for r in routing if r[0] == data and r[2] == k}
                ax.plot([r[4] for r in mine], [top1[r[1]] for r in mine], "--", marker="x",
                        color=line[0].get_color(), label=f"K = {k}, top-1")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # the minor ticks' labels overlap on a short range
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


def measured(data: str, seed: int, images: int, variant: str = "") -> bool:
    """Whether a budget (or one of its variants) has its last evaluation on record."""
    work = WORK / data / f"seed{seed}" / f"b{images}"
    path, last = {"": (work, "k8 ancestral"), "dit": (work / "dit", "k8 ancestral"),
                  "pixels": (work, "k8_pixels ancestral"),
                  "router": (work, f"k8_router{ROUTER_SHARES[-1]:g} top1")}[variant]
    return (path / "evaluations.json").exists() and f"{last} {KEY}" in (path / "evaluations.json").read_text()


def run() -> dict:
    """Train and evaluate what is asked for (what is done is read back); with --cached-only, report every
    (data, seed, budget) already measured and train nothing new."""
    setup()
    datas, seeds, budgets = option("--data", tuple(DATA)), option("--seeds", SEEDS), option("--budgets", BUDGETS)
    variants = option("--variants", ())
    for name, asked, known in (("--data", datas, DATA), ("--variants", variants, VARIANTS)):
        unknown = [v for v in asked if v not in known]
        if unknown:
            raise SystemExit(f"{name}: {', '.join(unknown)} unknown; choose from {', '.join(known)}")
    everything = "--cached-only" not in sys.argv
    wanted = [(d, s, b) for d in datas for b in budgets for s in seeds if everything or measured(d, s, b)]
    runs = {key: one_budget(*key) for key in wanted}
    found = {}
    for name in variants:
        for _, s, b in [key for key in wanted if key[0] == "fashion" and (everything or measured(*key, name))]:
            variant = {"dit": dit_variant, "router": router_variant, "pixels": pixels_variant}[name]
            found.setdefault((name, b), {})[s] = variant(s, b)
    rows, verdicts = [], {}
    for data in datas:
        mine, verdicts[data] = summary(runs, data)
        rows += mine
    print(table(["data", "budget (images)", "K", "seeds", "PFLOPs", "FD by seed", "mean", "sd", "vs monolith",
                 "vs monolith seed by seed (mean)", "every seed below the monolith's best"], rows))
    routing = routing_rows(runs)
    print(table(["data", "budget", "K", "seeds", "ancestral mean", "top-1 by seed", "top-1 mean", "top-1 / ancestral"],
                routing))
    variant = variant_rows(runs, found)
    if variant:
        print(table(["variant (Fashion-MNIST)", "budget", "seeds", "FD by seed", "mean", "sd", "vs its monolith",
                     "vs U-Net K = 8 (4% router)"], variant))
    for data, by_budget in verdicts.items():
        for images, n, ratio, outside, met in by_budget:
            print(f"{data}, {images:,} images, {n} seeds: K = 8 at {ratio:.3f}x the monolith's FD, "
                  f"{'outside' if outside else 'inside'} the seeds' spread: target {'met' if met else 'NOT met'}")
    met = all(any(v[4] for v in by_budget) for by_budget in verdicts.values())
    path = figure(rows, routing, datas)
    save("ddm_budget", {"data": datas, "table": rows, "routing": routing, "variants": variant,
                        "verdicts": {d: [list(v) for v in vs] for d, vs in verdicts.items()},
                        "runs": {f"{d} seed{s} b{b}": {str(k): v for k, v in r.items()}
                                 for (d, s, b), r in runs.items()},
                        "variant_runs": {f"{n} b{b} seed{s}": {str(k): v for k, v in r.items()}
                                         for (n, b), by_seed in found.items() for s, r in by_seed.items()},
                        "met": met, "figure": str(path)})
    return {"met": met}


if __name__ == "__main__":
    run()
