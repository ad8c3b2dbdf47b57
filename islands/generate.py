"""From a run directory to samples: load the denoiser, draw per-sample-seeded noise, integrate.

A `Sampler` is what every caller samples from (`islands sample`, `islands eval`, the trainer's reporters, `islands
ddm`, the benchmarks): a denoiser with the shape of one example, its condition, its sample options resolved and, for
an ensemble under ancestral routing, how each batch's samples are assigned their experts. `open_run` opens a run
directory; islands.ddm.sampling.open_sampler opens any run, a run of timestep-range experts or an ensemble.

Sample i always starts from the noise keyed on (seed, i), so the same seed gives the same sample
whatever the batch size or the number of samples asked for.
"""

import contextlib
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from islands.conditions import NO_REQUEST, SampleRequest, condition_kind, network_spec
from islands.config import Config, SampleConfig, revalidate
from islands.data import streams
from islands.data.captions import recorded_text_encoder
from islands.data.latents import open_data_space
from islands.data.space import PIXELS, DataSpace
from islands.errors import CheckpointError, ConfigError, IslandsWarning
from islands.flow.denoiser import Denoiser, NetworkDenoiser
from islands.flow.paths import build_path
from islands.flow.samplers import sample
from islands.images import save_samples_picture
from islands.nets import NetworkSpec, build_network
from islands.parallel import launch
from islands.rundir import atomic_write, checkpoint_weights, describe_run, latest_checkpoint
from islands.untrusted import WithoutInitialisation


def load_denoiser(run_dir: Path, use_ema: bool = True) -> tuple[NetworkDenoiser, Config, dict]:
    """The latest complete checkpoint's network (its EMA when there is one) as a canonical `Denoiser`."""
    cfg, info = describe_run(run_dir)
    if cfg.train.objective == "autoencoder":
        raise CheckpointError(f"{run_dir} trained an autoencoder, which draws no samples; its weights are in "
                              f"{Path(run_dir) / 'autoencoder'}")
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise CheckpointError(f"{run_dir} has no complete checkpoint yet")
    weights = checkpoint_weights(ckpt, use_ema)
    net = network_with_weights(network_spec(cfg.model, info.shape, info.num_classes), weights)
    path = build_path(cfg.flow.path, **cfg.flow.path_options())
    return NetworkDenoiser(net, path, cfg.flow.prediction), cfg, info


def uninitialised_network(spec: NetworkSpec, device="cpu") -> torch.nn.Module:
    """The network built on `device` without initialising it (no time spent, no global random numbers drawn), for
    weights about to be loaded. Not on the meta device: torch computes some meta tensors in Python (normal_, arange),
    whose first use imports torch._dynamo, 1 to 4 s of every `islands sample` on a 2-core CPU."""
    with torch.device(device), WithoutInitialisation():
        return build_network(spec)


def network_with_weights(spec: NetworkSpec, weights: dict, device="cpu") -> torch.nn.Module:
    """The network holding `weights` (strictly), in eval mode."""
    net = uninitialised_network(spec, device)
    net.load_state_dict(weights)
    return net.eval()


def resolve_precision(precision: str, trained: str, device: torch.device | str = "cpu") -> str:
    """`sample.precision` as it runs: "auto" is bf16 where the run trained in bf16 and `device` computes bf16
    natively (section 2 of docs/BENCHMARKS.md: 1.5x faster, samples moved by 0.1-0.3%), else fp32; an fp16 run
    samples in fp32, since bf16 rounds coarser than what it trained with. fp32 and bf16 stand as they are."""
    if precision != "auto":
        return precision
    return "bf16" if trained == "bf16" and launch.bf16_is_native(device) else "fp32"


def run_sample_options(opts: SampleConfig, cfg: Config, device: torch.device | str = "cpu") -> SampleConfig:
    """`opts` for sampling the run (or ensemble) of `cfg` on `device`, its "auto" precision resolved."""
    return opts.model_copy(update={"precision": resolve_precision(opts.precision, cfg.train.precision, device)})


def sample_options(cfg: Config, options: dict | None = None, device: torch.device | str = "cpu") -> SampleConfig:
    """The run's sample section with `options` (those not None) in place of its values, checked again, its "auto"
    precision resolved for sampling on `device`."""
    given = {k: v for k, v in (options or {}).items() if v is not None}
    return run_sample_options(revalidate(cfg.sample, "sample", **given) if given else cfg.sample, cfg, device)


@dataclass(frozen=True)
class Sampler:
    """A run, a run of timestep-range experts or an ensemble, opened for sampling."""

    denoiser: Denoiser
    cfg: Config  # the run's (or the ensemble's) resolved config
    shape: tuple  # of one example
    num_classes: int  # a class condition's: a class in [0, num_classes)
    opts: SampleConfig  # resolved; batch_size is how many samples are drawn at once
    assignment: Callable[[int], Callable] | None = None  # seed -> `generate`'s for_batch (ancestral routing)
    manifest: dict | None = None  # an ensemble's
    space: DataSpace = PIXELS  # where the samples go back to the data's own space
    text_encoder_sha256: str | None = None  # of the weights that encoded the captions it learnt (prompts are checked)

    def conditions(self, num: int, request: SampleRequest = NO_REQUEST) -> torch.Tensor | None:
        """The conditions of `num` samples asked for by `request`, made by the run's condition kind (a class in turn
        or the one asked for, prompts in turn, ...); None: unconditional."""
        return condition_kind(self.cfg.model).request(self, num, request)

    def for_batch(self, seed: int):
        """`generate`'s for_batch for the samples of `seed`'s stream: None but under ancestral routing."""
        return None if self.assignment is None else self.assignment(seed)

    def generate(self, num: int, condition: torch.Tensor | None = None, seed: int | None = None, first: int = 0,
                 progress: bool = False, device: torch.device | str = "cpu") -> torch.Tensor:
        """Samples first .. first + num - 1 of the stream keyed on `seed` (the run's by default), in the data's own
        space."""
        seed = self.cfg.seed if seed is None else seed
        x = generate(self.denoiser, self.shape, num, self.opts, seed, condition, first, progress, device,
                     self.for_batch(seed))
        # a batch at a time: an autoencoder decodes latents into images many times their size
        return torch.cat([self.space.decode(part) for part in x.split(self.opts.batch_size)])


def open_run(run_dir: Path, options: dict | None = None, use_ema: bool = True,
             device: torch.device | str = "cpu") -> Sampler:
    """A run directory's latest checkpoint opened for sampling, with `options` in place of its sample section's; a
    latent run's samples decoded by its autoencoder on `device`, once its weights are checked against the run's
    record."""
    denoiser, cfg, info = load_denoiser(Path(run_dir), use_ema)
    return Sampler(denoiser, cfg, info.shape, info.num_classes, sample_options(cfg, options, device),
                   space=open_data_space(cfg, Path(run_dir), device),
                   text_encoder_sha256=recorded_text_encoder(Path(run_dir)))


def sampling_precision(precision: str, device: torch.device):
    """bf16 autocast for the networks' convolutions and matmuls; the solver's state and arithmetic stay float32,
    since every Denoiser returns its velocity in the dtype of x. An "auto" that no run resolved is fp32."""
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


@torch.no_grad()
def generate(denoiser: Denoiser, shape: tuple[int, ...], num: int, opts: SampleConfig, seed: int,
             condition: torch.Tensor | None = None, first: int = 0, progress: bool = False,
             device: torch.device | str = "cpu", for_batch=None) -> torch.Tensor:
    """Samples first .. first + num - 1 of the stream keyed on `seed`, in batches of opts.batch_size.
    `for_batch(lo, hi, cond)`, if given, is the denoiser that draws the samples lo .. hi - 1, given their conditions
    (the mixture with each sample's ancestral expert assigned)."""
    launch.warn_if_bf16_is_slow("sample.precision", opts.precision, device)
    out = []
    bar = tqdm(total=num, unit="sample", disable=not progress, desc="sampling")
    for lo in range(0, num, opts.batch_size):
        hi = min(num, lo + opts.batch_size)
        noise = streams.normal(seed, list(range(first + lo, first + hi)), shape, "sample").to(device)
        cond = None if condition is None else condition[lo:hi].to(device)
        drawing = denoiser if for_batch is None else for_batch(first + lo, first + hi, cond)
        with sampling_precision(opts.precision, noise.device):
            x = sample(drawing, noise, steps=opts.steps, solver=opts.solver, grid=opts.grid,
                       guidance=opts.guidance, cond=cond, time_shift=opts.time_shift or 1.0)  # None: no run's
        out.append(x.float().cpu())
        bar.update(hi - lo)
    bar.close()
    return torch.cat(out)


SAMPLES_MARKER = ".islands-samples"  # in a folder `islands sample` wrote, which a later sample may write over


def check_samples_folder(out_dir: Path) -> None:
    """Refuse, before anything is sampled, an output that is a file, or a folder holding files Islands' sampling did
    not write (a run folder, a person's pictures): only a folder absent, empty or written by `write_samples` is
    written into."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out: {out_dir} is a file, not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / SAMPLES_MARKER).is_file():
        raise ConfigError(f"--out: {out_dir} holds files that islands sample did not write; give a new or empty "
                          "folder")


def check_sample_count(num: int, shape: tuple, device="cpu") -> None:
    """Refuse a --num whose samples alone would not fit in this machine's memory (they are held whole to be
    written), before any is drawn."""
    needed = 2 * num * math.prod(shape) * 4  # float32, and the clamped copy written
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed > available:
        raise ConfigError(f"--num: {num} samples of shape {tuple(shape)} need {needed / 2**30:.1f} GiB, more than "
                          f"this machine's {available / 2**30:.1f} GiB; sample fewer at a time (--seed and --num)")


def write_samples(x: torch.Tensor, labels: torch.Tensor | None, out_dir: Path,
                  captions: list[str] | None = None) -> list[Path]:
    """out_dir/samples.npz (array x, float32, data space; y when class-conditional, prompt when drawn for prompts)
    and a picture. Samples that are not finite are written too (they are what the model made), and counted in a
    warning."""
    out_dir = Path(out_dir)
    check_samples_folder(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SAMPLES_MARKER).touch()
    broken = int((~torch.isfinite(x.flatten(1))).any(1).sum())
    if broken:  # counted before clamping, which would turn an infinity into a valid-looking pixel
        warnings.warn(f"{broken} of {len(x)} samples are not finite (NaN or infinity); written to "
                      f"{out_dir / 'samples.npz'} all the same", IslandsWarning, stacklevel=2)
    if x.dim() == 4:  # images live in [-1, 1]; the ODE can overshoot it slightly
        x = x.clamp(-1, 1)
    arrays = {"x": x.numpy().astype(np.float32)}
    if labels is not None:
        arrays["y"] = labels.numpy()
    if captions is not None:  # each sample's prompt, as a unicode array (np.load reads it without pickle)
        arrays["prompt"] = np.array(captions, dtype=str)
    atomic_write(out_dir / "samples.npz", lambda f: np.savez(f, **arrays))
    name = "grid.png" if x.dim() == 4 else "scatter.png"
    picture = save_samples_picture(x[:256], out_dir / name, captions=captions and captions[:64])
    return [out_dir / "samples.npz", picture]
