"""How well does the condition router p(cluster | text) know which expert a prompt belongs to (issue 29, section 3)?

The 3,655 emoji at 32x32, partitioned into K = 4 clusters as `islands ddm` partitions them (two-stage balanced
k-means after PCA to 64), by the images' pixels or by the captions' pooled MiniLM embeddings (`features: text`).
For each partition the condition router (islands/ddm/condition_router.py) trains on nine tenths of the examples and
is scored on the held-out tenth: log-loss against the cluster sizes' (what ancestral routing drew from before it),
top-1 accuracy, expected calibration error, and its mean predicted shares against the empirical ones.

    python -m benchmarks condition_router
"""

import time

import torch

from benchmarks.common import save, setup, table
from islands.config import validate
from islands.data import build_data
from islands.data.captions import caption_table
from islands.data.sources import _ArraySource
from islands.ddm.condition_router import fit_condition_router
from islands.ddm.partition import partition
from islands.nets.text_folder import bundled_text_encoder

K, TOKENS, SEED = 4, 32, 0


def run() -> dict:
    setup()
    cfg = validate({"run_dir": "runs/benchmarks/condition_router", "data": {"source": "emoji", "resolution": 32}})
    source = build_data(cfg.data, SEED)
    pooled = caption_table(source, bundled_text_encoder(), TOKENS)[:, 0, :384]
    rows, results = [], {}
    for name, seen in (("pixels", None), ("text", _ArraySource(pooled, None, 0))):
        made = partition(source, K, "kmeans", None, 64, 1024, True, SEED, seen=seen)
        start = time.perf_counter()
        _, report = fit_condition_router(pooled, torch.from_numpy(made.cluster), K, SEED)
        seconds = time.perf_counter() - start
        results[name] = {**report, "sizes": made.sizes, "train_s": seconds}
        rows.append([f"partition by {name}", report["log_loss"], report["prior_log_loss"], report["accuracy"],
                     report["ece"], " ".join(f"{p:.2f}/{e:.2f}" for p, e in zip(report["shares_predicted"],
                                                                                report["shares_empirical"],
                                                                                strict=True)), seconds])
    print(table(["condition router, K = 4, held-out tenth", "log-loss", "sizes' log-loss", "top-1 accuracy", "ECE",
                 "shares predicted/empirical", "train s"], rows))
    met = all(r["log_loss"] < r["prior_log_loss"] for r in results.values())
    save("condition_router", {"k": K, "tokens": TOKENS, "examples": len(source), "results": results, "met": met})
    return {"met": met, **results}


if __name__ == "__main__":
    run()
