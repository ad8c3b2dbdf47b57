"""Do routing policies reproduce the data's mode weights? A 2-D mixture where the truth is known exactly.

Eight narrow Gaussians (std 0.15) on a circle of radius 2 with unequal weights (0.30 down to 0.04), four MLP experts on
a balanced k-means partition, so that clusters cut across modes of unequal mass. Ancestral routing (each sample's expert
drawn once from the cluster sizes) is exact sampling of the mixture and needs no router: it is the yardstick. Every
router-driven policy is scored with three routers: the exact cluster posterior of the training points
(islands.data.posterior: what a perfect router would say), the router `islands ddm` trains by default (4% of the
experts' training FLOPs, a quarter of their width, EMA), and the same budget spent on a router as wide as the experts
(the previous default width), which sees a quarter of the images.

The metric is exact: the total variation between the samples' mode masses and the true weights, 20,000 samples (Heun, 24
steps) for each of two sampling seeds; the draw alone leaves about 0.007. The exact posterior sums over all 20,000
training points at every call, so its rows draw 4,000 samples of one seed (the draw alone: about 0.016). Targets (issue
11): full routing through the default router within 1.5x of ancestral's error, top-1 within 2x. Where top-1 misses with
the exact router too, the miss is the policy's, not the router's.

The runs stay in runs/benchmarks/ddm_routing: a rerun reuses the trained experts and routers.

    python -m benchmarks ddm_routing
"""

import json
import math
import shutil
from pathlib import Path

from benchmarks.common import save, setup, table
from islands.config import validate
from islands.data import build_data, data_name
from islands.data.clusters import ClusterLabelled, read_clusters
from islands.data.gmm import GaussianMixture
from islands.data.posterior import exact_cluster_posterior
from islands.ddm.ensemble import ancestral_assignment, load_ensemble
from islands.ddm.pipeline import build_ensemble, training_flops
from islands.ddm.runs import partition_dir, router_dir
from islands.eval.exact import mode_mass
from islands.generate import generate

MEANS = [[2 * math.cos(2 * math.pi * i / 8), 2 * math.sin(2 * math.pi * i / 8)] for i in range(8)]
WEIGHTS = [0.30, 0.20, 0.14, 0.10, 0.09, 0.08, 0.05, 0.04]
STD, K, SAMPLES, SEEDS = 0.15, 4, 20_000, (0, 1)
EXACT_SAMPLES, EXACT_SEEDS = 4_000, (0,)
WORK = Path("runs/benchmarks/ddm_routing")
POLICIES = ("full", "top1", "topk:2", "nucleus:0.9", "sample", "ancestral_then:top1@0.2")
ROUTERS = {  # name: (its folder, overrides of ddm.router; None: the exact posterior instead of a trained router)
    "exact posterior": ("default", None),
    "default (4% FLOPs, width 32)": ("default", {}),
    "width 128 (4% FLOPs)": ("width128", {"hidden": 128}),
}
FULL_TARGET, TOP1_TARGET = 1.5, 2.0


def config(run_dir: Path, router: dict) -> dict:
    return {"run_dir": str(run_dir), "seed": 0,
            "data": {"source": "gmm", "means": MEANS, "std": STD, "weights": WEIGHTS, "size": 20000},
            "model": {"arch": "mlp", "hidden": 128, "depth": 3},
            "train": {"images": 256000, "batch_size": 256, "lr": 2e-3, "warmup_images": 4000,
                      "ema_halflife_images": 8000, "checkpoint_every": 256000, "log_every": 64000},
            "sample": {"num": 256, "steps": 24, "solver": "heun", "batch_size": SAMPLES},
            "ddm": {"k": K, "partition": {"fine": 64, "balanced": True, "pca_dim": None},
                    "router": {"batch_size": 256, "lr": 2e-3, **router}}}


def exact_router(cfg):
    source = build_data(cfg.data.model_copy(update={"partition": None, "cluster": None}), cfg.seed)
    cluster = read_clusters(partition_dir(cfg), source, data_name(cfg.data))
    return exact_cluster_posterior(ClusterLabelled(source, cluster), K)


def mode_mass_error(root: Path, policy: str, router=None, samples: int = SAMPLES, seeds=SEEDS) -> float:
    """Mean over `seeds` of the mode masses' total variation from the true weights."""
    cfg = validate(config(root, {}))
    gmm = GaussianMixture(MEANS, STD, WEIGHTS)
    errors = []
    for seed in seeds:
        mixture, manifest = load_ensemble(root, policy, seed=seed)
        if router is not None:
            mixture.router = router
        x = generate(mixture, (2,), samples, cfg.sample, seed, None,
                     for_batch=ancestral_assignment(mixture, manifest, seed))
        errors.append(mode_mass(gmm, x)["total_variation"])
    return sum(errors) / len(errors)


def run() -> dict:
    setup()
    rows, found = [], {}
    base = WORK / "default"
    print("  partition, 4 experts, the default router", flush=True)
    build_ensemble(validate(config(base, {})), progress=False)
    experts = sum(training_flops(base / "experts" / str(k)) for k in range(K))
    ancestral = mode_mass_error(base, "ancestral")
    found["ancestral"] = {"mode_mass_tv": ancestral}
    rows.append(["ancestral", "none", "-", "-", f"{ancestral:.4f}", "1.00"])
    # the exact posterior's rows are read against ancestral routing of their own smaller draw
    ancestral_small = mode_mass_error(base, "ancestral", samples=EXACT_SAMPLES, seeds=EXACT_SEEDS)
    found["ancestral, the exact rows' draw"] = {"mode_mass_tv": ancestral_small}
    rows.append(["ancestral", f"none ({EXACT_SAMPLES} samples)", "-", "-", f"{ancestral_small:.4f}", "1.00"])
    for name, (folder, overrides) in ROUTERS.items():
        root = WORK / folder
        if overrides is None:
            router, calibration, share, draw = exact_router(validate(config(root, {}))), "0 (exact)", "-", \
                {"samples": EXACT_SAMPLES, "seeds": EXACT_SEEDS}
            yardstick = ancestral_small
        else:
            if not root.exists():  # the default ensemble's experts, another router
                shutil.copytree(base, root, ignore=lambda folder, _: ["router"] if Path(folder) == base else [])
                (root / "config.yaml").unlink()  # the ensemble's config is written again, with the override
            print(f"  router: {name}", flush=True)
            cfg = validate(config(root, overrides))
            build_ensemble(cfg, progress=False)
            report = json.loads((router_dir(cfg) / "router_accuracy.json").read_text())
            router, calibration, draw, yardstick = None, f"{sum(report['tv']) / len(report['tv']):.3f}", {}, ancestral
            share = f"{training_flops(router_dir(cfg)) / experts:.3f}"
        for policy in POLICIES:
            tv = mode_mass_error(root, policy, router, **draw)
            found[f"{name} {policy}"] = {"mode_mass_tv": tv, "ratio": tv / yardstick}
            rows.append([policy, name, calibration, share, f"{tv:.4f}", f"{tv / yardstick:.2f}"])
            print(f"  {name} {policy}: {tv:.4f} ({tv / yardstick:.2f}x ancestral)", flush=True)
    print(table(["routing", "router", "router TV vs exact (mean over t)", "router FLOPs / experts'",
                 "mode-mass TV", "x ancestral"], rows))
    default = "default (4% FLOPs, width 32)"
    full, top1 = found[f"{default} full"]["ratio"], found[f"{default} top1"]["ratio"]
    exact_top1 = found["exact posterior top1"]["ratio"]
    print(f"full routing, default router: {full:.2f}x ancestral (target <= {FULL_TARGET}x): "
          f"{'met' if full <= FULL_TARGET else 'NOT met'}")
    print(f"top-1, default router: {top1:.2f}x (target <= {TOP1_TARGET}x): "
          f"{'met' if top1 <= TOP1_TARGET else 'NOT met'}; top-1 through the exact posterior: {exact_top1:.2f}x")
    met = full <= FULL_TARGET
    save("ddm_routing", {"results": found, "samples": SAMPLES, "seeds": list(SEEDS), "weights": WEIGHTS,
                         "claim": f"full routing through the default router within {FULL_TARGET}x of ancestral "
                                  f"routing's mode-mass error (top-1 within {TOP1_TARGET}x reported beside it)",
                         "full_ratio": full, "top1_ratio": top1, "exact_top1_ratio": exact_top1, "met": met})
    return {"met": met}
