"""A run as a folder diffusers loads on its own (`islands export RUN OUT/`).

OUT/unet/ or OUT/transformer/ holds the run's network as its own diffusers class (`save_pretrained`, safetensors),
with the EMA weights of the latest checkpoint, the ones `islands sample` draws with; OUT/scheduler/ the diffusers
scheduler of the run's path; OUT/model_index.json names both, as a diffusers pipeline folder does; and
OUT/islands_export.json records where they came from (the run's config, Islands' version, each weights file's
sha256). A run of Islands' own U-Net or DiT, which no diffusers class computes exactly, exports as IslandsUNet or
IslandsDiT (islands/nets/diffusers_wrapper.py), whose code ships beside it in OUT/islands_networks/: the networks'
own files, copied as they are but for their imports of each other, which are made relative (`shipped_source`), so
that a plain diffusers process imports them with OUT on its sys.path.

The scheduler's times are those of the run's path: a rectified-flow network's velocity eps - x0 at sigma = t is
what FlowMatchEulerDiscreteScheduler steps with, and a `vp_discrete` network's steps 0-999 are DDPMScheduler's with
the same betas. Islands' Euler grid is linspace(1, 0, steps + 1) shifted by sample.time_shift; diffusers' own default
grid ends at sigma 1 / 1000 instead of 0, so the same samples take `scheduler.set_timesteps(sigmas=grid[:-1])`
(tests/test_export.py).
"""

import json
import re
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import save_file

from islands import __version__, nets
from islands.conditions import condition_kind, network_spec
from islands.errors import CheckpointError, ConfigError
from islands.export.records import RUN_RECORD, ExportRecord
from islands.generate import load_denoiser
from islands.nets import OWN_NETWORK_ARGUMENTS, NetworkSpec
from islands.nets.diffusers_net import NULL_CAPTION
from islands.nets.diffusers_wrapper import PACKAGE, SHIPPED
from islands.rundir import CONFIG, built_beside, describe_run, latest_checkpoint, weights_file
from islands.untrusted import file_sha256

# the folder each class's pipelines read it from
COMPONENT = {"UNet2DModel": "unet", "UNet2DConditionModel": "unet", "DiTTransformer2DModel": "transformer",
             "SD3Transformer2DModel": "transformer", "FluxTransformer2DModel": "transformer",
             "IslandsUNet": "unet", "IslandsDiT": "transformer"}
# The diffusers pipeline that takes a network and a scheduler alone, where there is one: DiffusionPipeline's
# from_pretrained then loads the folder whole. The others' pipelines also want an autoencoder or text encoders; their
# folders are loaded a component at a time (`from_pretrained(OUT, subfolder=...)`).
PIPELINE = {"UNet2DModel": "DDPMPipeline"}
# the arguments an exported Islands network reads a caption from (it holds its null caption itself)
CAPTION = ("encoder_hidden_states", "encoder_attention_mask", "pooled_projections")


def scheduler_for(cfg):
    """The diffusers scheduler that steps the run's network as Islands' path defines it; ConfigError where none
    does."""
    import diffusers

    flow = cfg.flow
    if flow.path == "rectified_flow":
        if flow.prediction != "velocity":
            raise ConfigError(f"flow.prediction: {flow.prediction!r}; diffusers' flow-matching scheduler steps with "
                              f"the velocity a rectified-flow network predicts, so export takes velocity runs")
        return diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=cfg.sample.time_shift or 1.0)
    if flow.path == "vp_discrete":
        prediction = {"epsilon": "epsilon", "x0": "sample"}[flow.prediction]
        if flow.beta_schedule == "linear":  # islands/flow/paths.py VPDiscrete: DDPM's 1e-4 to 0.02
            betas = {"beta_schedule": "linear", "beta_start": 1e-4, "beta_end": 0.02}
        else:  # the path's own cosine betas, exactly as Islands trained on them
            from islands.flow.paths import build_path

            betas = {"trained_betas": build_path("vp_discrete", **flow.path_options()).betas.tolist()}
        # Islands never clips its data prediction; DPMSolverMultistepScheduler.from_config(this config) and
        # DDIMScheduler.from_config read the same betas, for fewer steps.
        return diffusers.DDPMScheduler(num_train_timesteps=flow.train_steps, prediction_type=prediction,
                                       clip_sample=False, **betas)
    raise ConfigError(f"flow.path: {flow.path!r} has no diffusers scheduler that steps it as Islands does; export "
                      f"takes rectified_flow and vp_discrete runs")


def null_caption(net) -> dict[str, torch.Tensor]:
    """A text network's learned null caption (Islands' own, not among the diffusers model's weights) as the diffusers
    model's forward takes a caption, for one example, under the names of the arguments its class reads:
    `model.text_tokens` rows of token states, the null token in row 0 and zeros below it (what SD3 and Flux read,
    every row), their mask (the U-Net reads the null token alone; the rows below are masked off, so that a caption's
    and the null's states stack into one batch), and the null pooled vector."""
    text, rows = net.text, net.text.widths.tokens
    with torch.no_grad():
        states, mask = text.given_tokens(None, 1, "cpu")
        caption = {"encoder_hidden_states": F.pad(states, (0, 0, 0, rows - states.shape[1])),
                   "encoder_attention_mask": F.pad(mask.long(), (0, rows - mask.shape[1]))}
        if "pooled_projections" in net.caption_arguments:
            caption["pooled_projections"] = text.given_pooled(None, 1, "cpu")
    return {name: caption[name].contiguous() for name in net.caption_arguments}


def shipped_source(name: str, source: str | None = None) -> str:
    """islands/nets/NAME.py (or `source`) as OUT/islands_networks/ ships it: its imports of the other shipped files
    made relative, nothing else changed. A file that imports anything else of Islands could not be imported there:
    that is Islands' own bug, refused loudly."""
    source = (Path(nets.__file__).parent / f"{name}.py").read_text() if source is None else source
    relative = re.sub(rf"^from islands\.nets\.({'|'.join(SHIPPED)}) import ", r"from .\1 import ", source,
                      flags=re.M)
    left = re.search(r"^\s*(from|import)\s+islands\b.*", relative, flags=re.M)
    if left:
        raise RuntimeError(f"islands/nets/{name}.py: {left.group(0).strip()!r} imports a part of Islands that "
                           f"{PACKAGE}/ does not ship; add it to islands.nets.diffusers_wrapper.SHIPPED")
    return relative


def write_package(folder: Path, sources: dict[str, str]) -> None:
    """FOLDER/islands_networks/: the networks' code (`shipped_source` of each of SHIPPED), importable as
    `islands_networks` with FOLDER on sys.path."""
    (folder / PACKAGE).mkdir()
    for name, source in sources.items():
        (folder / PACKAGE / f"{name}.py").write_text(source)
    (folder / PACKAGE / "__init__.py").write_text(
        f'"""Islands\' own networks as diffusers models, from Islands {__version__} (islands export)."""\n\n'
        f"from .diffusers_wrapper import IslandsDiT, IslandsUNet\n\n__all__ = ['IslandsDiT', 'IslandsUNet']\n")


def own_model(cfg, spec: NetworkSpec, net):
    """Islands' own network (built for `spec`) as its diffusers class (islands/nets/diffusers_wrapper.py), built from
    the arguments that built `net` and holding its weights, timesteps on the scale of the run's scheduler (`cfg`'s
    flow)."""
    from islands.nets.diffusers_wrapper import EXPORTED_CLASS  # imports diffusers

    arguments = OWN_NETWORK_ARGUMENTS[spec.model.arch](spec)
    text = arguments["text"]
    model = EXPORTED_CLASS[spec.model.arch](**arguments | {"text": None if text is None else vars(text)},
                                 num_train_timesteps=cfg.flow.train_steps if cfg.flow.path == "vp_discrete" else 1000)
    model.net.load_state_dict(net.state_dict())
    return model.eval()


def export_run(run_dir: Path, out: Path) -> Path:
    """Write the diffusers folder of the run `run_dir` at `out` (which must not exist, or be an empty folder): built
    beside it and renamed into place, so a failed export leaves nothing behind."""
    import diffusers

    run_dir, out = Path(run_dir), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: already exists and is not an empty folder; export writes a new one")
    cfg, info = describe_run(run_dir)
    kind = condition_kind(cfg.model)
    kind.check_exportable(cfg)
    arch = cfg.model.arch
    own = arch in OWN_NETWORK_ARGUMENTS
    if arch != "diffusers" and not own:
        raise ConfigError(f"model.arch: {arch!r} has no diffusers counterpart; export takes runs of model.arch "
                          f"unet, dit and diffusers")
    scheduler = scheduler_for(cfg)
    sources = {name: shipped_source(name) for name in SHIPPED} if own else {}
    ckpt = latest_checkpoint(run_dir)
    denoiser, cfg, _ = load_denoiser(run_dir, use_ema=True)
    if latest_checkpoint(run_dir) != ckpt:  # the run is training: the record must name the weights exported
        raise CheckpointError(f"{run_dir} wrote a new checkpoint while it was read; export again")
    net = denoiser.net
    if own:
        model, library = own_model(cfg, network_spec(cfg.model, info.shape, info.num_classes), net), PACKAGE
    else:
        model, library = net.to_diffusers(), "diffusers"
    class_name = type(model).__name__
    component = COMPONENT[class_name]

    with built_beside(out) as building:  # one a killed export left is removed; a person's `.OUT.partial` refused
        model.save_pretrained(building / component, safe_serialization=True)
        scheduler.save_pretrained(building / "scheduler")
        if own:
            write_package(building, sources)
        elif getattr(net, "text", None) is not None:  # the null that unconditional samples and guidance read
            save_file(null_caption(net), building / NULL_CAPTION)
        (building / "model_index.json").write_text(json.dumps(
            {"_class_name": PIPELINE.get(class_name, "DiffusionPipeline"), "_diffusers_version": diffusers.__version__,
             component: [library, class_name], "scheduler": ["diffusers", type(scheduler).__name__]}, indent=2))
        ExportRecord(islands_version=__version__, run_dir=str(run_dir), checkpoint=ckpt.name,
                     weights=weights_file(ckpt, True).name, config_sha256=file_sha256(run_dir / CONFIG),
                     config=yaml.safe_load((run_dir / CONFIG).read_text()),
                     **kind.export_record(cfg, run_dir, *((CAPTION, None) if own else
                                                          (getattr(net, "caption_arguments", ()), NULL_CAPTION))),
                     files={str(p.relative_to(building)): file_sha256(p) for p in sorted(building.rglob("*"))
                            if p.suffix in (".safetensors", ".py")}).write(building / RUN_RECORD)
    return out
