"""An ensemble out to diffusers and back (issue 30, section 2): the exported pipeline against `islands sample`.

Fashion-MNIST (28x28), K = 4 class-conditional DiTTransformer2DModel experts (diffusers' own DiT, patch 2, width 64,
4 layers) on four pixel clusters with Islands' router, rectified flow, IMAGES training images split over the experts
(the figures are of speed and agreement, not of quality). The ensemble is exported in the open DDM layout (`islands
export`), then sampled both ways from the same noise and the same ancestral draws, in one process: Islands' sampler
(`islands sample ENSEMBLE --solver euler`) and the exported `pipeline.py` (plain diffusers, the peer that a user of
the folder runs), STEPS Euler steps at guidance GUIDANCE, NUM samples, both in fp32, under four routing policies.
Printed: each side's milliseconds per sample and their ratio (medians of REPEATS alternated pairs), and the largest
difference between the two sets of samples. Then `islands import` reads the folder back, and its samples are
compared with the original's bit for bit; the export's and the import's seconds and the folder's size.

The runs live in runs/benchmarks/ddm_export (rerunning reuses the trained ensemble; delete the folder to start
over).

    python -m benchmarks ddm_export
"""

import importlib.util
import shutil
import time
from pathlib import Path

import torch

from benchmarks.common import measure, median, save, setup, table
from islands.config import validate
from islands.data import streams
from islands.ddm.ensemble import ancestral_clusters
from islands.ddm.pipeline import run_ddm
from islands.ddm.sampling import open_sampler
from islands.export import export_ensemble, import_ensemble

WORK = Path("runs/benchmarks/ddm_export")
K, IMAGES, NUM, STEPS, GUIDANCE, REPEATS = 4, 4096, 64, 8, 2.0, 3
ROUTINGS = ("ancestral", "top1", "topk:2", "full")


def config() -> dict:
    return {"run_dir": str(WORK / "ensemble"), "seed": 0, "data": {"source": "fashion_mnist"},
            "model": {"arch": "diffusers", "class_name": "DiTTransformer2DModel", "num_classes": 10,
                      "config": {"num_attention_heads": 4, "attention_head_dim": 16, "num_layers": 4,
                                 "patch_size": 2, "norm_num_groups": 8}},
            "train": {"images": IMAGES, "batch_size": 32, "lr": 1e-3, "warmup_images": 256, "sample_every": 0,
                      "checkpoint_every": IMAGES, "log_every": 512, "ema_halflife_images": 512},
            "sample": {"num": 64, "steps": STEPS, "solver": "euler", "guidance": GUIDANCE},
            "eval": {"every": 0, "num": 256, "metrics": ["fd"], "features": "pixels"},
            "ddm": {"k": K, "monolith": False, "partition": {"method": "kmeans", "pca_dim": 32},
                    "router": {"hidden_size": 64, "depth": 2, "num_heads": 4, "patch_size": 4}}}


def shipped_pipeline(folder: Path):
    """The folder's pipeline.py, loaded as its user loads it."""
    spec = importlib.util.spec_from_file_location("ddm_pipeline", folder / "pipeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DDMPipeline.from_folder(folder)


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def run() -> dict:
    setup()
    cfg = validate(config())
    root = Path(cfg.run_dir)
    if not (root / "ensemble.json").exists():
        run_ddm(cfg, jobs=1, progress=True)
    out, back = WORK / "published", WORK / "imported"
    for folder in (out, back):
        shutil.rmtree(folder, ignore_errors=True)
    _, export_s = timed(lambda: export_ensemble(root, out))
    _, import_s = timed(lambda: import_ensemble(out, back))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())

    # fp32 on both sides: the experts trained in bf16 autocast, which `islands sample` would otherwise sample in
    opts = {"steps": STEPS, "solver": "euler", "guidance": GUIDANCE, "precision": "fp32"}
    sampler = open_sampler(root, opts, routing="ancestral")
    labels = sampler.conditions(NUM)
    noise = streams.normal(cfg.seed, list(range(NUM)), sampler.shape, "sample")
    clusters = ancestral_clusters(sampler.manifest, cfg.seed, 0, NUM, labels)
    pipe = shipped_pipeline(out)
    rows, results = [], {}
    for routing in ROUTINGS:
        ours = open_sampler(root, opts, routing=routing)
        pairs = []
        for _ in range(REPEATS):  # alternated, each side timed on a quiet machine
            (x_islands, islands_s), _ = measure(f"islands {routing}",
                                                lambda: timed(lambda: ours.generate(NUM, labels)))
            (x_pipe, pipe_s), _ = measure(f"pipeline {routing}", lambda: timed(lambda: pipe(
                NUM, class_labels=labels, routing=routing, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                latents=noise, clusters=clusters, routing_seed=cfg.seed)))
            pairs.append((islands_s, pipe_s, pipe_s / islands_s))
        islands_s, pipe_s = median([p[0] for p in pairs]), median([p[1] for p in pairs])
        difference = (x_pipe - x_islands).abs().max().item()
        again = open_sampler(back, opts, routing=routing).generate(NUM, labels)
        ratio = median([p[2] for p in pairs])
        results[routing] = {"islands_ms": 1e3 * islands_s / NUM, "pipeline_ms": 1e3 * pipe_s / NUM, "ratio": ratio,
                            "ratios": [p[2] for p in pairs],
                            "max_difference": difference, "imported_equal": bool(torch.equal(again, x_islands))}
        rows.append([routing, 1e3 * islands_s / NUM, 1e3 * pipe_s / NUM, ratio, f"{difference:.1e}",
                     "yes" if results[routing]["imported_equal"] else "NO"])
    print(table([f"{NUM} samples, {STEPS} Euler steps, guidance {GUIDANCE}", "islands ms/sample, median",
                 "diffusers pipeline ms/sample, median", f"pipeline / islands, median of {REPEATS} pairs",
                 "max |difference|", "imported bit-equal"],
                rows))
    print(f"export {export_s:.1f} s, import {import_s:.1f} s, folder {size / 1e6:.1f} MB")
    met = all(r["max_difference"] < 1e-4 and r["imported_equal"] for r in results.values())
    save("ddm_export", {"k": K, "train_images": IMAGES, "num": NUM, "steps": STEPS, "guidance": GUIDANCE,
                        "export_s": export_s, "import_s": import_s, "folder_mb": size / 1e6, "results": results,
                        "met": met})
    return {"met": met, **results}


if __name__ == "__main__":
    run()
