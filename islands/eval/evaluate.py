"""Metrics of generated samples against the data: what `islands eval` and training-time evaluation compute.

Samples are generated in batches, sample i from the noise keyed on (seed, i), and only their features
are kept, so the numbers depend neither on the batch size nor on how many ranks trained the model.
Reference statistics are cached per data set (by hash) and feature network.
"""

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from islands.conditions import NO_REQUEST, SampleRequest, condition_kind
from islands.config import MIN_SAMPLES, ConfigError, EvalConfig, SampleConfig, revalidate
from islands.data import build_data, judged_on
from islands.data.gmm import GMMSource
from islands.data.latents import open_data_space, stored_latents
from islands.data.sources import Source
from islands.errors import CheckpointError, DataError
from islands.eval import exact, metrics
from islands.eval.clip_judge import load_clip_judge
from islands.eval.contrastive import load_judge
from islands.eval.features import (
    TRUSTED_MODULES,
    ClassifierFeatures,
    Features,
    Pixels,
    cache_dir,
    data_fingerprint,
    load_classifier,
    load_torch_features,
    trusted_factory,
)
from islands.eval.prompt_following import PromptJudge, held_out, prompt_following
from islands.flow.denoiser import Denoiser
from islands.generate import Sampler, open_run
from islands.rundir import CONFIG, atomic_write_text, describe_run, is_run_dir, latest_checkpoint, read_npz

SAMPLE_METRICS = ("fd", "kid", "precision_recall", "density_coverage", "class_balance")  # from samples alone
PROMPT_METRICS = ("prompt_following",)  # captioned images, from samples drawn for prompts
EXACT_METRICS = ("nll", "swd", "mode_mass")  # Gaussian mixtures, from samples alone
DENOISER_METRICS = ("velocity_mse",)  # Gaussian mixtures, from the model itself
REFERENCE_MAX = 10_000  # data examples whose features KID, precision/recall and density/coverage compare against
# Names that used to mean something else, with what to ask for instead.
RENAMED = {"coverage": "'coverage' is now class_balance (the classes' shares against the data's); density_coverage "
                       "gives Naeem et al.'s density and coverage"}


def available_metrics(source: Source, features: Features | None, with_denoiser: bool) -> list[str]:
    # class_balance needs a classifier's predictions
    names = [m for m in SAMPLE_METRICS if m != "class_balance" or isinstance(features, ClassifierFeatures)]
    if source.captioned and len(source.shape) == 3:
        names += list(PROMPT_METRICS)
    if isinstance(source, GMMSource):
        names += list(EXACT_METRICS) + (list(DENOISER_METRICS) if with_denoiser else [])
    return names


def default_features(source: Source) -> str:
    if len(source.shape) != 3:
        return "pixels"
    return "contrastive" if source.captioned else "classifier" if source.num_classes else "pixels"


def build_features(cfg: EvalConfig, source: Source, seed: int = 0, progress: bool = False) -> Features:
    kind = cfg.features or default_features(source)
    if kind == "pixels":
        return Pixels()
    if kind == "contrastive":
        return load_judge(source, seed, cfg.judge_epochs, progress).features()
    if kind == "classifier":
        return load_classifier(source, seed, cfg.classifier_epochs, progress=progress)
    refuse_untrusted_features(cfg)
    return load_torch_features(cfg.feature_net, cfg.feature_weights, cfg.feature_size, cfg.feature_channels)


def refuse_untrusted_features(cfg: EvalConfig) -> None:
    """Torch features that cannot be built, or whose module this machine does not trust, refused in one line: for a
    run to call before it trains, so that its first evaluation does not stop it."""
    if cfg.features != "torch":
        return
    if not (cfg.feature_net and cfg.feature_weights):
        raise ConfigError("eval.features: 'torch' needs eval.feature_net (module:function) and eval.feature_weights")
    trusted_factory(cfg.feature_net)


def build_judge(cfg: EvalConfig, source: Source, seed: int = 0, progress: bool = False) -> PromptJudge:
    """A user's CLIP folder (eval.prompt_judge), or Islands' contrastive judge trained on the data (cached)."""
    if cfg.prompt_judge:
        return load_clip_judge(cfg.prompt_judge)
    return load_judge(source, seed, cfg.judge_epochs, progress)


def trusted_features(cfg: EvalConfig, feature_net: str | None, config_file: Path, option: str) -> EvalConfig:
    """Evaluation settings read from a run folder's `config_file`, with the feature module the user named
    (`feature_net`; None: none). Torch features import and run that module, and a run folder may have come from
    another island: the module its config names is never imported on its word alone. `option` is how the user
    names one on the command line ("--feature-net ", "eval.feature_net="). Either way the module must also be one
    the user's machine trusts (ISLANDS_TRUSTED_MODULES, islands/eval/features.py), checked here before any work."""
    key = option.rstrip(" =")
    if feature_net is not None:
        trusted_factory(feature_net, key)
        return revalidate(cfg, "eval", feature_net=feature_net)
    if cfg.features != "torch":
        return cfg
    if cfg.feature_net is None:
        raise ConfigError(f"{key}: torch features need the module that builds their network: "
                          f"pass {option}MODULE:FUNCTION")
    module = cfg.feature_net.partition(":")[0]
    raise ConfigError(f"{key}: {config_file} names {cfg.feature_net!r} to build the feature network, and code named "
                      f"only by a run folder is never imported: pass {option}{cfg.feature_net} to trust it, with "
                      f"{module} in {TRUSTED_MODULES}")


class Evaluator:
    """Holds what does not change between evaluations: the features, the data's statistics and labels."""

    def __init__(self, source: Source, cfg: EvalConfig, seed: int = 0, progress: bool = False, device="cpu"):
        """`device`: where the denoiser handed to each call runs (its exact velocity error is asked there)."""
        self.source, self.cfg, self.seed, self.progress, self.device = source, cfg, seed, progress, device
        self.features = build_features(cfg, source, seed, progress)
        self._reference, self._judge = None, None

    def judge(self) -> PromptJudge:
        if self._judge is None:
            self._judge = build_judge(self.cfg, self.source, self.seed, self.progress)
        return self._judge

    def prompts(self, num: int) -> list[str]:
        """The prompts of `num` samples of a text-conditioned model: the held-out captions (islands/eval/
        prompt_following.py) in an order drawn from the seed, in turn."""
        captions = self.source.captions(range(len(self.source)))
        chosen = held_out(captions)
        if not chosen:
            raise DataError(f"{self.source!r}: none of its {len(captions)} captions is held out of the prompt judge's "
                            f"training; prompt following needs a larger captioned set")
        order = torch.randperm(len(chosen), generator=torch.Generator().manual_seed(self.seed))
        return [captions[chosen[order[i % len(chosen)]]] for i in range(num)]

    def real_prompt_following(self, num: int) -> dict:
        """The ceiling: the real images of the first `num` prompts (each the image its caption belongs to), judged as
        samples would be."""
        captions = self.source.captions(range(len(self.source)))
        where = {c: i for i, c in enumerate(captions)}
        prompts = self.prompts(num)
        x = self.source.get([where[p] for p in prompts])[0]
        return prompt_following(self.judge().images(x), prompts, self.judge())

    def metrics(self, with_denoiser: bool) -> list[str]:
        present = available_metrics(self.source, self.features, with_denoiser)
        if not self.cfg.metrics:
            return present
        renamed = [m for m in self.cfg.metrics if m in RENAMED]
        if renamed:
            raise ConfigError(f"eval.metrics: {RENAMED[renamed[0]]}")
        unknown = [m for m in self.cfg.metrics if m not in present]
        if unknown:
            raise ConfigError(f"eval.metrics: {unknown[0]!r} does not apply here; choose from {', '.join(present)}")
        return list(self.cfg.metrics)

    def reference(self) -> dict:
        """The data's feature statistics (cached on disk), a fixed subset's features, and its class shares."""
        if self._reference is None:
            fingerprint = data_fingerprint(self.source)
            path = cache_dir() / "stats" / f"{fingerprint[:16]}-{self.features.name}.npz"
            if path.exists():
                stats = metrics.GaussianStats.load(path)
            else:
                stats = metrics.feature_stats(self.features.of_source(self.source, self.progress))
                path.parent.mkdir(parents=True, exist_ok=True)
                stats.save(path)
            g = torch.Generator().manual_seed(self.seed)
            subset = torch.randperm(len(self.source), generator=g)[:REFERENCE_MAX].sort().values.tolist()
            x, y = self.source.get(subset)
            self._reference = {"stats": stats, "features": self.features(x), "x": x, "labels": y}
        return self._reference

    @torch.no_grad()
    def __call__(self, samples, denoiser: Denoiser | None = None, prompts: list[str] | None = None) -> dict:
        """samples: an iterable of batches (x, labels or None); `prompts`: the prompt each sample was drawn for, in
        order (a text-conditioned model's). Returns {metric: value}."""
        names = self.metrics(with_denoiser=denoiser is not None)
        judged = prompts is not None and "prompt_following" in names
        feats, predicted, kept, asked, embedded = [], [], [], [], []
        for x, labels in samples:
            feats.append(self.features(x))
            if isinstance(self.features, ClassifierFeatures):
                predicted.append(self.features.predict(x))
            if isinstance(self.source, GMMSource):
                kept.append(x)
            if labels is not None and labels.dim() == 1:  # class labels (a caption's condition is not one)
                asked.append(labels)
            if judged:
                embedded.append(self.judge().images(x))
        feats = torch.cat(feats)
        short = [m for m in names if len(feats) < MIN_SAMPLES.get(m, 1)]
        if short:  # a samples file may hold fewer than eval.num would allow
            raise DataError(f"{len(feats)} samples are too few for {', '.join(short)} "
                            f"(at least {max(MIN_SAMPLES[m] for m in short)}); choose other --metrics")
        ref = self.reference()
        out = {"num_samples": len(feats), "features": self.features.name}
        if "fd" in names:
            out["fd"] = metrics.frechet_distance(metrics.feature_stats(feats), ref["stats"])
        if "kid" in names:
            out["kid"], out["kid_se"] = metrics.kid(ref["features"], feats)  # kid_se: the standard error
        if "precision_recall" in names:
            out["precision"], out["recall"] = metrics.precision_recall(ref["features"], feats)
        if "density_coverage" in names:
            out["density"], out["coverage"] = metrics.density_coverage(ref["features"], feats)
        if "class_balance" in names:
            predicted = torch.cat(predicted)
            balance = metrics.class_balance(predicted, ref["labels"], self.source.num_classes)
            out["class_balance_tv"], out["class_balance"] = balance["total_variation"], balance
            if asked:  # a conditional model: how often the classifier sees the class that was asked for
                out["label_accuracy"] = (predicted == torch.cat(asked)).double().mean().item()
        if judged:
            out.update(prompt_following(torch.cat(embedded), list(prompts), self.judge()))
            out["prompt_judge"] = self.judge().name
        if isinstance(self.source, GMMSource):
            gmm, x = self.source.mixture, torch.cat(kept).double()
            if "nll" in names:
                out["nll"] = exact.mean_nll(gmm, x)
                out["nll_data"] = exact.mean_nll(gmm, ref["x"].double())  # the same measure on the data
            if "swd" in names:
                out["swd"] = exact.sliced_wasserstein(x, ref["x"].double(), seed=self.seed)
            if "mode_mass" in names:
                mass = exact.mode_mass(gmm, x)
                out["mode_mass_error"], out["mode_mass"] = mass["max_abs_error"], mass["mass"]
            if "velocity_mse" in names:
                out["velocity_mse"] = exact.velocity_error(denoiser, gmm, seed=self.seed, device=self.device)
        return out


def generated(sampler: Sampler, num: int, progress: bool = False, device="cpu", seed: int | None = None,
              request: SampleRequest = NO_REQUEST):
    """Batches of (samples, conditions) on the CPU from the per-sample noise stream of `seed` (the run's if None),
    drawn on `device` for the conditions `request` asks of the run's kind (by default every class in turn);
    images clamped to the data range."""
    conditions = sampler.conditions(num, request)
    bar = tqdm(total=num, unit="sample", disable=not progress, desc="sampling")
    for lo in range(0, num, sampler.opts.batch_size):
        n = min(sampler.opts.batch_size, num - lo)
        batch_conditions = None if conditions is None else conditions[lo:lo + n]
        x = sampler.generate(n, batch_conditions, seed, first=lo, device=device)
        bar.update(n)
        yield (x.clamp(-1, 1) if len(sampler.shape) == 3 else x), batch_conditions
    bar.close()


def evaluate_sampler(evaluator: Evaluator, sampler: Sampler, num: int, progress: bool = False, device="cpu",
                     seed: int | None = None, clock: dict | None = None) -> dict:
    """`num` samples of `sampler` scored by `evaluator`, drawn for what the run's condition kind asks of the data (a
    text-conditioned model's for the evaluator's prompts, so that prompt following is measured too); `clock` (given)
    gets the seconds spent sampling."""
    request = condition_kind(sampler.cfg.model).evaluation_request(evaluator, num)
    batches = generated(sampler, num, progress, device, seed, request)
    return evaluator(batches if clock is None else timed(batches, clock), sampler.denoiser,
                     prompts=list(request.prompts) or None)


def timed(batches, clock: dict):
    """Yield from `batches`, adding to clock["seconds"] the time spent producing them but not the consumer's (the
    metrics): what sampling costs."""
    clock.setdefault("seconds", 0.0)
    batches = iter(batches)
    while True:
        start = time.perf_counter()
        batch = next(batches, None)
        clock["seconds"] += time.perf_counter() - start
        if batch is None:
            return
        yield batch


def from_file(path: Path, batch: int = 512):
    """Batches of (x, y) from a samples.npz written by `islands sample` (read without unpickling)."""
    try:
        data = read_npz(path, ("x", "y"), required=("x",))
    except ValueError as err:
        raise CheckpointError(f"cannot read samples file {path}: {err}") from None
    x, y = torch.from_numpy(data["x"]).float(), torch.from_numpy(data["y"]) if "y" in data else None
    for lo in range(0, len(x), batch):
        yield x[lo:lo + batch], None if y is None else y[lo:lo + batch]


def find_run(path: Path) -> Path:
    """The run directory a samples.npz came from: the nearest parent holding config.yaml and model.json."""
    for parent in [path.parent, *path.parents]:
        if is_run_dir(parent):
            return parent
    raise CheckpointError(f"{path}: no run directory above it; pass --run RUN_DIR to name the data to compare with")


def evaluate_target(target: Path, num: int | None = None, steps: int | None = None, metric_names=None,
                    features: str | None = None, batch_size: int | None = None, run_dir: Path | None = None,
                    progress: bool = True, feature_net: str | None = None,
                    feature_weights: str | None = None) -> tuple[dict, Path]:
    """Evaluate a run directory (generating `num` samples) or a samples.npz; add the result to metrics.json. Torch
    features are built by `feature_net` (which implies them), never by the module the run's config names."""
    target = Path(target)
    is_file = target.suffix == ".npz"
    if not target.exists():
        raise CheckpointError(f"{target} does not exist")
    run = Path(run_dir) if run_dir else (find_run(target) if is_file else target)
    cfg, info = describe_run(run)
    # --num too: the metrics asked for need enough samples
    updates = {"metrics": metric_names, "features": features or ("torch" if feature_net else None),
               "feature_weights": feature_weights, "num": num}
    eval_cfg = revalidate(cfg.eval, "eval", **{k: v for k, v in updates.items() if v is not None})
    eval_cfg = trusted_features(eval_cfg, feature_net, run / CONFIG, "--feature-net ")
    reference = judged_on(build_data(cfg.data, cfg.seed))
    if stored_latents(cfg) is not None:  # the images the stored latents decode to
        reference = open_data_space(cfg, run).reference(reference)
    evaluator = Evaluator(reference, eval_cfg, cfg.seed, progress)
    if is_file:
        try:
            result = evaluator(from_file(target))
        except DataError as err:
            raise DataError(f"{target}: {err}") from None
        key, out = entry_key(f"{target.name} run={run.resolve()}", evaluator), target.parent / "metrics.json"
    else:
        sampler = open_run(run, {"steps": steps, "batch_size": batch_size})
        num = eval_cfg.num
        clock = {}
        result = evaluate_sampler(evaluator, sampler, num, progress, clock=clock)
        result["seconds_per_sample"] = clock["seconds"] / num
        key = entry_key(f"images={int(latest_checkpoint(run).name)}", evaluator, num, sampler.opts)
        out = run / "metrics.json"
    return record(out, key, result), out


def entry_key(subject: str, evaluator: Evaluator, num: int | None = None, opts: SampleConfig | None = None) -> str:
    """metrics.json's key of one evaluation of `subject` (a checkpoint, a samples file, an ensemble): everything that
    changes its numbers, so that another evaluation is kept beside it, and the same one replaces it. The batch size
    changes nothing and is left out."""
    sampled = [] if opts is None else [f"num={num}", f"steps={opts.steps}", f"solver={opts.solver}",
                                       f"grid={opts.grid}", f"guidance={opts.guidance}", f"precision={opts.precision}"]
    asked = ",".join(sorted(evaluator.cfg.metrics)) if evaluator.cfg.metrics else "all"
    return " ".join([subject, *sampled, f"features={evaluator.features.name}", f"metrics={asked}"])


def record(path: Path, key: str, result: dict) -> dict:
    """Add one evaluation to metrics.json under `key`, keeping the others (written whole, then renamed)."""
    found = json.loads(path.read_text()) if path.exists() else {}
    found[key] = result
    atomic_write_text(path, json.dumps(found, indent=1))
    return result


def format_table(result: dict) -> str:
    rows = [(k, f"{v:.6g}" if isinstance(v, float) else str(v)) for k, v in result.items()
            if isinstance(v, (int, float, str))]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
