"""Decentralized Diffusion Models routed by prompt against a monolith, at equal training FLOPs (issue 29, section 5).

The 3,655 captioned emoji at 32x32 in pixels (no autoencoder of ours knows colour images, and at 32x32 a pixel
U-Net is cheap), text-conditioned by MiniLM-L6's caption embeddings (32 tokens, pooled vector in the timestep
embedding, cross-attention at 8x8 and in the middle), caption dropout 0.1. The monolith: a U-Net (32 channels,
32 -> 16 -> 8) trained on all the images. The ensemble: K = 4 experts of the same U-Net on the four clusters of the
captions' pooled embeddings (`ddm.partition.features: text`, balanced two-stage k-means), each at batch BATCH / K for
the same number of steps, a text-reading DiT router (4% of the experts' FLOPs), and the condition router
p(cluster | text); the monolith is then given the router's FLOPs too.

Both are sampled for the held-out prompts of the prompt judge (islands/eval/prompt_following.py) with
DPM-Solver++(2M), STEPS steps, guidance GUIDANCE; the ensemble under `ancestral` (the condition router draws each
prompt's expert once), `top1`, `top2` and `full`. Each is scored with four sampling seeds by FD, KID and
precision/recall on the judge's image features against the whole set, and by prompt following (the rank of each
sample's own prompt among all held-out prompts), beside its seconds per sample; real held-out images are the
ceiling. Then the monolith at guidance 1, 2 and 4: how prompt following moves with guidance.

The runs live in runs/benchmarks/ddm_text: rerunning continues where an interrupted run stopped (delete the folder
to start over).

    python -m benchmarks ddm_text
"""

import sys
from pathlib import Path

from benchmarks.common import ensembles_at_equal_flops, setup

WORK = Path("runs/benchmarks/ddm_text")
IMAGES, BATCH, K = 65_536, 64, 4
STEPS, SOLVER, GUIDANCE, NUM = 8, "dpm2m", 2.0, 500
UNET = dict(arch="unet", channels=32, channel_mult=[1, 2, 2], num_res_blocks=1, attention_resolutions=[8])


def config(run_dir: Path, k: int = 0) -> dict:
    cfg = {"run_dir": str(run_dir), "seed": 0,
           "data": {"source": "emoji", "resolution": 32},
           "model": dict(UNET),
           "flow": {"path": "rectified_flow", "prediction": "velocity", "time_sampler": "logit_normal"},
           "train": {"images": IMAGES, "batch_size": BATCH, "lr": 1e-3, "warmup_images": 4096, "precision": "bf16",
                     "ema_halflife_images": 8192, "checkpoint_every": IMAGES // 2, "log_every": 4096},
           "sample": {"num": 64, "steps": STEPS, "solver": SOLVER, "guidance": GUIDANCE, "batch_size": 250,
                      "precision": "bf16"},
           "eval": {"num": NUM}}
    if k:
        cfg["ddm"] = {"k": k, "partition": {"method": "kmeans", "features": "text", "pca_dim": 64, "fine": 1024,
                                            "balanced": True},
                      "router": {"hidden_size": 96, "depth": 3, "num_heads": 4, "patch_size": 4,
                                 "batch_size": BATCH, "lr": 1e-3}}
    return cfg


def train() -> tuple[dict, Path]:
    WORK.mkdir(parents=True, exist_ok=True)
    return ensembles_at_equal_flops(WORK, {f"k{K}": config(WORK / f"k{K}", K)}, config(WORK / "monolith"))


def run() -> dict:
    setup()
    train()
    return {}


if __name__ == "__main__":
    if "--train" in sys.argv:
        setup()
        train()
