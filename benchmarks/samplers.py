"""Few-step sampling: every Islands solver and grid against diffusers' flow-matching schedulers on their own grids.

Part 1, Gaussian mixtures, whose velocity is exact (no network error): a 2-D mixture of 12 narrow modes of unequal
weight (std 0.06) and a 32-D mixture of 16 modes (std 0.15). The same 10000 noise draws go through every method;
the error of a method is the mean over samples of the L2 distance between its endpoint and the endpoint of
torchdiffeq's dopri5 from the same noise (rtol = atol = 1e-7; its own error, against rtol = atol = 1e-9, is printed
beside it). The best of each library also gets the median distance and the number of samples that end in another
mode than dopri5's. A budget of B network evaluations means at most B, counted by calling the field: Heun-type
methods get N steps with 2N - 1 <= B. diffusers' schedulers are driven by their own loop (set_timesteps, step), fed
the exact velocity at the sigma they stand at; each runs at flow shifts 1 (their default) and 3 (SD3's), UniPC also
on its Karras flow sigmas. "Best" is the best of all configurations of a library at a budget.
Neither the mixtures nor the noise were used to fit Islands' logsnr grid: its constants were fit on six other
mixtures (2-D to 24-D, 3 to 16 modes, std 0.05 to 0.4).

Part 2, a trained network: a class-conditional U-Net on Fashion-MNIST (trained once through Islands' loop and kept in
runs/benchmarks/samplers), sampled by Islands' solvers and by diffusers' schedulers driving the same network from
the same noise, scored by the Frechet distance of the classifier features of `islands eval` against evaluations.

    python -m benchmarks samplers
"""

import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from diffusers import (
    DPMSolverMultistepScheduler,
    FlowMatchEulerDiscreteScheduler,
    FlowMatchHeunDiscreteScheduler,
    UniPCMultistepScheduler,
)
from torchdiffeq import odeint

from benchmarks.common import FIGURES, UNET, save, setup, table
from islands.conditions.classes import class_labels
from islands.config import SampleConfig, validate
from islands.data import build_data, streams
from islands.data.gmm import GaussianMixture
from islands.eval.evaluate import Evaluator
from islands.flow.samplers import GRIDS, SOLVERS, evaluations_per_sample, sample
from islands.generate import generate, load_denoiser, sampling_precision
from islands.trainer import train

BUDGETS = (4, 6, 8, 10, 16, 32)  # the targets are read at 4, 8, 16 and 32
TARGET_BUDGETS, BETTER_AT, BETTER_BY = (4, 8, 16, 32), 8, 1.5
SAMPLES, RTOL = 10_000, 1e-7  # at 32 evaluations one sample in ~3000 still lands in another mode
WORK = Path("runs/benchmarks/samplers")


# --- the methods --------------------------------------------------------------------------------------------------

def islands_methods() -> dict:
    """name -> (budget -> steps): every solver on every grid, at the most steps the budget pays for."""
    def steps_for(solver):
        return lambda budget: max(s for s in range(1, budget + 1) if evaluations_per_sample(solver, s) <= budget)
    return {f"{solver} {grid}": (solver, grid, steps_for(solver)) for solver in SOLVERS for grid in GRIDS}


def diffusers_methods() -> dict:
    """name -> (budget -> a scheduler with its timesteps set for that budget)."""
    flow = dict(use_flow_sigmas=True, prediction_type="flow_prediction")
    out = {}

    def add(name, make, steps=lambda b: b):
        def build(budget):
            s = make()
            s.set_timesteps(steps(budget))
            return s
        out[name] = build

    for shift in (1.0, 3.0):
        add(f"Euler shift {shift:g}", lambda shift=shift: FlowMatchEulerDiscreteScheduler(shift=shift))
        add(f"Heun shift {shift:g}", lambda shift=shift: FlowMatchHeunDiscreteScheduler(shift=shift),
            lambda b: (b + 1) // 2)
        for order in (2, 3):
            add(f"DPM++({order}M) shift {shift:g}", lambda shift=shift, order=order: DPMSolverMultistepScheduler(
                solver_order=order, flow_shift=shift, **flow))
            add(f"UniPC-{order} shift {shift:g}", lambda shift=shift, order=order: UniPCMultistepScheduler(
                solver_order=order, flow_shift=shift, **flow))
    for order in (2, 3):
        add(f"UniPC-{order} Karras", lambda order=order: UniPCMultistepScheduler(
            solver_order=order, use_karras_sigmas=True, **flow))
    return out


def drive(scheduler, velocity, noise: torch.Tensor) -> tuple[torch.Tensor, int]:
    """diffusers' own loop; the model is the velocity at the sigma the scheduler stands at (flow convention:
    sigma is our t, and the model output is noise - data, our sign). -> (samples, evaluations)."""
    x, calls = noise.float(), 0
    for i, timestep in enumerate(scheduler.timesteps):
        v = velocity(x, torch.full((x.shape[0],), float(scheduler.sigmas[i]), dtype=x.dtype))
        calls += 1
        x = scheduler.step(v.float(), timestep, x).prev_sample
    return x, calls


# --- part 1: mixtures -----------------------------------------------------------------------------------------------

def mixtures() -> dict:
    rng = np.random.default_rng(1)
    narrow = GaussianMixture(rng.uniform(-2, 2, (12, 2)), 0.06, rng.dirichlet(np.ones(12)))
    rng = np.random.default_rng(2)
    high = GaussianMixture(rng.uniform(-1, 1, (16, 32)), 0.15, rng.dirichlet(np.ones(16)))
    return {"2-D, 12 modes, std 0.06": narrow, "32-D, 16 modes, std 0.15": high}


def dopri5(mixture: GaussianMixture, noise: torch.Tensor, tol: float) -> torch.Tensor:
    field = lambda t, x: mixture.velocity(x, t.expand(x.shape[0]))  # noqa: E731
    return odeint(field, noise, torch.tensor([1.0, 0.0], dtype=torch.float64), rtol=tol, atol=tol,
                  method="dopri5")[-1]


def counted(field):
    """The field, and a list that grows by one per call."""
    calls = []

    def velocity(x, t, cond=None):
        calls.append(1)
        return field(x, t)

    return velocity, calls


def mixture_errors(mixture: GaussianMixture, seed: int) -> dict:
    noise = torch.randn(SAMPLES, mixture.dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    reference = dopri5(mixture, noise, RTOL)
    tighter = dopri5(mixture, noise[:200], 1e-9)
    zero = torch.zeros(SAMPLES, dtype=torch.float64)
    mode = mixture.posterior(reference, zero).argmax(1)

    def error(x: torch.Tensor) -> dict:
        """The mean error, its median, and how many samples end in another mode than dopri5's (most likely
        component under the data density): a few of those dominate the mean at 32 evaluations."""
        e = (x.double() - reference).norm(dim=1)
        other = (mixture.posterior(x.double(), zero).argmax(1) != mode).sum().item()
        return {"error": e.mean().item(), "median": e.median().item(), "other_mode": other}

    result = {"reference_error": (reference[:200] - tighter).norm(dim=1).mean().item(), "islands": {},
              "diffusers": {}}
    for name, (solver, grid, steps_for) in islands_methods().items():
        rows = result["islands"][name] = {}
        for budget in BUDGETS:
            field, calls = counted(mixture.velocity)
            x = sample(field, noise, steps=steps_for(budget), solver=solver, grid=grid)
            assert len(calls) <= budget, (name, budget, len(calls))
            rows[budget] = {**error(x), "evaluations": len(calls), "steps": steps_for(budget)}
    for name, build in diffusers_methods().items():
        rows = result["diffusers"][name] = {}
        for budget in BUDGETS:
            x, calls = drive(build(budget), mixture.velocity, noise.float())
            assert calls <= budget, (name, budget, calls)
            rows[budget] = {**error(x), "evaluations": calls}
    return result


def best(rows: dict, budget: int) -> tuple[str, float]:
    return min(((name, r[budget]["error"]) for name, r in rows.items()), key=lambda item: item[1])


# --- part 2: Fashion-MNIST ------------------------------------------------------------------------------------------

FASHION_IMAGES, FASHION_NUM, FASHION_BUDGETS = 60_000, 1000, (4, 8, 16)
FASHION_ISLANDS = ("euler uniform", "heun uniform", "dpm2m uniform", "unipc uniform", "unipc logsnr")
FASHION_DIFFUSERS = ("Euler shift 1", "Heun shift 1", "DPM++(2M) shift 1", "UniPC-2 shift 1")
FASHION_REFERENCE = ("heun", 24)  # 47 evaluations on the uniform grid: near what the network's ODE converges to


def fashion_config(run_dir: Path, images: int) -> dict:
    return {"run_dir": str(run_dir), "seed": 0,
            "data": {"source": "fashion_mnist"},
            "model": dict(UNET),
            "flow": {"path": "rectified_flow", "prediction": "velocity", "time_sampler": "logit_normal"},
            "train": {"images": images, "batch_size": 128, "lr": 1e-3, "warmup_images": min(8000, images // 4),
                      "precision": "bf16", "ema_halflife_images": min(16000, images // 4), "checkpoint_every": images,
                      "log_every": max(images // 8, 128)},
            "sample": {"num": 16, "steps": 8, "solver": "unipc", "grid": "logsnr", "batch_size": 500,
                       "precision": "bf16"},
            "eval": {"num": 1000}}


def fashion(work: Path = WORK, images: int = FASHION_IMAGES, num: int = FASHION_NUM,
            budgets: tuple = FASHION_BUDGETS) -> dict:
    """FD of `num` samples against evaluations for Islands' solvers and diffusers' schedulers on one network.
    Trains it first unless `work` already holds it; FDs already measured are read back from work/fd.json."""
    work.mkdir(parents=True, exist_ok=True)
    cfg = validate(fashion_config(work / "unet", images))
    start = time.perf_counter()
    train(cfg, progress=False)  # returns at once when the run has its images
    print(f"  U-Net on Fashion-MNIST: {images} training images ({time.perf_counter() - start:.0f} s)", flush=True)
    denoiser, cfg, info = load_denoiser(Path(cfg.run_dir))
    shape, classes = tuple(info["shape"]), info["num_classes"]
    labels = class_labels(num, classes)
    noise = streams.normal(cfg.seed, list(range(num)), shape, "sample")  # the noise `generate` draws, for diffusers
    evaluator = Evaluator(build_data(cfg.data, cfg.seed), cfg.eval, cfg.seed)
    done_path = work / "fd.json"
    done = json.loads(done_path.read_text()) if done_path.exists() else {}
    batch = 500

    def scored(key: str, draw) -> dict:
        if key not in done:
            begin = time.perf_counter()
            x, evaluations = draw()
            done[key] = {"fd": evaluator([(x.clamp(-1, 1), labels)])["fd"], "evaluations": evaluations,
                         "seconds": time.perf_counter() - begin}
            done_path.write_text(json.dumps(done, indent=1))
            print(f"  {key}: FD {done[key]['fd']:.3f} ({evaluations} evaluations)", flush=True)
        return done[key]

    def islands(solver, grid, steps):
        opts = SampleConfig(steps=steps, solver=solver, grid=grid, batch_size=batch, precision="bf16")
        return generate(denoiser, shape, num, opts, cfg.seed, labels), evaluations_per_sample(solver, steps)

    def peer(build, budget):
        out, calls = [], 0
        for lo in range(0, num, batch):
            y = labels[lo:lo + batch]
            with torch.no_grad(), sampling_precision("bf16", noise.device):
                x, calls = drive(build(budget), lambda x, t, y=y: denoiser(x, t, y), noise[lo:lo + batch])
            out.append(x.float())
        return torch.cat(out), calls

    methods, peers = islands_methods(), diffusers_methods()
    key = f"images={images} num={num}"
    result = {"islands": {}, "diffusers": {}}
    solver, steps = FASHION_REFERENCE
    result["reference"] = {f"{solver} uniform, {steps} steps": scored(
        f"{key} reference {solver} {steps}", lambda: islands(solver, "uniform", steps))}
    for name in FASHION_ISLANDS:
        solver, grid, steps_for = methods[name]
        rows = result["islands"][name] = {}
        for b in budgets:
            steps = steps_for(b)
            rows[b] = scored(f"{key} {name} B={b}", lambda s=solver, g=grid, n=steps: islands(s, g, n))
    for name in FASHION_DIFFUSERS:
        rows = result["diffusers"][name] = {}
        for b in budgets:
            rows[b] = scored(f"{key} {name} B={b}", lambda p=peers[name], b=b: peer(p, b))
    return result


# --- the report -----------------------------------------------------------------------------------------------------

def run() -> dict:
    setup()
    found, verdicts = {}, []
    for seed, (label, mixture) in enumerate(mixtures().items()):
        found[label] = res = mixture_errors(mixture, seed)
        names = list(res["islands"]) + list(res["diffusers"])
        rows = [[("Islands " if name in res["islands"] else "diffusers ") + name,
                 *((res["islands"] | res["diffusers"])[name][b]["error"] for b in BUDGETS)] for name in names]
        print(f"\n{label}: mean L2 error to dopri5 (rtol {RTOL:g}; its own error {res['reference_error']:.1e})")
        print(table(["method"] + [f"{b} evals" for b in BUDGETS], [[r[0], *(f"{e:.2e}" for e in r[1:])] for r in rows]))
        summary, res["best"] = [], {}
        for b in BUDGETS:
            (ours, e_ours), (theirs, e_theirs) = best(res["islands"], b), best(res["diffusers"], b)
            res["best"][b] = {"islands": ours, "islands_error": e_ours, "diffusers": theirs,
                              "diffusers_error": e_theirs, "ratio": e_theirs / e_ours}
            o, t = res["islands"][ours][b], res["diffusers"][theirs][b]
            summary.append([b, ours, f"{e_ours:.2e}", f"{o['median']:.2e}", o["other_mode"], theirs,
                            f"{e_theirs:.2e}", f"{t['median']:.2e}", t["other_mode"], f"{e_theirs / e_ours:.2f}"])
            if b in TARGET_BUDGETS:
                verdicts.append((label, b, e_theirs / e_ours))
        print(table(["evals", "Islands' best", "error", "median", "other mode", "diffusers' best", "error", "median",
                     "other mode", "diffusers / Islands"], summary))

    no_worse = all(ratio >= 1.0 for _, _, ratio in verdicts)
    better = all(ratio >= BETTER_BY for _, b, ratio in verdicts if b == BETTER_AT)
    print(f"\ntarget: Islands' best no worse than diffusers' best at {TARGET_BUDGETS} evaluations on both mixtures: "
          f"{'met' if no_worse else 'NOT met'}; at least {BETTER_BY}x better at {BETTER_AT}: "
          f"{'met' if better else 'NOT met'}")
    for label, b, ratio in verdicts:
        print(f"  {label}, {b} evaluations: diffusers' best / Islands' best = {ratio:.2f}")

    print("\nFashion-MNIST: FD (classifier features) against network evaluations")
    found["fashion"] = fash = fashion()
    (ref_name, ref), = fash["reference"].items()
    print(f"  reference, {ref_name} ({ref['evaluations']} evaluations): FD {ref['fd']:.3f}")
    rows = [[("Islands " if lib == "islands" else "diffusers ") + name, *(r[b]["fd"] for b in FASHION_BUDGETS)]
            for lib in ("islands", "diffusers") for name, r in fash[lib].items()]
    print(table(["method"] + [f"{b} evals" for b in FASHION_BUDGETS], rows))
    figure(found)
    save("samplers", {"results": found, "met": {"no_worse": no_worse, "better_at_8": better},
                      "settings": {"samples": SAMPLES, "rtol": RTOL, "budgets": BUDGETS,
                                   "error": "mean over samples of the L2 distance to dopri5's endpoint, same noise",
                                   "fashion": {"images": FASHION_IMAGES, "num": FASHION_NUM,
                                               "budgets": FASHION_BUDGETS, "precision": "bf16 network, fp32 solver"}}})
    return {"met": no_worse and better}


def figure(found: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    labels = [k for k in found if k != "fashion"]
    fig, axes = plt.subplots(1, len(labels) + 1, figsize=(5.2 * (len(labels) + 1), 4.2), dpi=100)
    for ax, label in zip(axes, labels, strict=False):
        res = found[label]
        for lib, style in (("islands", "-"), ("diffusers", "--")):
            families = {}
            for name, rows in res[lib].items():  # each family's best configuration (by its error summed over B)
                family = name.split()[0]
                score = sum(math.log(rows[b]["error"]) for b in BUDGETS)
                if family not in families or score < families[family][0]:
                    families[family] = (score, name)
            for _, name in families.values():
                rows = res[lib][name]
                ax.plot(BUDGETS, [rows[b]["error"] for b in BUDGETS], style, marker="o", ms=3,
                        label=("Islands " if lib == "islands" else "diffusers ") + name)
        ax.set(xscale="log", yscale="log", xlabel="network evaluations", ylabel="mean L2 error to dopri5",
               title=f"{label} (dopri5's own error {res['reference_error']:.0e})")
        ax.set_xticks(BUDGETS, [str(b) for b in BUDGETS], minor=False)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.legend(fontsize=7)
    ax, fash = axes[-1], found["fashion"]
    for lib, style in (("islands", "-"), ("diffusers", "--")):
        for name, rows in fash[lib].items():
            ax.plot(FASHION_BUDGETS, [rows[b]["fd"] for b in FASHION_BUDGETS], style, marker="o", ms=3,
                    label=("Islands " if lib == "islands" else "diffusers ") + name)
    (ref_name, ref), = fash["reference"].items()
    ax.axhline(ref["fd"], color="0.6", ls=":", lw=1, label=f"{ref_name} ({ref['evaluations']} evals)")
    ax.set(xscale="log", yscale="log", xlabel="network evaluations", ylabel="FD (classifier features)",
           title="Fashion-MNIST U-Net, 1000 samples")
    ax.set_xticks(FASHION_BUDGETS, [str(b) for b in FASHION_BUDGETS], minor=False)
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.legend(fontsize=7)
    fig.tight_layout()
    FIGURES.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURES / "samplers.png")
    plt.close(fig)


if __name__ == "__main__":
    run()
