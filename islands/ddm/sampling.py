"""One way to open anything Islands samples from: a run, a run of timestep-range experts, or an ensemble, as a
`Sampler` (islands/generate.py) that `islands sample`, `islands ddm` and the benchmarks draw from alike."""

import functools
from pathlib import Path

from islands.conditions import NO_REQUEST, SampleRequest
from islands.config import load_config
from islands.data.captions import recorded_text_encoder
from islands.data.latents import open_data_space
from islands.ddm.ensemble import MANIFEST, ancestral_assignment, load_condition_prior, load_ensemble
from islands.ddm.mixture import DEFAULT_ROUTING, parse_routing
from islands.ddm.time_gate import load_time_gate
from islands.errors import ConfigError
from islands.flow.samplers import evaluations_per_sample
from islands.generate import Sampler, check_sample_count, check_samples_folder, open_run, sample_options, write_samples


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
        return Sampler(gate, cfg, info.shape, info.num_classes, sample_options(cfg, options, device),
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
    shape = manifest.shape  # load_ensemble ensured one
    opts = opts.model_copy(update={"batch_size": mixture.samples_at_once(opts.batch_size)})
    assignment = functools.partial(ancestral_assignment, mixture, manifest,
                                   condition_prior=load_condition_prior(root, manifest))
    # on latents: the autoencoder every member trained on, as the manifest recorded it
    space = open_data_space(cfg, root, device, sha256=manifest.autoencoder_sha256)
    return Sampler(mixture, cfg, shape, cfg.model.num_classes, opts, assignment, manifest, space,
                   manifest.text_encoder_sha256)


def sample_to_folder(target: Path, out: Path, num: int, options: dict | None = None,
                     request: SampleRequest = NO_REQUEST, seed: int | None = None, routing: str | None = None,
                     max_loaded: int | None = None, use_ema: bool = True, distributed: bool = False,
                     progress: bool = True, then: list[Path] = ()) -> list[str]:
    """`islands sample` as a function: `num` samples of a run, range experts or an ensemble (`target`) written to
    `out` (new, empty, or one it wrote before): samples.npz, its picture and, drawn for prompts (sample i for prompt
    i mod P), prompts.txt. `request`: what they are conditioned on (the run's kind reads it, and refuses another
    kind's). `distributed`: under torchrun, the experts (or range experts) spread over the ranks. `then`: a cascade,
    each run in turn drawing its samples for the previous one's as its condition images (the options apply to every
    stage). Returns what it says to people: the files written and what the sampling cost."""
    target, out = Path(target), Path(out)
    check_samples_folder(out)
    if distributed and not ((target / MANIFEST).exists() or (target / "tstages").is_dir()):
        raise ConfigError(f"--distributed: {target} is not an ensemble directory (no {MANIFEST}) nor a run of "
                          "timestep-range experts (no tstages/)")
    sampler = open_sampler(target, options, use_ema=use_ema, routing=routing, max_loaded=max_loaded)
    check_sample_count(num, sampler.shape)
    labels, prompts = sampler.conditions(num, request), list(request.prompts)
    seed = sampler.cfg.seed if seed is None else seed
    if distributed and then:
        raise ConfigError("--then: a cascade samples in one process; leave out --distributed")
    if distributed:  # under torchrun: each rank holds some of the experts, or one range expert
        return _sample_distributed(sampler, out, num, seed, labels, prompts)
    x = sampler.generate(num, labels, seed, progress=progress)
    for stage in then:  # the previous stage's samples are this one's condition images
        refined = open_run(stage, options, use_ema)
        x = refined.generate(num, refined.conditions(num, SampleRequest(images=x)), seed, progress=progress)
    said = _write(x, labels, prompts, out)
    if sampler.manifest is not None:
        opts = sampler.opts
        one_model = evaluations_per_sample(opts.solver, opts.steps, opts.guidance if labels is not None else 1.0)
        said.append(f"expert evaluations per sample: {sampler.denoiser.evaluations / num:.1f} "
                    f"({routing or DEFAULT_ROUTING} routing; one model would take {one_model})")
    return said


def _write(x, labels, prompts: list[str], out: Path) -> list[str]:
    drawn_for = [prompts[i % len(prompts)] for i in range(len(x))] if prompts else None
    written = write_samples(x, None if prompts else labels, out, drawn_for)
    if prompts:
        (out / "prompts.txt").write_text("".join(f"{prompt}\n" for prompt in drawn_for))
        written.append(out / "prompts.txt")
    return [f"wrote {path}" for path in written]


def _sample_distributed(sampler: Sampler, out: Path, num: int, seed: int, labels, prompts: list[str]) -> list[str]:
    from islands.ddm.expert_parallel import sample_distributed, sample_range_pipeline
    from islands.parallel.launch import close_world, init_world

    world = init_world()
    try:
        if sampler.manifest is None:  # timestep-range experts behind their gate
            x, stats = sample_range_pipeline(sampler.denoiser, sampler.shape, num, sampler.opts, seed, labels, world)
        else:
            x, stats = sample_distributed(sampler, num, seed, labels, world)
    finally:
        close_world()
    if not world.is_main:
        return []
    evaluations = (f", {stats['expert_evaluations_per_sample']:.1f} expert evaluations per sample"
                   if "expert_evaluations_per_sample" in stats else "")
    return [*_write(sampler.space.decode(x), labels, prompts, out),
            f"{world.size} ranks: {stats['images_per_s']:.1f} images/s, {stats['bytes_moved'] / 1e6:.2f} MB moved "
            f"between ranks{evaluations}"]
