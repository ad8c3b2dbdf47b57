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
ceiling, and the same images each judged against another one's prompt the floor. Then the monolith at guidance
1, 2 and 4: how prompt following moves with guidance.

The runs live in runs/benchmarks/ddm_text: rerunning continues where an interrupted run stopped (delete the folder
to start over).

    python -m benchmarks ddm_text
"""

import sys
import time
from pathlib import Path

import torch

from benchmarks.common import (
    FIGURES,
    cached,
    cpu_seconds,
    ensembles_at_equal_flops,
    measure,
    others_share,
    save,
    setup,
    table,
)
from islands.conditions import SampleRequest
from islands.ddm.pipeline import ensemble_training_flops, training_flops, whole_data
from islands.ddm.sampling import open_sampler
from islands.eval.evaluate import Evaluator, evaluate_sampler, generated
from islands.flow.samplers import evaluations_per_sample
from islands.generate import open_run
from islands.images import save_samples_picture, save_side_by_side

WORK = Path("runs/benchmarks/ddm_text")
IMAGES, BATCH, K = 65_536, 64, 4
STEPS, SOLVER, GUIDANCE, NUM = 8, "dpm2m", 2.0, 500
SEEDS = (0, 1, 2, 3)
ROUTINGS = ("ancestral", "top1", "topk:2", "full")
GUIDANCES = (1.0, 2.0, 4.0)
UNET = dict(arch="unet", channels=32, channel_mult=[1, 2, 2], num_res_blocks=1, attention_resolutions=[8])
METRICS = ("fd", "kid", "precision", "recall", "prompt_top1", "prompt_top5", "prompt_rank")
SCALE = {"kid": 1e3}  # printed at these factors
TIMED = 250  # samples of one batch, timed again on a quiet machine: the scored runs shared the CPUs with others
PROMPTS: list[str] = []  # the held-out prompts of the run, in order
SCORING = 1  # part of every cached evaluation's key: bumped when the scoring changes


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


def options(guidance: float = GUIDANCE) -> dict:
    return {"steps": STEPS, "solver": SOLVER, "guidance": guidance, "batch_size": 250, "precision": "bf16"}


def scored(key: str, sampler, evaluator: Evaluator, seed: int) -> dict:
    """NUM samples of `sampler` for the evaluator's held-out prompts, scored, with seconds and network evaluations
    per sample (and the share of the CPUs other processes took meanwhile); cached under `key`."""
    def evaluate():
        clock, mixture = {}, sampler.denoiser
        counted = hasattr(mixture, "reset_counts")  # an ensemble counts its experts' and router's calls
        if counted:
            mixture.reset_counts()
        since = cpu_seconds()
        result = evaluate_sampler(evaluator, sampler, NUM, seed=seed, clock=clock)
        result["seconds_per_sample"], result["others_cpu_share"] = clock["seconds"] / NUM, others_share(since)
        result["expert_evaluations_per_sample"] = (mixture.evaluations / NUM if counted else evaluations_per_sample(
            SOLVER, STEPS, sampler.opts.guidance))
        result["router_evaluations_per_sample"] = mixture.router_evaluations / NUM if counted else 0
        return result
    return cached(WORK / "evaluations.json", f"{key} seed={seed} num={NUM} scoring={SCORING}", evaluate)


def quiet_seconds(key: str, sampler) -> float:
    """Seconds per sample of TIMED samples for the first TIMED held-out prompts, the machine quiet (benchmarks.common
    `measure` waits for it and measures again if others took more than a tenth of the CPUs)."""
    def timing():
        since = time.perf_counter()
        for _ in generated(sampler, TIMED, seed=0, request=SampleRequest(prompts=tuple(PROMPTS[:TIMED]))):
            pass
        return (time.perf_counter() - since) / TIMED
    return cached(WORK / "evaluations.json", f"{key} timed={TIMED} scoring={SCORING}", lambda: measure(key, timing)[0])


def mean_std(values: list[float]) -> str:
    v = torch.tensor(values, dtype=torch.float64)
    return f"{v.mean():.3f} +- {v.std():.3f}"


def grids(cfg, mono_dir: Path, evaluator: Evaluator) -> Path:
    """The first 16 held-out prompts drawn by the monolith and the ensemble under each policy (the same noise),
    beside the real images of those prompts."""
    prompts = evaluator.prompts(16)
    where = {c: i for i, c in enumerate(evaluator.source.captions(range(len(evaluator.source))))}
    pictures = {"real images": save_samples_picture(evaluator.source.get([where[p] for p in prompts])[0],
                                                    WORK / "real.png", captions=prompts)}
    samplers = {"monolith": open_run(mono_dir, options())}
    samplers.update({f"K = {K}, {r}": open_sampler(Path(cfg.run_dir), options(), routing=r, seed=0) for r in ROUTINGS})
    for name, sampler in samplers.items():
        x = next(generated(sampler, 16, seed=0, request=SampleRequest(prompts=tuple(prompts))))[0]
        pictures[name] = save_samples_picture(x, WORK / f"{name.replace(' ', '').replace(',', '-')}.png",
                                              captions=prompts)
    return save_side_by_side(pictures, FIGURES / "ddm_text.png", "the same held-out prompts and noise; guidance "
                             f"{GUIDANCE}, {SOLVER} {STEPS} steps")


def run() -> dict:
    setup()
    built, mono_dir = train()
    cfg = built[f"k{K}"]
    evaluator = Evaluator(whole_data(cfg), cfg.eval, cfg.seed, progress=True)
    prompts = evaluator.prompts(NUM)
    PROMPTS[:] = prompts
    where = {c: i for i, c in enumerate(evaluator.source.captions(range(len(evaluator.source))))}
    real = cached(WORK / "evaluations.json", f"real num={NUM} scoring={SCORING}",
                  lambda: evaluator([(evaluator.source.get([where[p] for p in prompts])[0], None)], prompts=prompts))
    # the floor: the same images, each judged against the next one's prompt
    mismatched = cached(WORK / "evaluations.json", f"real, prompts shifted num={NUM} scoring={SCORING}",
                        lambda: evaluator([(evaluator.source.get([where[p] for p in prompts])[0], None)],
                                          prompts=prompts[1:] + prompts[:1]))
    found = {"real held-out images": {"seeds": [real]}, "real images, each beside another's prompt":
             {"seeds": [mismatched]}}
    found["monolith"] = {"seeds": [scored("monolith", open_run(mono_dir, options()), evaluator, s) for s in SEEDS]}
    for routing in ROUTINGS:
        found[f"K = {K}, {routing}"] = {"seeds": [
            scored(f"k{K} {routing}", open_sampler(Path(cfg.run_dir), options(), routing=routing, seed=s), evaluator, s)
            for s in SEEDS]}
    found["monolith"]["quiet_seconds_per_sample"] = quiet_seconds("monolith", open_run(mono_dir, options()))
    for routing in ROUTINGS:
        found[f"K = {K}, {routing}"]["quiet_seconds_per_sample"] = quiet_seconds(
            f"k{K} {routing}", open_sampler(Path(cfg.run_dir), options(), routing=routing, seed=0))
    mono_flops = training_flops(mono_dir)
    rows = []
    for name, entry in found.items():
        seeds = entry["seeds"]
        entry.update({m: [SCALE.get(m, 1) * r[m] for r in seeds] for m in METRICS})
        evals = seeds[0].get("expert_evaluations_per_sample", float("nan"))
        cost = ensemble_training_flops(cfg) / mono_flops if name.startswith("K =") else 1.0
        rows.append([name, cost if "real" not in name else float("nan"),
                     *[mean_std(entry[m]) if len(seeds) > 1 else f"{entry[m][0]:.3f}" for m in METRICS],
                     evals, 1e3 * entry.get("quiet_seconds_per_sample", float("nan"))])
    print(table(["model", "train FLOPs vs mono", *[m + (" x1e3" if m in SCALE else "") for m in METRICS],
                 "network evals/sample", "ms/sample (quiet)"], rows))

    sweep, sweep_rows = {}, []
    for g in GUIDANCES:
        sweep[g] = scored(f"monolith guidance={g}", open_run(mono_dir, options(g)), evaluator, 0)
        sweep_rows.append([g, sweep[g]["prompt_top1"], sweep[g]["prompt_top5"], sweep[g]["prompt_rank"],
                           sweep[g]["fd"], 1e3 * sweep[g]["seconds_per_sample"]])
    sweep_rows.append(["real images", real["prompt_top1"], real["prompt_top5"], real["prompt_rank"], real["fd"],
                       float("nan")])
    print(table(["monolith guidance", "prompt top-1", "prompt top-5", "mean rank", "FD", "ms/sample"], sweep_rows))
    picture = grids(cfg, mono_dir, evaluator)
    mono_fd = torch.tensor(found["monolith"]["fd"]).mean().item()
    best = min((n for n in found if n.startswith("K =")), key=lambda n: torch.tensor(found[n]["fd"]).mean().item())
    summary = {"best_policy": best, "best_fd": torch.tensor(found[best]["fd"]).mean().item(), "monolith_fd": mono_fd,
               "ensemble_wins_fd": torch.tensor(found[best]["fd"]).mean().item() < mono_fd,
               "choices": real["prompt_choices"], "judge": real["prompt_judge"]}
    # met: text conditioning works, prompt following rising with guidance from far above the floor
    g = [sweep[x]["prompt_top5"] for x in GUIDANCES]
    summary["met"] = g[0] < g[1] < g[2] and g[0] > 5 * mismatched["prompt_top5"]
    print(summary)
    save("ddm_text", {"num": NUM, "seeds": SEEDS, "steps": STEPS, "solver": SOLVER, "guidance": GUIDANCE,
                      "results": {n: {k: v for k, v in e.items() if k != "seeds"} for n, e in found.items()},
                      "per_seed": found, "guidance_sweep": sweep, "summary": summary, "picture": str(picture)})
    return {"met": summary["met"], **summary}


if __name__ == "__main__":
    setup()
    train() if "--train" in sys.argv else run()
