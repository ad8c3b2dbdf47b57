"""One way to open anything Islands samples from: a run, a run of timestep-range experts, or an ensemble, as a
`Sampler` (islands/generate.py) that `islands sample`, `islands ddm` and the benchmarks draw from alike."""

import functools
from pathlib import Path

from islands.config import load_config
from islands.data.captions import recorded_text_encoder
from islands.data.latents import open_data_space
from islands.ddm.ensemble import MANIFEST, ancestral_assignment, load_condition_prior, load_ensemble
from islands.ddm.mixture import DEFAULT_ROUTING, parse_routing
from islands.ddm.time_gate import load_time_gate
from islands.errors import ConfigError
from islands.generate import Sampler, open_run, sample_options


def open_sampler(path: Path, options: dict | None = None, use_ema: bool = True, routing: str | None = None,
                 max_loaded: int | None = None, device="cpu", seed: int | None = None) -> Sampler:
    """`path` opened for sampling, with `options` (keys of the sample section; None: the config's) in place of its
    sample section's: an ensemble under `routing` (its default if None) with at most `max_loaded` experts in memory
    (`seed`, the config's if None, keys the `sample` policy's draws), timestep-range experts behind their gate
    (RUN/tstages), or a run's latest checkpoint."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return open_ensemble(path, options, routing or DEFAULT_ROUTING, max_loaded, device, seed)
    if routing or max_loaded:
        option = "--routing" if routing else "--max-loaded"
        raise ConfigError(f"{option}: {path} is not an ensemble directory (no {MANIFEST})")
    if (path / "tstages").is_dir():
        gate, cfg, info = load_time_gate(path, use_ema)
        return Sampler(gate, cfg, tuple(info["shape"]), info["num_classes"], sample_options(cfg, options, device),
                       space=open_data_space(cfg, Path(cfg.run_dir), device),  # the ranges trained on one autoencoder
                       text_encoder_sha256=recorded_text_encoder(Path(cfg.run_dir)))
    return open_run(path, options, use_ema, device)


def open_ensemble(root: Path, options: dict | None = None, routing: str = DEFAULT_ROUTING,
                  max_loaded: int | None = None, device="cpu", seed: int | None = None) -> Sampler:
    """An ensemble as one `Sampler`: its experts' calls as large as one model's (`sample.batch_size`) and never
    larger, so that it draws `Mixture.samples_at_once` samples at once (K batches for a one-expert policy), each
    sample's ancestral expert drawn by its own stream."""
    try:
        parse_routing(routing)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    cfg = load_config(root / "config.yaml")
    opts = sample_options(cfg, options, device)
    mixture, manifest = load_ensemble(root, routing, max_loaded, cfg.seed if seed is None else seed, device,
                                      call_batch=opts.batch_size)
    shape = next(tuple(e["shape"]) for e in manifest["experts"] if "shape" in e)  # load_ensemble ensured one
    opts = opts.model_copy(update={"batch_size": mixture.samples_at_once(opts.batch_size)})
    assignment = functools.partial(ancestral_assignment, mixture, manifest,
                                   condition_prior=load_condition_prior(root, manifest))
    # on latents: the autoencoder every member trained on, as the manifest recorded it
    space = open_data_space(cfg, root, device, sha256=manifest.get("autoencoder_sha256"))
    return Sampler(mixture, cfg, shape, cfg.model.num_classes, opts, assignment, manifest, space,
                   manifest.get("text_encoder_sha256"))
